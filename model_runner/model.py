"""The LLaMA-family model (LLaMA, Mistral, Qwen2) as a functional forward pass over a paged
KV pool.

Hugging Face parameter names come in; at load time the weights are rearranged for speed:

- Q, K, V projections are fused into one ``[(H + 2 * kvh) * D, hidden]`` matrix (one GEMM),
  with the Qwen2 QKV bias fused alike.
- The softmax scale ``1/sqrt(D)`` is folded into the Q rows (attention runs with scale 1).
- Q and K rows are permuted inside each head from Hugging Face's half-split RoPE layout
  ``(x_0..x_{D/2-1}, x_{D/2}..x_{D-1})`` to interleaved pairs ``(x_0, x_{D/2}, x_1, ...)``, so
  RoPE is one in-place complex multiply. Q and K get the same permutation, so q.k (and
  attention) is unchanged; the pool stores keys in this layout.
- On CPU, every matrix is pre-packed for oneDNN (``torch.ops.mkldnn``), whose skinny GEMM
  streams fp32 weights near memory bandwidth where MKL's ``F.linear`` reaches about half
  of it, and which fuses SiLU into the gate GEMM, the ``* up`` product into the up GEMM and
  the residual add into the output and down GEMMs. Elsewhere (CUDA, or when the self-check
  fails) plain ``F.linear`` / ``addmm`` with a fused gate+up matrix.

No ``nn.Module``: a step is a loop over plain tensors, so Python overhead per layer is a few
dozen tensor ops and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from model_runner import onednn
from model_runner.attention_backends.base import AttentionBackend, ForwardBatch
from model_runner.config import ModelConfig
from model_runner.kv_pool import KVPool
from model_runner.quant import QEmbedding, QLinear, QuantStack, QuantWeight, cat_rows

if TYPE_CHECKING:
    from model_runner.lora.step import TorchLora

# ---------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32) with the checkpoint's theta and scaling.

    Supports no scaling, ``"linear"`` and ``"llama3"`` (Hugging Face's formulas); anything
    else raises, because the model would silently produce wrong text.
    """
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    freq_factors = config.extra.get("rope_freqs")
    if freq_factors is not None:
        # llama.cpp's GGUF stores Llama-3.x rope scaling as per-frequency divisors
        # (``rope_freqs.weight``, ggml's freq_factors) instead of a rope_scaling entry.
        if len(freq_factors) != dim // 2:
            raise ValueError(
                f"rope_freqs has {len(freq_factors)} factors, head_dim {dim} needs {dim // 2}"
            )
        if config.rope_scaling and config.rope_scaling.get("rope_type") == "llama3":
            raise ValueError("rope_freqs and rope_scaling llama3 both scale RoPE: keep one")
        return inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


