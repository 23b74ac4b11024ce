"""What a model family is to kvserve: plain data, no torch (the CLI and config read it).

A ``Family`` names the architecture (``ModelConfig.architecture``), where its checkpoints
say so (Hugging Face ``model_type`` values, GGUF ``general.architecture`` values), how
llama.cpp's converter laid its tensors out, and the few layer parts where it differs from
the Llama block (QK-norm, QKV bias, fused projections). The loaders, ``ModelConfig``, the
weights and the model read these fields; none of them compares an architecture name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _no_hf_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture kvserve runs: a Llama-style decoder with these differences."""

    name: str  # ModelConfig.architecture
    hf_model_types: tuple[str, ...]  # config.json "model_type" values
    # transformers' config and model classes (the oracle, ``benchmarks.tools.reference``).
    hf_classes: tuple[str, str] = ("LlamaConfig", "LlamaForCausalLM")
    gguf_archs: tuple[str, ...] = ()  # GGUF "general.architecture" values it loads from
    # The architecture llama.cpp's converter writes for it, when not its own (Mistral: llama).
    converts_to: str | None = None
    # llama.cpp's converter permuted the Q/K rows (Llama's adjacent-pair rotation); families
    # it runs with the NeoX rotation (Qwen) are written unpermuted.
    gguf_qk_permuted: bool = False
    # Per-head RMSNorm on Q and K before RoPE (Qwen3, Gemma 3): the layer holds
    # ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight`` ([head_dim] each).
    qk_norm: bool = False
    # The HF config's default for ``attention_bias`` when it does not say (Qwen2: True).
    hf_attention_bias: bool = False
    # ``ModelConfig`` fields from config.json that this family spells its own way (e.g.
    # Qwen2's sliding window, off unless ``use_sliding_window``).
    hf_overrides: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_hf_overrides
    # Q, K and V in one checkpoint matrix, rows in that order (Phi-3): HF
    # ``self_attn.qkv_proj.weight``; ``weights`` splits it at load.
    fused_qkv: bool = False
    # Gate and up in one checkpoint matrix, gate rows first (Phi-3): HF
    # ``mlp.gate_up_proj.weight``; ``weights`` splits it at load.
    fused_gate_up: bool = False
    # GGUF per-layer tensor suffix -> HF per-layer name, beyond (or instead of) the Llama
    # block's; ``gguf_absent_tensors``: the Llama block's suffixes this family's files lack.
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_absent_tensors: tuple[str, ...] = ()

    @property
    def gguf_arch(self) -> str:
        """The GGUF architecture llama.cpp's converter writes for this family."""
        return self.converts_to or (self.gguf_archs[0] if self.gguf_archs else self.name)

    def layer_weights(self, attention_bias: bool = False) -> tuple[str, ...]:
        """HF per-layer parameter names (after ``model.layers.{i}.``) of this family's
        block, every one required."""
        attn = ("qkv",) if self.fused_qkv else ("q", "k", "v")
        mlp = ("gate_up",) if self.fused_gate_up else ("gate", "up")
        names = (
            *(f"self_attn.{n}_proj.weight" for n in (*attn, "o")),
            *(f"mlp.{n}_proj.weight" for n in (*mlp, "down")),
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        )
        if attention_bias:
            names += tuple(f"self_attn.{n}_proj.bias" for n in attn)
        if self.qk_norm:
            names += ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
        return names
