"""Qwen2 / Qwen2.5: the Llama block with a QKV bias, rotated NeoX-style (GGUF unpermuted);
the sliding window is off unless config.json sets ``use_sliding_window``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_runner.families.base import Family


def _hf_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {} if cfg.get("use_sliding_window", False) else {"sliding_window": None}


QWEN2 = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_classes=("Qwen2Config", "Qwen2ForCausalLM"),
    gguf_archs=("qwen2",),
    hf_attention_bias=True,
    hf_overrides=_hf_overrides,
)
