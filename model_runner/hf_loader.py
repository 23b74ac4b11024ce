"""Load a local Hugging Face model directory: ``config.json`` + ``*.safetensors``.

Nothing is downloaded: the directory must already exist. Sharded checkpoints are read through
``model.safetensors.index.json`` when present, else every ``*.safetensors`` file is read.
Parameter names come back as Hugging Face's (``model.layers.{i}.self_attn.q_proj.weight``,
...), the interface every kvserve loader shares; ``lm_head.weight`` is absent when tied. A
family that spells its tensors its own way has them renamed (``Family.hf_tensor_renames``:
Mixtral's ``block_sparse_moe`` experts onto ``mlp.experts.{e}.gate_proj`` ..., an image-text
checkpoint's ``language_model`` weights onto the text model's, its vision tower skipped).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from model_runner.config import ModelConfig
from model_runner.errors import CheckpointError
from model_runner.families import family, text_config

_HOW_TO_GET = (
    "a Hugging Face model directory holds config.json, *.safetensors and tokenizer.json; "
    "get one on a machine with network access, e.g. "
    "`huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR`, "
    "then copy DIR here (kvserve never downloads at run time)"
)


def load_hf_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face model directory."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"model directory {str(root)!r} does not exist; {_HOW_TO_GET}")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"no config.json in {str(root)!r}; {_HOW_TO_GET}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {config_path}: {exc}") from exc
    try:
        return ModelConfig.from_hf_config(normalize_hf_config(raw), name=root.name)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{config_path} lacks a field kvserve needs: {exc}") from exc
    except ValueError as exc:  # a family or feature kvserve does not run: one line
        raise CheckpointError(f"{config_path}: {exc}") from exc


def normalize_hf_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Map newer ``config.json`` spellings onto the classic ones ``ModelConfig`` reads.

    transformers >= 5 writes ``rope_parameters`` (theta, scaling and the partial rotary
    factor in one dict) instead of ``rope_theta`` / ``rope_scaling`` /
    ``partial_rotary_factor``; a model whose layer types rotate differently (Gemma 3) has
    one such dict per type, and the full-attention layers' is the classic fields' (the
    family reads the others' itself). An image-text checkpoint of a family's text model
    (``families.text_config``) is read as that text model's config.
    """
    text = text_config(cfg)
    if text is not None:  # an image-text checkpoint: its text model
        cfg = text
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if not isinstance(params, dict):
        return cfg
    out = dict(cfg)
    if "rope_theta" in params and "rope_theta" not in cfg:
        out["rope_theta"] = params["rope_theta"]
    if "partial_rotary_factor" in params and "partial_rotary_factor" not in cfg:
        out["partial_rotary_factor"] = params["partial_rotary_factor"]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default" and not cfg.get("rope_scaling"):
        out["rope_scaling"] = {
            k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")
        }
    return out


def load_hf_dir(
    path: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """``(ModelConfig, state_dict)`` of a local Hugging Face directory, tensors in ``dtype``
    on CPU. Raises ``CheckpointError`` naming what was missing or broken."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    config = load_hf_config(root)
    fam = family(config.architecture)
    renames = [(re.compile(a), b) for a, b in fam.hf_tensor_renames]
    skipped = [re.compile(p) for p in fam.hf_skipped_tensors]
    files = _weight_files(root)
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"cannot read weights file {file}: {exc}") from exc
        for name, tensor in tensors.items():
            key = _canonical_name(name)
            if key is None or any(p.match(key) for p in skipped):
                continue
            for pattern, replacement in renames:
                key = pattern.sub(replacement, key)
            state[key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    if "lm_head.weight" in state and config.tie_word_embeddings:
        del state["lm_head.weight"]
    if "model.embed_tokens.weight" not in state:
        raise CheckpointError(
            f"no model.embed_tokens.weight in {', '.join(f.name for f in files)}: not a "
            f"LLaMA-family checkpoint; {_HOW_TO_GET}"
        )
    return config, state


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"cannot read {index}: {exc}") from exc
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists missing shards {missing}; {_HOW_TO_GET}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in root.iterdir())
        hint = ""
        if any(name.endswith(".bin") for name in found):
            hint = " (only PyTorch .bin weights found: convert them to safetensors)"
        raise CheckpointError(
            f"no *.safetensors weights in {str(root)!r}{hint}; found {found}; {_HOW_TO_GET}"
        )
    return files


def _canonical_name(name: str) -> str | None:
    """Hugging Face parameter names for a causal LM; ``None`` for buffers we rebuild."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name.startswith(("model.", "lm_head.")):
        return name
    # A bare LlamaModel checkpoint has no "model." prefix.
    return "model." + name
