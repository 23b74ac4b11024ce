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

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from model_runner.attention_backends.base import AttentionBackend, ForwardBatch
from model_runner.config import ModelConfig
from model_runner.environment import switch
from model_runner.families import family
from model_runner.future import FutureTokens
from model_runner.kv_pool import KVPool
from model_runner.rope import RopeTable, rope_inv_freq
from model_runner.weights import AnyLinear, LayerWeights, Linears, StateDict, load_weights

__all__ = ["LlamaModel", "rope_inv_freq"]

if TYPE_CHECKING:
    from model_runner.lora.updates import StepAdapters


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
        self._set_block_parts(config, dtype, device)

    def _set_block_parts(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device
    ) -> None:
        """The family's parts of the block beyond the weights: the MLP's activation, the
        embedding's scale, the RoPE table(s), and whether it is the Llama block."""
        fam = family(config.architecture)
        if fam.mlp_activation not in _ACTIVATIONS:
            raise ValueError(f"MLP activation {fam.mlp_activation!r}: kvserve runs silu, gelu_tanh")
        self.mlp_act = _ACTIVATIONS[fam.mlp_activation]
        # Gemma's embedding scale sqrt(hidden), rounded to the run's dtype as transformers does.
        self.embed_scale: torch.Tensor | None = None
        if fam.scaled_embedding:
            self.embed_scale = torch.tensor(config.hidden_size**0.5, device=device).to(dtype)
        self.rope = RopeTable(config, self.max_model_len, dtype, device)
        # The windowed layers' own table (Gemma 3's local base), else every layer shares one.
        self.local_rope: RopeTable | None = None
        if config.local_rope_theta is not None:
            local = dataclasses.replace(
                config, rope_theta=config.local_rope_theta, rope_scaling=None, extra={}
            )
            self.local_rope = RopeTable(local, self.max_model_len, dtype, device)
        self.layer_local_rope = tuple(config.local_rope(i) for i in range(config.num_layers))
        # The Llama block as the fused paths (Triton fusions, the kernels' whole step) run it.
        self.llama_block = not (
            fam.sandwich_norms
            or fam.norm_offset
            or fam.mlp_activation != "silu"
            or config.layer_windows
            or self.local_rope is not None
        )

    @property
    def inv_freq(self) -> torch.Tensor:
        """The (global layers') RoPE inverse frequencies [D/2]."""
        return self.rope.inv_freq

    @property
    def rope_cis(self) -> torch.Tensor | None:
        """The (global layers') complex rotations [max_len, 1, D/2] of an fp32 run."""
        return self.rope.cis

    @property
    def rope_cos(self) -> torch.Tensor | None:
        return self.rope.cos

    @property
    def rope_sin(self) -> torch.Tensor | None:
        return self.rope.sin

    # ------------------------------------------------------------------ forward

    def forward(self, batch: ForwardBatch[Any], pool: KVPool) -> torch.Tensor:
        """Hidden states [T, hidden] after the last layer (before the final norm) of every
        token in ``batch``; writes every layer's K/V of those tokens into ``pool``. The
        step's adapter updates (``batch.adapters``) are added after each projection."""
        ops = self._fusion_ops(batch, pool)
        if ops is not None:
            return self._forward_fused(ops, batch, pool)
        adapters = batch.adapters
        h_heads, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        n_rot = h_heads + kvh
        num_tokens = batch.num_tokens
        hidden = self.embed_rows(batch.input_ids)
        attn_out = torch.empty(num_tokens, h_heads * d, dtype=self.dtype, device=self.device)
        rotations = self.rope.rows(batch.positions, batch.max_position)
        local = None
        if self.local_rope is not None:
            local = self.local_rope.rows(batch.positions, batch.max_position)
        for i, layer in enumerate(self.layers):
            x = self._rms_norm(hidden, layer.input_norm)
            qkv = layer.qkv(x)
            adapters.add_(i, "qkv", x, qkv)
            qkv = qkv.view(num_tokens, n_rot + kvh, d)
            _qk_norm_(layer, qkv, h_heads, kvh, self.eps)
            rows = local if local is not None and self.layer_local_rope[i] else rotations
            rows.rotate_(qkv[:, :n_rot].unflatten(-1, (d // 2, 2)))
            self.attention.forward(i, qkv, batch, pool, attn_out)
            hidden = self._residual(
                layer.o, attn_out, hidden, layer.attn_out_norm, adapters, i, "o"
            )
            x = self._rms_norm(hidden, layer.post_norm)
            if layer.moe is not None:  # a mixture-of-experts layer (``moe.MoeMlp``)
                hidden = layer.moe.add(x, hidden)
                continue
            assert layer.gate_up is not None and layer.down is not None
            # The fused SiLU epilogue cannot take an update of gate or up, which goes in first.
            if self.mlp_act is F.silu and not adapters.touches(i, "gate_up"):
                act = layer.gate_up.silu_mul(x)
            else:
                gate_up = layer.gate_up(x)
                adapters.add_(i, "gate_up", x, gate_up)
                act = _gated(gate_up, self.mlp_act)
            hidden = self._residual(
                layer.down, act, hidden, layer.mlp_out_norm, adapters, i, "down"
            )
        return hidden

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x`` [T, hidden] times ``weight``; a weight held in fp32 (Gemma's
        norms) computes in fp32 and rounds once to ``x``'s dtype."""
        if weight.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.eps).to(x.dtype)

    def _residual(
        self,
        linear: AnyLinear,
        x: torch.Tensor,
        residual: torch.Tensor,
        out_norm: torch.Tensor | None,
        adapters: StepAdapters,
        i: int,
        projection: str,
    ) -> torch.Tensor:
        """``residual + linear(x)`` with layer ``i``'s adapter update of ``projection`` added
        to ``linear(x)``; with ``out_norm`` (sandwich norms) that sum is normed before the add."""
        if out_norm is None:
            out = linear.add(x, residual)
            adapters.add_(i, projection, x, out)
            return out
        y = linear(x)
        adapters.add_(i, projection, x, y)
        return residual + self._rms_norm(y, out_norm)

    def _fusion_ops(self, batch: ForwardBatch[Any], pool: KVPool) -> Any:
        """The ``triton_fusions`` module when this step can take it, else None: fusions on
        (``fusions``), float weights in plain ``Linear`` layers (no oneDNN, nothing
        quantized), a float pool, positions inside the RoPE table, a power-of-two head_dim,
        the Llama block (``llama_block``) with dense MLPs (no ``moe``), and Triton
        importable."""
        d = self.head_dim
        if (
            not self.fusions
            or self.linear_backend != "torch"
            or d & (d - 1)
            or not self.llama_block
        ):
            return None
        if any(layer.moe is not None for layer in self.layers):
            return None
        if pool.scales is not None or batch.max_position >= self.max_model_len:
            return None
        if batch.window_slot_mapping is not None:  # one slot mapping for every layer there
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
        rounded once per fused op; the adapter updates go in after each projection, as
        there."""
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
        layers, adapters = self.layers, batch.adapters
        x = ops.add_rms_norm(None, residual, layers[0].input_norm, self.eps)
        for i, layer in enumerate(layers):
            qkv = layer.qkv(x)
            adapters.add_(i, "qkv", x, qkv)
            qkv = qkv.view(num_tokens, -1, d)
            _qk_norm_(layer, qkv, h_heads, self.num_kv_heads, self.eps)
            ops.rope_kv_write(
                qkv, cos, sin, batch.positions, batch.slot_mapping, pool.data[i], h_heads
            )
            self.attention.attend(i, qkv, batch.metadata, pool, attn_out)
            o = layer.o(attn_out)
            adapters.add_(i, "o", attn_out, o)
            x = ops.add_rms_norm(o, residual, layer.post_norm, self.eps)
            assert layer.gate_up is not None and layer.down is not None
            gate_up = layer.gate_up(x)
            adapters.add_(i, "gate_up", x, gate_up)
            act = ops.silu_mul(gate_up)
            down = layer.down(act)
            adapters.add_(i, "down", act, down)
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
        rows = self.embed(token_ids)
        if self.embed_scale is not None:
            rows = rows * self.embed_scale.to(rows.dtype)
        return rows

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on the given rows [R, hidden] -> fp32 logits [R, V], soft-
        capped when the config says (``final_logit_softcapping``)."""
        logits = self.lm_head(self._rms_norm(hidden, self.norm)).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# ``Family.mlp_activation`` -> the gate's activation.
_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": _gelu_tanh}


def _gated(gate_up: torch.Tensor, act: Any) -> torch.Tensor:
    """``act(gate) * up`` from the gate and up projections ``gate_up`` [T, 2 * inter]."""
    inter = gate_up.shape[-1] // 2
    return act(gate_up[:, :inter]).mul_(gate_up[:, inter:])


def _qk_norm_(layer: LayerWeights, qkv: torch.Tensor, h: int, kvh: int, eps: float) -> None:
    """Per-head RMSNorm of Q and K in place in ``qkv`` [T, H + 2 * kvh, D], before RoPE, for a
    layer with QK-norm weights (Qwen3, Gemma 3); nothing for the Llama block."""
    if layer.q_norm is None or layer.k_norm is None:
        return
    d = qkv.shape[-1]
    q, k = qkv[:, :h], qkv[:, h : h + kvh]
    fp32 = layer.q_norm.dtype != qkv.dtype  # Gemma's norms compute in fp32
    q.copy_(F.rms_norm(q.float() if fp32 else q, (d,), layer.q_norm, eps))
    k.copy_(F.rms_norm(k.float() if fp32 else k, (d,), layer.k_norm, eps))
