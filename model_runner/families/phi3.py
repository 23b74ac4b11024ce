"""Phi-3 and Phi-4 (``Phi3ForCausalLM``: Phi-3-mini/medium, Phi-3.5-mini, Phi-4, Phi-4-mini):
the Llama block with Q, K and V in one matrix (``self_attn.qkv_proj``) and gate and up in
another (``mlp.gate_up_proj``, gate rows first), split at load; RoPE on the first
``partial_rotary_factor`` of each head (Phi-4-mini: 0.75) with the ``longrope`` scaling (also
spelled ``su``; transformers reads ``yarn`` as it too) of the 128k models, whose
``original_max_position_embeddings`` is a top-level config field (4096 when absent).

llama.cpp's converter (``Phi3MiniModel``) writes the ``phi3`` architecture: ``phi3.*`` keys
(``phi3.rope.dimension_count`` = rotary dimensions, ``phi3.rope.scaling.attn_factor``,
``phi3.rope.scaling.original_context_length``), ``blk.{i}.attn_qkv.weight``,
``blk.{i}.ffn_up.weight`` holding gate then up (ggml's fused SwiGLU reads the first half as
the gate), Q/K unpermuted (NeoX rotation), and the factors as ``rope_factors_long.weight`` /
``rope_factors_short.weight``. A uniform ``sliding_window`` (Phi-3-mini-4k: 2047) runs as
Mistral's does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_runner.families.base import Family

_LONGROPE_SPELLINGS = ("longrope", "su", "yarn")  # Phi3Config's convert_rope_params_to_dict


def _hf_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    scaling = cfg.get("rope_scaling")
    if not isinstance(scaling, Mapping):
        return {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _LONGROPE_SPELLINGS:
        return {}
    # transformers gives the top-level field priority over rope_parameters' own.
    original = cfg.get("original_max_position_embeddings")
    if original is None:
        original = scaling.get("original_max_position_embeddings", 4096)
    return {
        "rope_scaling": {
            **scaling,
            "rope_type": "longrope",
            "original_max_position_embeddings": int(original),
        }
    }


PHI3 = Family(
    name="phi3",
    hf_model_types=("phi3",),
    hf_classes=("Phi3Config", "Phi3ForCausalLM"),
    gguf_archs=("phi3",),
    fused_qkv=True,
    fused_gate_up=True,
    hf_overrides=_hf_overrides,
    gguf_layer_tensors={
        "attn_qkv.weight": "self_attn.qkv_proj.weight",
        "ffn_up.weight": "mlp.gate_up_proj.weight",
    },
    gguf_absent_tensors=("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"),
)
