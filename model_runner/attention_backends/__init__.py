"""Attention backends, chosen once at start-up (``--attention-backend``).

- ``torch``: ``torch_backend``, the reference (gathers blocks into padded tensors);
- ``triton``: ``triton_kernels``, paged prefill and decode reading K/V in place;
- ``flashinfer``: ``flashinfer-python``'s batch prefill / decode wrappers (CUDA);
- ``auto``: on CUDA, FlashInfer if installed, else Triton if installed, else torch; on a CPU,
  torch (Triton runs on a CPU only in its interpreter, for tests).

Each is constructed once with the model's ``AttentionSpec`` (``base``); the block table ->
page table conversion both paged backends read lives in ``page_table``.
"""

from __future__ import annotations

import importlib.util
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


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, read by Triton)."""
    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` means on ``device`` (``auto`` resolved); raises for one that
    cannot run there."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(
            f"unknown attention backend {name!r}: use one of {', '.join(ATTENTION_BACKEND_CHOICES)}"
        )
    if name == "auto":
        if device.type != "cuda":
            return "torch"
        for candidate, module in (("flashinfer", "flashinfer"), ("triton", "triton")):
            if _installed(module):
                return candidate
        return "torch"
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
    raises ``ValueError``; ``auto`` falls back to torch instead."""
    cls = backend_class(resolve_attention_backend(name, spec.device))
    reason = cls.unsupported(spec)
    if reason is not None:
        if name != "auto":
            raise ValueError(reason)
        cls = TorchAttention
    return cls(spec)
