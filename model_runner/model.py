"""The LLaMA-family model (LLaMA, Mistral, Qwen2, Qwen3, Phi-3, and the mixture-of-experts
Qwen3-MoE and Mixtral: ``model_runner.families``) as a functional forward pass over a paged KV
pool.

Its weights come prepared from ``weights.load_weights`` (Q, K and V fused, the softmax scale
in Q, RoPE pairs interleaved, each matrix a layer chosen by ``Linears.make_linear``), so the
forward pass calls ``linear(x)`` and the layers' fused epilogues and never asks what a
weight is held as.
On CUDA the small ops between the GEMMs run as three Triton kernels
(``triton_fusions``: residual add + RMSNorm, RoPE + the KV write, SiLU x up).

No ``nn.Module``: a step is a loop over plain tensors, so Python overhead per layer is a few
dozen tensor ops and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from model_runner.attention_backends.base import AttentionBackend, ForwardBatch
from model_runner.config import ModelConfig
from model_runner.environment import switch
from model_runner.families import family
from model_runner.future import FutureTokens
from model_runner.kv_pool import KVPool
from model_runner.rope import rope_inv_freq, rope_magnitude
from model_runner.weights import LayerWeights, Linears, StateDict, load_weights

if TYPE_CHECKING:
    from model_runner.lora.step import TorchLora


def fusions_default(device: torch.device) -> bool:
    """The layer fusions are on where they were written for: CUDA, unless KVSERVE_FUSIONS=0."""
    return device.type == "cuda" and switch("fusions") != "0"


class LlamaModel:
    """Weights plus the forward pass of one step over a ``KVPool``."""

    # The layer fusions (``triton_fusions``) in ``forward`` where they apply
    # (``_fusion_ops``): on CUDA unless KVSERVE_FUSIONS=0 (read once, at start); tests set
    # it to run them in Triton's interpreter on CPU.
    fusions: bool = False

    def __init__(
        self,
        config: ModelConfig,
        state_dict: StateDict,
        dtype: torch.dtype,
        device: torch.device,
        attention: AttentionBackend[Any],
        max_model_len: int | None = None,
        use_onednn: bool | None = None,
        activation_bits: int = 16,
        *,
        future: FutureTokens | None = None,
    ) -> None:
        """``state_dict`` has Hugging Face names; it is read, not kept. ``use_onednn`` and
        ``activation_bits``: see ``weights.Linears``. ``future``: where negative token ids
        (a step planned ahead: ``model_runner.future``) are resolved in ``embed_rows``."""
        family(config.architecture)  # ValueError naming the families kvserve runs
        if config.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {config.head_dim}")
        self.config = config
        self.dtype = dtype
        self.device = device
        self.fusions = fusions_default(device)
        self.attention = attention
        self.future = future
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.activation_bits = activation_bits
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.hidden_size = config.hidden_size
        self.eps = config.rms_norm_eps
        linears = Linears(dtype, device, use_onednn, activation_bits)
        weights = load_weights(config, state_dict, linears)
        self.layers = weights.layers
        self.embed = weights.embed
        self.norm = weights.norm
        self.lm_head = weights.lm_head
        self.vocab_size = weights.vocab_size
        self.weights_format = weights.formats
        self.weight_bytes = weights.num_bytes()
        self.linear_backend = linears.backend(weights.formats)
        self.inv_freq = rope_inv_freq(config, self.max_model_len).to(device)
        self.rope_mag = rope_magnitude(config).to(device)  # longrope's scale on cos and sin
        angles = torch.outer(torch.arange(self.max_model_len, device=device).float(), self.inv_freq)
        # [max_len, 1, D/2]: complex rotations (fp32 runs) or cos / sin (half precision).
        self.rope_cis: torch.Tensor | None = None
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        if dtype == torch.float32:
            self.rope_cis = self._rotations(angles).unsqueeze(1)
        else:
            self.rope_cos, self.rope_sin = self._cos_sin(angles)

    def _rotations(self, angles: torch.Tensor) -> torch.Tensor:
        """``rope_mag * exp(i * angles)`` (complex64) for ``angles`` [..., D/2]."""
        return torch.polar(self.rope_mag.expand_as(angles).contiguous(), angles)

    def _cos_sin(self, angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_mag * (cos, sin)`` of ``angles`` [N, D/2] in the model's dtype, [N, 1, D/2]."""
        cos, sin = angles.cos() * self.rope_mag, angles.sin() * self.rope_mag
        return cos.to(self.dtype).unsqueeze(1), sin.to(self.dtype).unsqueeze(1)

    # ------------------------------------------------------------------ forward

    def forward(
        self, batch: ForwardBatch[Any], pool: KVPool, lora: TorchLora | None = None
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm) of every
        token in ``batch``; writes every layer's K/V of those tokens into ``pool``.
        ``lora``: the step's adapter updates, added after each projection they touch."""
        ops = self._fusion_ops(batch, pool) if lora is None else None
        if ops is not None:
            return self._forward_fused(ops, batch, pool)
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
                cis = self._rotations(angles).unsqueeze(1)
            else:
                cos, sin = self._cos_sin(angles)
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
            _qk_norm_(layer, qkv, h_heads, kvh, self.eps)
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
            if layer.moe is not None:  # a mixture-of-experts layer (``moe.MoeMlp``)
                hidden = layer.moe.add(x, hidden)
                continue
            assert layer.gate_up is not None and layer.down is not None
            if lora is not None and lora.touches(i, lora.gate_up_spans):
                act = _mlp_with_lora(layer.gate_up(x), i, x, lora)
            else:
                act = layer.gate_up.silu_mul(x)
            hidden = layer.down.add(act, hidden)
            if lora is not None:
                lora.add_(i, (("down", 0),), act, hidden)
        return hidden

    def _fusion_ops(self, batch: ForwardBatch[Any], pool: KVPool) -> Any:
        """The ``triton_fusions`` module when this step can take it, else None: fusions on
        (``fusions``), float weights in plain ``Linear`` layers (no oneDNN, nothing
        quantized), a float pool, positions inside the RoPE table, a power-of-two head_dim,
        dense MLPs (no ``moe``), and Triton importable."""
        d = self.head_dim
        if not self.fusions or self.linear_backend != "torch" or d & (d - 1):
            return None
        if any(layer.moe is not None for layer in self.layers):
            return None
        if pool.scales is not None or batch.max_position >= self.max_model_len:
            return None
        try:
            from model_runner import triton_fusions
        except ImportError:
            return None
        return triton_fusions

    def _forward_fused(self, ops: Any, batch: ForwardBatch[Any], pool: KVPool) -> torch.Tensor:
        """``forward`` with the layer fusions: the residual stream is updated in place by
        ``add_rms_norm`` (which also gives the next norm's input), RoPE and the KV write are
        one kernel, ``silu(gate) * up`` another. The same arithmetic as the torch path,
        rounded once per fused op."""
        h_heads, d = self.num_heads, self.head_dim
        num_tokens = batch.num_tokens
        residual = self.embed_rows(batch.input_ids)
        if self.rope_cis is not None:  # fp32: the complex table's (cos, sin) pairs, strided
            pairs = torch.view_as_real(self.rope_cis.squeeze(1))
            cos, sin = pairs[..., 0], pairs[..., 1]
        else:
            assert self.rope_cos is not None and self.rope_sin is not None
            cos, sin = self.rope_cos.squeeze(1), self.rope_sin.squeeze(1)
        attn_out = torch.empty(num_tokens, h_heads * d, dtype=self.dtype, device=self.device)
        layers = self.layers
        x = ops.add_rms_norm(None, residual, layers[0].input_norm, self.eps)
        for i, layer in enumerate(layers):
            qkv = layer.qkv(x).view(num_tokens, -1, d)
            _qk_norm_(layer, qkv, h_heads, self.num_kv_heads, self.eps)
            ops.rope_kv_write(
                qkv, cos, sin, batch.positions, batch.slot_mapping, pool.data[i], h_heads
            )
            self.attention.attend(i, qkv, batch.metadata, pool, attn_out)
            x = ops.add_rms_norm(layer.o(attn_out), residual, layer.post_norm, self.eps)
            assert layer.gate_up is not None and layer.down is not None
            down = layer.down(ops.silu_mul(layer.gate_up(x)))
            if i + 1 < len(layers):
                x = ops.add_rms_norm(down, residual, layers[i + 1].input_norm, self.eps)
            else:
                residual.add_(down)
        return residual

    def embed_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden] of ``token_ids`` (quantized tables dequantize just these);
        placeholder ids are resolved first, on the device (``future``)."""
        if self.future is not None:
            token_ids = self.future.resolve(token_ids)
        return self.embed(token_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given rows [R, hidden] -> fp32 logits [R, V]."""
        x = F.rms_norm(hidden, (self.hidden_size,), self.norm, self.eps)
        return self.lm_head(x).float()


