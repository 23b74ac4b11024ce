"""What a model family is to kvserve: plain data, no torch (the CLI and config read it).

A ``Family`` names the architecture (``ModelConfig.architecture``), where its checkpoints
say so (Hugging Face ``model_type`` values, GGUF ``general.architecture`` values), how
llama.cpp's converter laid its tensors out, and the few layer parts where it differs from
the Llama block (QK-norm, QKV bias). The loaders, ``ModelConfig``, the weights and the model
read these fields; none of them compares an architecture name.
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
    # transformers' config and model classes (the oracle, ``model_runner.reference``).
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
    # GGUF per-layer tensor suffix -> HF per-layer name, beyond the Llama block's.
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=dict)

    @property
    def gguf_arch(self) -> str:
        """The GGUF architecture llama.cpp's converter writes for this family."""
        return self.converts_to or (self.gguf_archs[0] if self.gguf_archs else self.name)

    def extra_layer_weights(self) -> tuple[str, ...]:
        """HF per-layer parameter names (after ``model.layers.{i}.``) this family adds to
        the Llama block's, every one required."""
        names: tuple[str, ...] = ()
        if self.qk_norm:
            names += ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
        return names
