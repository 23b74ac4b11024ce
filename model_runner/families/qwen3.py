"""Qwen3 (dense): the Llama block with per-head RMSNorm on Q and K before RoPE, no QKV bias,
``head_dim`` set on its own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024).

llama.cpp's converter (``Qwen3Model``, a ``Qwen2Model``) writes the ``qwen3`` architecture,
metadata under ``qwen3.*`` (``qwen3.attention.key_length`` = head_dim), Q/K unpermuted, and
the norms as ``blk.{i}.attn_q_norm.weight`` / ``blk.{i}.attn_k_norm.weight``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_runner.families.base import Family


def _hf_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {} if cfg.get("use_sliding_window", False) else {"sliding_window": None}


QWEN3 = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_classes=("Qwen3Config", "Qwen3ForCausalLM"),
    gguf_archs=("qwen3",),
    qk_norm=True,
    hf_overrides=_hf_overrides,
    gguf_layer_tensors={
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
)
