"""Typed errors the scheduler raises at admission."""

from __future__ import annotations


class OverloadError(RuntimeError):
    """The waiting queue is over its bound; retry later (gRPC RESOURCE_EXHAUSTED)."""
