"""Errors of the model runner that callers act on."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or not a model kvserve can run; the message says
    what was looked for and how to get it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path (or the default model's package) does not exist."""
