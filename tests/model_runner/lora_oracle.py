"""Adapters for the LoRA tests: random PEFT adapters made by PEFT itself (the reference),
and GGUF LoRA files written as llama.cpp's convert_lora_to_gguf.py writes them."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model_runner.gguf_loader import permute_qk
from scheduler.output import ScheduledSeq
from scheduler.request import LoraRef

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_GGUF_NAMES = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
    "qkv_proj": "attn_qkv",  # Phi-3's fused projections (gguf-py's tensor map)
    "gate_up_proj": "ffn_up",
}


def peft_adapter(
    hf: torch.nn.Module,
    folder: Path,
    *,
    r: int = 4,
    alpha: float = 8,
    targets: list[str] | None = None,
    seed: int = 0,
    scale_b: float = 1.0,
    **config: Any,
) -> torch.nn.Module:
    """A random LoRA adapter of ``hf`` (B not zero), saved by PEFT into ``folder``; returns
    the PEFT model (a copy of ``hf`` with the adapter) in eval mode."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_MODULES,
        lora_dropout=0.0,
        init_lora_weights=False,  # B random too: an update that changes the answers
        **config,
    )
    model = get_peft_model(copy.deepcopy(hf), lora)
    if scale_b != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(scale_b)
    model.save_pretrained(str(folder))
    return model.eval()


def gguf_lora(
    folder: Path,
    out: Path,
    *,
    architecture: str = "llama",
    num_heads: int,
    num_kv_heads: int,
    tensor_type: str = "F32",
    alpha: float | None = None,
) -> Path:
    """The PEFT adapter in ``folder`` as a GGUF LoRA, written the way llama.cpp's
    convert_lora_to_gguf.py writes one: general.type adapter, adapter.type lora,
    adapter.lora.alpha, tensors blk.N.<name>.weight.lora_a / .lora_b, and the rows of Q's and
    K's lora_b permuted as the converter permutes its base (llama architecture)."""
    import json

    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    writer = gguf.GGUFWriter(str(out), architecture)
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32(
        "adapter.lora.alpha", float(config["lora_alpha"] if alpha is None else alpha)
    )
    dtype = {"F32": np.float32, "F16": np.float16}[tensor_type]
    for key, value in sorted(tensors.items()):
        parts = key.split(".")
        layer = int(parts[parts.index("layers") + 1])
        module = next(p for p in parts if p in _GGUF_NAMES)
        half = "lora_a" if ".lora_A." in key else "lora_b"
        array = value.float().numpy()
        if half == "lora_b" and architecture == "llama" and module in ("q_proj", "k_proj"):
            array = permute_qk(array, num_heads if module == "q_proj" else num_kv_heads)
        name = f"blk.{layer}.{_GGUF_NAMES[module]}.weight.{half}"
        writer.add_tensor(name, np.ascontiguousarray(array.astype(dtype)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def with_lora(seq: ScheduledSeq, ref: LoraRef | None) -> ScheduledSeq:
    return dataclasses.replace(seq, lora=ref)
