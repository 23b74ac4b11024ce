"""Random LoRA adapters in PEFT's format for a GGUF's model shape: what the ``lora`` section
serves (nothing can be downloaded here), and a quick adapter for the cluster tests.

    python -m benchmarks.tools.make_random_lora --model /tmp/llama-1b.gguf --out /tmp/a --rank 16

The files are PEFT's (``adapter_config.json`` + ``adapter_model.safetensors``, keys such as
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), for the Hugging Face
layout of the base, so llama.cpp's ``convert_lora_to_gguf.py`` converts them (with a
``config.json`` of the base: ``write_base_config``). A ~ N(0, 1/in), B ~ N(0, ``b_std``):
updates small enough that the base's answers stay words, large enough to change them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.tools.reference import hf_config_fields
from model_runner.config import ModelConfig
from model_runner.lora.targets import BY_NAME, TARGET_OF, target_shapes

ALL_MODULES = tuple(TARGET_OF)


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each projection, Hugging Face's names."""
    return {BY_NAME[t].hf_module: shape for t, shape in target_shapes(config).items()}


def write_peft(
    out: Path,
    config: ModelConfig,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    modules: tuple[str, ...] = ALL_MODULES,
    seed: int = 0,
    b_std: float = 0.01,
    base_model: str = "",
) -> Path:
    """A random PEFT adapter of ``config``'s model in folder ``out``."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        for module in modules:
            n_out, n_in = shapes[module]
            group = "self_attn" if module in ALL_MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) / n_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * b_std
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config_json = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(modules),
        "bias": "none",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config_json, indent=1))
    return out


def write_base_config(out: Path, config: ModelConfig) -> Path:
    """A Hugging Face ``config.json`` of ``config``'s model in folder ``out``: what llama.cpp's
    converter reads of the base (``--base``) to convert an adapter."""
    out.mkdir(parents=True, exist_ok=True)
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **hf_config_fields(config),
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(hf, indent=1))
    return out


def gguf_config(path: str | Path | None) -> ModelConfig:
    """The model config of a GGUF (None: the embedded model), no weights read."""
    from model_runner.gguf_loader import default_model_path, read_header

    return read_header(path if path is not None else default_model_path())[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.tools.make_random_lora", description=__doc__
    )
    p.add_argument("--model", default=None, help="the base GGUF (default: the embedded model)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modules", default=",".join(ALL_MODULES))
    args = p.parse_args(argv)
    config = gguf_config(args.model)
    modules = tuple(m for m in args.modules.split(",") if m)
    write_peft(args.out, config, rank=args.rank, alpha=args.alpha, modules=modules, seed=args.seed)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
