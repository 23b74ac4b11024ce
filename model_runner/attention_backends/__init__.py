"""Attention backends, chosen once at start-up (``--attention-backend``).

- ``torch``: ``model_runner.attention``, the reference (gathers blocks into padded tensors);
- ``triton``: ``triton_kernels``, paged prefill and decode reading K/V in place;
- ``flashinfer``: ``flashinfer-python``'s batch prefill / decode wrappers (CUDA);
- ``auto``: on CUDA, the fastest of the installed backends that measures right against torch
  on a probe step at the model's attention shape (``probe``); on a CPU, torch (Triton runs on
  a CPU only in its interpreter, for tests).

The block table -> page table conversion both paged backends read lives in ``page_table``.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, cast

import torch

from model_runner.attention_backends.base import AttentionBackend, TorchAttention
from model_runner.config import ATTENTION_BACKEND_CHOICES

__all__ = ["ATTENTION_BACKEND_CHOICES", "AttentionBackend", "make_attention_backend"]

logger = logging.getLogger(__name__)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, read by Triton)."""
    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` means on ``device``: ``auto`` is torch off CUDA, and stays
    ``auto`` on CUDA (measured when built); raises for one that cannot run there."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(
            f"unknown attention backend {name!r}: use one of {', '.join(ATTENTION_BACKEND_CHOICES)}"
        )
    if name == "auto":  # on CUDA, make_attention_backend measures the installed ones
        return "auto" if device.type == "cuda" else "torch"
    if name == "flashinfer":
        if device.type != "cuda":
            raise ValueError(f"--attention-backend flashinfer runs on CUDA, not {device}")
        if not _installed("flashinfer"):
            raise ValueError("--attention-backend flashinfer needs flashinfer-python installed")
    if name == "triton":
        if not _installed("triton"):
            raise ValueError("--attention-backend triton needs triton installed")
        if device.type != "cuda" and not triton_interpreted():
            raise ValueError(
                f"--attention-backend triton runs on CUDA, or on {device} in Triton's "
                "interpreter only (TRITON_INTERPRET=1, for tests)"
            )
    return name


def make_attention_backend(
    name: str,
    device: torch.device,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    sliding_window: int | None = None,
    attention_sinks: int = 0,
) -> AttentionBackend:
    """The backend for a runner so configured. An explicit choice that cannot serve it
    raises ``ValueError`` (what it cannot serve first, then where it cannot run: the same
    message on every machine); ``auto`` falls back to torch instead."""
    if name in ATTENTION_BACKEND_CHOICES and name != "auto":
        reason = _backend_class(name).unsupported(kv_dtype, attention_sinks)
        if reason is not None:
            raise ValueError(reason)
    shape = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    resolved = resolve_attention_backend(name, device)
    if resolved == "auto":
        candidates = [
            _build(n, device, dtype, kv_dtype, sliding_window, **shape)
            for n in ("flashinfer", "triton")
            if _installed(n) and _backend_class(n).unsupported(kv_dtype, attention_sinks) is None
        ]
        if not candidates:
            return TorchAttention()
        from model_runner.attention_backends import probe

        model = probe.AttentionShape(
            num_heads, num_kv_heads, head_dim, dtype, kv_dtype, sliding_window
        )
        measured = probe.measure_backends(
            [*candidates, TorchAttention()], TorchAttention(), device, model
        )
        chosen = probe.choose_backend(measured)
        logger.info("attention backend auto: %s of %s", chosen, measured)
        return next((b for b in candidates if b.name == chosen), TorchAttention())
    return _build(resolved, device, dtype, kv_dtype, sliding_window, **shape)


def _build(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    sliding_window: int | None,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> AttentionBackend:
    cls: Any = _backend_class(name)
    if name == "triton":
        return cast(AttentionBackend, cls(sliding_window))
    if name == "flashinfer":
        return cast(
            AttentionBackend, cls(device, num_heads, num_kv_heads, head_dim, dtype, kv_dtype)
        )
    return TorchAttention()


def _backend_class(name: str) -> type[AttentionBackend]:
    """The class of backend ``name`` (importable without triton or flashinfer installed)."""
    if name == "triton":
        from model_runner.attention_backends.triton_backend import TritonAttention

        return TritonAttention
    if name == "flashinfer":
        from model_runner.attention_backends.flashinfer_backend import FlashInferAttention

        return FlashInferAttention
    return TorchAttention
