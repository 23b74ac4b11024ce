"""Device, dtype and CPU-thread selection, decided once at start-up.

The rest of ``model_runner`` takes a ``torch.device`` and a ``torch.dtype`` and never asks
again: the same code runs on CPU and CUDA, and only this module knows the defaults
(fp32 on CPU, where half precision is slow and inexact; bf16 on CUDA when the GPU supports
it, else fp16).
"""

from __future__ import annotations

import torch

from model_runner.config import DTYPES, KV_DTYPE_CHOICES, MODEL_DTYPES


def _by_name_and_alias(names: tuple[str, ...]) -> dict[str, torch.dtype]:
    return {alias: getattr(torch, n) for n in names for alias in (n, *DTYPES[n].aliases)}


# Derived from the one table, model_runner.config.DTYPES: torch's dtype by name and alias, and
# the canonical name of each. A KV cache may also be int8 (quantized, with scales).
_DTYPES = _by_name_and_alias(MODEL_DTYPES)
_KV_DTYPES = _by_name_and_alias(tuple(DTYPES))
_NAMES = {_DTYPES[name]: name for name in MODEL_DTYPES}
_KV_NAMES = {_KV_DTYPES[name]: name for name in DTYPES}


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
    try:
        return _KV_DTYPES[kv_dtype.lower()]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPE_CHOICES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name (a key of ``model_runner.config.DTYPES``); int8 is a KV cache
    precision only."""
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
