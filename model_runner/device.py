"""Device, dtype and CPU-thread selection, decided once at start-up.

The rest of ``model_runner`` takes a ``torch.device`` and a ``torch.dtype`` and never asks
again: the same code runs on CPU and CUDA, and only this module knows the defaults
(fp32 on CPU, where half precision is slow and inexact; bf16 on CUDA when the GPU supports
it, else fp16).
"""

from __future__ import annotations

import torch

from model_runner.config import DTYPE_BYTES

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}

# The canonical names are the keys of model_runner.config.DTYPE_BYTES (torch-free).
_NAMES: dict[torch.dtype, str] = {_DTYPES[name]: name for name in DTYPE_BYTES if name in _DTYPES}
# KV cache precisions: the model's dtypes plus int8 (quantized, with per-token scales).
_KV_NAMES: dict[torch.dtype, str] = {**_NAMES, torch.int8: "int8"}
KV_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "int8")


def select_device(requested: str | torch.device | None = None) -> torch.device:
    """``None`` or ``"auto"``: CUDA when present, else CPU. Otherwise the named device,
    which must exist (``ValueError`` saying what is available if it does not)."""
    if isinstance(requested, torch.device):
        requested = str(requested)
    if requested is None or requested == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(requested)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but CUDA is not available; use 'cpu'")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {requested!r} is not supported: use 'cpu', 'cuda' or 'auto'")
    return device


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU; bf16 on CUDA when supported, else fp16."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A dtype from a name (``"float32"``, ``"bf16"``, ...), a ``torch.dtype`` or ``None``
    (the device's default)."""
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        if dtype not in _NAMES:
            raise ValueError(f"dtype {dtype} is not supported: use float32, float16 or bfloat16")
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}: use one of {sorted(set(_NAMES.values()))}"
        ) from None


def resolve_kv_dtype(
    kv_dtype: str | torch.dtype | None, dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The KV cache's storage dtype. ``None`` / ``"auto"``: float16 on CPU when the model
    runs float32 (half the bytes to stream per decode step, for ~1e-3 relative error in
    attention), else the model's ``dtype``. Otherwise a name from ``KV_DTYPE_CHOICES`` or a
    ``torch.dtype``."""
    if kv_dtype is None or kv_dtype == "auto":
        return torch.float16 if device.type == "cpu" and dtype == torch.float32 else dtype
    if isinstance(kv_dtype, torch.dtype):
        if kv_dtype not in _KV_NAMES:
            raise ValueError(f"KV dtype {kv_dtype} is not supported: use {KV_DTYPE_CHOICES}")
        return kv_dtype
    if kv_dtype.lower() == "int8":
        return torch.int8
    try:
        return _DTYPES[kv_dtype.lower()]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPE_CHOICES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name (a key of ``model_runner.config.DTYPE_BYTES``); int8 is a KV
    cache precision only."""
    try:
        return _KV_NAMES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} is not supported") from None


def configure_threads(num_threads: int | None = None) -> int:
    """Set torch's intra-op CPU threads (``None`` keeps torch's choice); returns the count.

    One engine thread drives the model, so inter-op parallelism brings nothing; intra-op
    threads beyond the physical cores only add contention.
    """
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    return torch.get_num_threads()