def _interleave_rows(w: Weight, num_heads: int, head_dim: int) -> Weight:
    """Permute each head's rows from half-split (HF) to interleaved RoPE pair order."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half, head_dim)], dim=1).flatten()
    if isinstance(w, QuantWeight):
        heads = torch.arange(num_heads).unsqueeze(1) * head_dim
        return w.rows((heads + order.to(heads.device)).flatten())
    shape = w.shape
    return w.reshape(num_heads, head_dim, -1)[:, order].reshape(shape)


def _scaled(w: Weight, factor: float) -> Weight:
    return w.scaled(factor) if isinstance(w, QuantWeight) else w * factor


def _dense(w: Weight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, (QuantWeight, QuantStack)) else w


def _cat_rows(weights: list[Weight]) -> Weight:
    """Stack row blocks; quantized ones stay quantized, each in its own format (else fp32)."""
    if all(isinstance(w, QuantWeight) for w in weights):
        quant = [w for w in weights if isinstance(w, QuantWeight)]
        if len({w.in_features for w in quant}) == 1:
            return cat_rows(quant)
    return torch.cat([_dense(w) for w in weights])


def _describe_formats(state_dict: Mapping[str, Weight]) -> str:
    """``"Q4_1+Q8_0"``-style list of the quantized formats held, or ``"float"``."""
    sources = sorted({w.source for w in state_dict.values() if isinstance(w, QuantWeight)})
    return "+".join(sources) if sources else "float"


def _weight_bytes(model: LlamaModel) -> int:
    """Bytes of every weight tensor the model holds (shared tensors counted once)."""
    seen: dict[int, int] = {}

    def add(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            if not obj.is_mkldnn:
                seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
            else:  # oneDNN-packed: opaque storage, the logical size
                seen[id(obj)] = obj.numel() * obj.element_size()
        elif isinstance(obj, (QuantWeight, QuantStack)):
            for t in obj.tensors():
                add(t)
        elif isinstance(obj, (Linear, QLinear)):
            add(obj.weight)
            add(obj.bias)
        elif isinstance(obj, QEmbedding):
            add(obj.weight)

    for layer in model.layers:
        for name in LayerWeights.__slots__:
            add(getattr(layer, name))
    for obj in (model.embed, model.norm, model.lm_head):
        add(obj)
    return sum(seen.values())


# ---------------------------------------------------------------------------- linear


class Linear:
    """``y = x @ W.T + b`` with optional fused epilogues; the weight is either a plain tensor
    or a oneDNN-packed one (CPU)."""

    __slots__ = ("bias", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = pack
        if pack:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight)
        else:
            self.weight = weight.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return onednn.linear(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(linear(x))``."""
        if self.packed:
            return onednn.linear(x, self.weight, self.bias, "swish", [], "")
        return F.silu(F.linear(x, self.weight, self.bias))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``linear(x) * other``."""
        if self.packed:
            return onednn.linear_binary(x, other, self.weight, self.bias, "mul")
        return F.linear(x, self.weight, self.bias).mul_(other)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x)`` (a new tensor; ``residual`` is not modified)."""
        if self.packed:
            return onednn.linear_binary(x, residual, self.weight, self.bias, "add")
        if self.bias is None:
            return torch.addmm(residual, x, self.weight.t())
        return F.linear(x, self.weight, self.bias).add_(residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for a weight holding the gate rows, then the up rows."""
        gu = self(x)
        inter = gu.shape[-1] // 2
        return F.silu(gu[:, :inter]).mul_(gu[:, inter:])


def onednn_works(dtype: torch.dtype) -> bool:
    """Self-check of the oneDNN path on this machine: every epilogue against ``F.linear``."""
    if not onednn.available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g).to(dtype)
        b = torch.randn(24, generator=g).to(dtype)
        x = torch.randn(3, 16, generator=g).to(dtype)
        other = torch.randn(3, 24, generator=g).to(dtype)
        packed = Linear(w, b, pack=True)
        dense = Linear(w, b, pack=False)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return all(
            torch.allclose(p.float(), d.float(), atol=tol, rtol=tol)
            for p, d in (
                (packed(x), dense(x)),
                (packed.silu(x), dense.silu(x)),
                (packed.mul(x, other), dense.mul(x, other)),
                (packed.add(x, other), dense.add(x, other)),
            )
        )
    except RuntimeError:
        return False


# ---------------------------------------------------------------------------- weights


AnyLinear = Linear | QLinear
Weight = torch.Tensor | QuantWeight | QuantStack


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: AnyLinear
    o: AnyLinear
    post_norm: torch.Tensor
    gate: Linear | None  # oneDNN path: separate gate (with SiLU) and up (with * gate)
    up: Linear | None
    gate_up: AnyLinear | None  # dense and quantized paths: one fused [2 * I, hidden] GEMM
    down: AnyLinear


class LlamaModel:
    """Weights plus the forward pass of one step over a ``KVPool``."""

    def __init__(
        self,
        config: ModelConfig,
        state_dict: Mapping[str, torch.Tensor | QuantWeight],
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionBackend[Any],
        max_model_len: int | None = None,
        use_onednn: bool | None = None,
        activation_bits: int = 16,
    ) -> None:
        """``activation_bits``: the quantized kernels' activation precision
        (``quant.ACTIVATION_BITS``)."""
        if config.architecture not in ("llama", "mistral", "qwen2"):
            raise ValueError(
                f"unsupported architecture {config.architecture!r}: llama, mistral or qwen2"
            )
        if config.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {config.head_dim}")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.attention = attention
        self.max_model_len = max_model_len or config.max_position_embeddings
        if use_onednn is None:
            use_onednn = device.type == "cpu" and onednn_works(dtype)
        elif use_onednn and (device.type != "cpu" or not onednn_works(dtype)):
            raise ValueError(f"oneDNN linear layers unavailable for {device} / {dtype}")
        self.use_onednn = use_onednn
        self.activation_bits = activation_bits
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.eps = config.rms_norm_eps

        missing = [k for k in _required_names(config) if k not in state_dict]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"state dict lacks {len(missing)} weights the config needs: {shown}")

        quantized = [n for n, w in state_dict.items() if isinstance(w, QuantWeight)]
        if quantized and (device.type != "cpu" or dtype != torch.float32):
            raise ValueError(
                f"{len(quantized)} quantized weights ({quantized[0]}, ...) run on the CPU "
                f"kernels with float32 compute, not {device} / {dtype}"
            )
        self.weights_format = _describe_formats(state_dict)

        def get(name: str) -> torch.Tensor:
            # fp32 for the arithmetic below, then the run dtype on the run device.
            w = state_dict[name]
            if isinstance(w, QuantWeight):
                w = w.dequantize()
            return w.to(device=device, dtype=torch.float32)

        def matrix(name: str) -> Weight:
            w = state_dict[name]
            return w if isinstance(w, QuantWeight) else get(name)

        def final(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).contiguous()

        def linear(w: Weight, bias: torch.Tensor | None = None) -> AnyLinear:
            if isinstance(w, (QuantWeight, QuantStack)):
                return QLinear(w, bias, activation_bits)
            return Linear(final(w), bias, use_onednn)

        h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
        scale = 1.0 / math.sqrt(d)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            wq = _scaled(_interleave_rows(matrix(p + "self_attn.q_proj.weight"), h, d), scale)
            wk = _interleave_rows(matrix(p + "self_attn.k_proj.weight"), kvh, d)
            wv = matrix(p + "self_attn.v_proj.weight")
            bias: torch.Tensor | None = None
            if config.attention_bias:
                bias = final(
                    torch.cat(
                        [
                            _interleave_rows(get(p + "self_attn.q_proj.bias"), h, d) * scale,
                            _interleave_rows(get(p + "self_attn.k_proj.bias"), kvh, d),
                            get(p + "self_attn.v_proj.bias"),
                        ]
                    )
                )
            qkv = linear(_cat_rows([wq, wk, wv]), bias)
            o = linear(matrix(p + "self_attn.o_proj.weight"))
            w_gate = matrix(p + "mlp.gate_proj.weight")
            w_up = matrix(p + "mlp.up_proj.weight")
            gate: Linear | None = None
            up: Linear | None = None
            gate_up: AnyLinear | None = None
            if use_onednn and not isinstance(w_gate, QuantWeight):
                gate = Linear(final(_dense(w_gate)), None, True)
                up = Linear(final(_dense(w_up)), None, True)
            else:
                gate_up = linear(_cat_rows([w_gate, w_up]))
            self.layers.append(
                LayerWeights(
                    input_norm=final(get(p + "input_layernorm.weight")),
                    qkv=qkv,
                    o=o,
                    post_norm=final(get(p + "post_attention_layernorm.weight")),
                    gate=gate,
                    up=up,
                    gate_up=gate_up,
                    down=linear(matrix(p + "mlp.down_proj.weight")),
                )
            )
            del wq, wk, wv, w_gate, w_up
        embed = matrix("model.embed_tokens.weight")
        self.embed: torch.Tensor | QEmbedding = (
            QEmbedding(embed) if isinstance(embed, QuantWeight) else final(embed)
        )
        self.norm = final(get("model.norm.weight"))
        head = "lm_head.weight" if "lm_head.weight" in state_dict else "model.embed_tokens.weight"
        if head == "model.embed_tokens.weight" and not config.tie_word_embeddings:
            raise ValueError("state dict has no lm_head.weight and the config does not tie it")
        # Tied + oneDNN: the head is a packed copy of the embedding (the lookup needs it dense).
        # Tied + quantized: the lookup and the head share one QuantWeight.
        self.lm_head = linear(matrix(head))
        self.vocab_size = embed.shape[0]
        self.weight_bytes = _weight_bytes(self)

        inv_freq = rope_inv_freq(config).to(device)
        self.inv_freq = inv_freq
        angles = torch.outer(torch.arange(self.max_model_len, device=device).float(), inv_freq)
        # [max_len, 1, D/2]: complex rotations (fp32 runs) or cos / sin (half precision).
        if dtype == torch.float32:
            self.rope_cis: torch.Tensor | None = torch.polar(torch.ones_like(angles), angles)
            self.rope_cis = self.rope_cis.unsqueeze(1)
            self.rope_cos = self.rope_sin = None
        else:
            self.rope_cis = None
            self.rope_cos = angles.cos().to(dtype).unsqueeze(1)
            self.rope_sin = angles.sin().to(dtype).unsqueeze(1)

    # ------------------------------------------------------------------ forward

    def forward(
        self, batch: ForwardBatch[Any], pool: KVPool, lora: TorchLora | None = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm) of every
        token in ``batch``; writes every layer's K/V of those tokens into ``pool``.
        ``lora``: the step's adapter updates, added after each projection they touch."""
        h_heads, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        n_rot = h_heads + kvh
        num_tokens = batch.num_tokens
        hidden = self.embed_rows(batch.input_ids)
        attn_out = torch.empty(num_tokens, h_heads * d, dtype=self.dtype, device=self.device)
        if batch.max_position >= self.max_model_len:
            # Past the table (attention sinks stream past the context): the same product
            # as the table's rows, computed for this step's positions only.
            angles = batch.positions.float().unsqueeze(1) * self.inv_freq
            if self.rope_cis is not None:
                cis = torch.polar(torch.ones_like(angles), angles).unsqueeze(1)
            else:
                cos = angles.cos().to(self.dtype).unsqueeze(1)
                sin = angles.sin().to(self.dtype).unsqueeze(1)
        elif self.rope_cis is not None:
            cis = self.rope_cis.index_select(0, batch.positions)
        else:
            assert self.rope_cos is not None and self.rope_sin is not None
            cos = self.rope_cos.index_select(0, batch.positions)
            sin = self.rope_sin.index_select(0, batch.positions)
        normed_shape = (self.hidden_size,)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, normed_shape, layer.input_norm, self.eps)
            qkv = layer.qkv(x)
            if lora is not None:
                lora.add_(i, lora.qkv_spans, x, qkv)
            qkv = qkv.view(num_tokens, n_rot + kvh, d)
            rot = qkv[:, :n_rot].unflatten(-1, (d // 2, 2))
            if self.rope_cis is not None:
                torch.view_as_complex(rot).mul_(cis)
            else:
                _rope_real_(rot, cos, sin)
            self.attention.forward(i, qkv, batch, pool, attn_out)
            hidden = layer.o.add(attn_out, hidden)
            if lora is not None:
                lora.add_(i, (("o", 0),), attn_out, hidden)
            x = F.rms_norm(hidden, normed_shape, layer.post_norm, self.eps)
            if lora is not None and lora.touches(i, lora.gate_up_spans):
                act = _mlp_with_lora(layer, x, i, lora)
            elif layer.gate_up is not None:
                act = layer.gate_up.silu_mul(x)
            else:
                assert layer.gate is not None and layer.up is not None
                act = layer.up.mul(x, layer.gate.silu(x))
            hidden = layer.down.add(act, hidden)
            if lora is not None:
                lora.add_(i, (("down", 0),), act, hidden)
        return hidden

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden] of ``token_ids`` (quantized tables dequantize just these)."""
        if isinstance(self.embed, QEmbedding):
            return self.embed(token_ids)
        return F.embedding(token_ids, self.embed)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given rows [R, hidden] -> fp32 logits [R, V]."""
        x = F.rms_norm(hidden, (self.hidden_size,), self.norm, self.eps)
        return self.lm_head(x).float()


def _mlp_with_lora(layer: LayerWeights, x: torch.Tensor, i: int, lora: TorchLora) -> torch.Tensor:
    """``silu(gate) * up`` with the adapters' updates of gate and up added before the SiLU
    (the fused epilogues cannot take them)."""
    if layer.gate_up is not None:
        gu = layer.gate_up(x)
        lora.add_(i, lora.gate_up_spans, x, gu)
        inter = gu.shape[-1] // 2
        return F.silu(gu[:, :inter]).mul_(gu[:, inter:])
    assert layer.gate is not None and layer.up is not None
    gate, up = layer.gate(x), layer.up(x)
    lora.add_(i, (("gate", 0),), x, gate)
    lora.add_(i, (("up", 0),), x, up)
    return F.silu(gate).mul_(up)


def _rope_real_(rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In-place RoPE on interleaved pairs ``rot`` [T, n, D/2, 2] (half-precision path)."""
    x0 = rot[..., 0]
    x1 = rot[..., 1]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    x0.copy_(r0)
    x1.copy_(r1)


def _required_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")] + [
            p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")
        ]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in ("q", "k", "v")]
    return names
