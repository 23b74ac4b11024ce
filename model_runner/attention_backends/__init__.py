"""Attention backends, chosen once at start-up (``--attention-backend``).

- ``torch``: ``torch_backend``, the reference (gathers blocks into padded tensors);
- ``triton``: ``triton_kernels``, paged prefill and decode reading K/V in place;
- ``flashinfer``: ``flashinfer-python``'s batch prefill / decode wrappers (CUDA);
- ``auto``: on CUDA, the fastest of the installed backends that measures right against torch
  on a probe step at the model's attention shape (``probe``); on a CPU, torch (Triton runs on
  a CPU only in its interpreter, for tests).

Each is constructed once with the model's ``AttentionSpec`` (``base``); the block table ->
page table conversion both paged backends read lives in ``page_table``.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from model_runner.attention_backends.base import AttentionBackend, AttentionSpec
from model_runner.attention_backends.torch_backend import TorchAttention
from model_runner.config import ATTENTION_BACKEND_CHOICES

__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionSpec",
    "make_attention_backend",
]

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


def backend_class(name: str) -> type[AttentionBackend[Any]]:
    """The class of a resolved backend name (the paged ones imported only when named)."""
    if name == "triton":
        from model_runner.attention_backends.triton_backend import TritonAttention

        return TritonAttention
    if name == "flashinfer":
        from model_runner.attention_backends.flashinfer_backend import FlashInferAttention

        return FlashInferAttention
    return TorchAttention


def make_attention_backend(name: str, spec: AttentionSpec) -> AttentionBackend[Any]:
    """The backend ``name`` bound to ``spec``. An explicit choice that cannot serve it
    raises ``ValueError``: what it cannot serve first, then where it cannot run, so the
    message is the same on every machine. ``auto`` on CUDA measures the installed backends
    that can serve ``spec`` (``probe``) and falls back to torch."""
    if name in ATTENTION_BACKEND_CHOICES and name != "auto":
        reason = backend_class(name).unsupported(spec)
        if reason is not None:
            raise ValueError(reason)
    resolved = resolve_attention_backend(name, spec.device)
    if resolved != "auto":
        return backend_class(resolved)(spec)
    candidates = [
        backend_class(n)(spec)
        for n in ("flashinfer", "triton")
        if _installed(n) and backend_class(n).unsupported(spec) is None
    ]
    if not candidates:
        return TorchAttention(spec)
    from model_runner.attention_backends import probe

    measured = probe.measure_backends([*candidates, TorchAttention(spec)], TorchAttention(spec))
    chosen = probe.choose_backend(measured)
    logger.info("attention backend auto: %s of %s", chosen, measured)
    return next((b for b in candidates if b.name == chosen), TorchAttention(spec))
