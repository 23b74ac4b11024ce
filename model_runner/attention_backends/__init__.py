"""Attention backends, chosen once at start-up (``--attention-backend``).

- ``torch``: ``torch_backend``, the reference (gathers blocks into padded tensors);
- ``triton``: ``triton_kernels``, paged prefill and decode reading K/V in place;
- ``flashinfer``: ``flashinfer-python``'s batch prefill / decode wrappers (CUDA);
- ``auto``: on CUDA, the fastest of the backends that can run there that measures right
  against torch on a probe step at the model's attention shape (``probe``); on a CPU, torch
  (Triton runs on a CPU only in its interpreter, for tests).

One table, ``config.ATTENTION_BACKENDS`` (name -> class), is what the CLI's choices,
``resolve_attention_backend`` and ``auto`` read; each class says where it runs
(``available(device)``) and what it serves (``unsupported(spec)``). A new backend is its
class and one row. Each is constructed once with the model's ``AttentionSpec`` (``base``);
the block table -> page table conversion both paged backends read lives in ``page_table``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from model_runner.attention_backends.base import AttentionBackend, AttentionSpec
from model_runner.attention_backends.torch_backend import TorchAttention
from model_runner.config import ATTENTION_BACKEND_CHOICES, ATTENTION_BACKENDS

__all__ = [
    "ATTENTION_BACKEND_CHOICES",
    "AttentionBackend",
    "AttentionSpec",
    "backend_class",
    "make_attention_backend",
    "resolve_attention_backend",
]

logger = logging.getLogger(__name__)


def backend_class(name: str) -> type[AttentionBackend[Any]]:
    """The class of backend ``name`` (a key of ``ATTENTION_BACKENDS``), its module imported
    when first named (the paged ones import their GPU package only when constructed)."""
    module, _, cls = ATTENTION_BACKENDS[name].partition(":")
    found: type[AttentionBackend[Any]] = getattr(importlib.import_module(module), cls)
    return found


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """The backend ``name`` means on ``device``: ``auto`` is torch off CUDA, and stays
    ``auto`` on CUDA (measured when built); raises for one that cannot run there."""
    if name not in ATTENTION_BACKEND_CHOICES:
        raise ValueError(
            f"unknown attention backend {name!r}: use one of {', '.join(ATTENTION_BACKEND_CHOICES)}"
        )
    if name == "auto":  # on CUDA, make_attention_backend measures the ones that can run
        return "auto" if device.type == "cuda" else "torch"
    reason = backend_class(name).unavailable(device)
    if reason is not None:
        raise ValueError(f"--attention-backend {name} {reason}")
    return name


def make_attention_backend(name: str, spec: AttentionSpec) -> AttentionBackend[Any]:
    """The backend ``name`` bound to ``spec``. An explicit choice that cannot serve it
    raises ``ValueError``: what it cannot serve first, then where it cannot run, so the
    message is the same on every machine. ``auto`` on CUDA measures the backends that can
    run there and serve ``spec`` (``probe``) and falls back to torch."""
    if name in ATTENTION_BACKENDS:
        reason = backend_class(name).unsupported(spec)
        if reason is not None:
            raise ValueError(reason)
    resolved = resolve_attention_backend(name, spec.device)
    if resolved != "auto":
        return backend_class(resolved)(spec)
    classes = [backend_class(n) for n in ATTENTION_BACKENDS]
    candidates = [
        cls(spec)
        for cls in classes
        if cls is not TorchAttention and cls.available(spec.device) and not cls.unsupported(spec)
    ]
    if not candidates:
        return TorchAttention(spec)
    from model_runner.attention_backends import probe

    measured = probe.measure_backends([*candidates, TorchAttention(spec)], TorchAttention(spec))
    chosen = probe.choose_backend(measured)
    logger.info("attention backend auto: %s of %s", chosen, measured)
    return next((b for b in candidates if b.name == chosen), TorchAttention(spec))