def _mlp_with_lora(gate_up: torch.Tensor, i: int, x: torch.Tensor, lora: TorchLora) -> torch.Tensor:
    """``silu(gate) * up`` from the gate and up projections ``gate_up`` [T, 2 * inter] with
    the adapters' updates of gate and up added before the SiLU (the fused epilogues cannot
    take them)."""
    lora.add_(i, lora.gate_up_spans, x, gate_up)
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])


def _qk_norm_(layer: LayerWeights, qkv: torch.Tensor, h: int, kvh: int, eps: float) -> None:
    """Per-head RMSNorm of Q and K in place in ``qkv`` [T, H + 2 * kvh, D], before RoPE, for a
    layer with QK-norm weights (Qwen3); nothing for the Llama block."""
    if layer.q_norm is None or layer.k_norm is None:
        return
    d = qkv.shape[-1]
    q, k = qkv[:, :h], qkv[:, h : h + kvh]
    q.copy_(F.rms_norm(q, (d,), layer.q_norm, eps))
    k.copy_(F.rms_norm(k, (d,), layer.k_norm, eps))


def _rope_real_(rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In-place RoPE on interleaved pairs ``rot`` [T, n, D/2, 2] (half-precision path)."""
    x0 = rot[..., 0]
    x1 = rot[..., 1]
    r0 = x0 * cos - x1 * sin
    r1 = x0 * sin + x1 * cos
    x0.copy_(r0)
    x1.copy_(r1)
