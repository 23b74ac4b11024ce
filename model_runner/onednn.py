"""oneDNN's fused linear ops (``torch.ops.mkldnn``), shared by the fp32 and quantized paths.

``linear(x, w, bias, attr, scalars, algorithm)`` takes either a weight pre-packed by
``torch.ops.mkldnn._reorder_linear_weight`` or a plain ``[N, K]`` fp32 tensor; on a plain
one it is still about 2x faster than ``torch.matmul`` on this project's CPUs (measured: the
130 layer matrices of SmolLM2 at 128 rows, 82 ms against 188 ms).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def available() -> bool:
    ops = getattr(torch.ops, "mkldnn", None)
    return bool(
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and ops is not None
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def linear(x: torch.Tensor, w: torch.Tensor, *args: Any) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, w, *args)
    return out


def linear_binary(x: torch.Tensor, other: torch.Tensor, *args: Any) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, other, *args)
    return out


@functools.cache
def plain_weights_work() -> bool:
    """``linear`` on a plain (unpacked) fp32 weight matches ``F.linear`` on this machine."""
    if not available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 16, generator=g)
        x = torch.randn(5, 16, generator=g)
        return torch.allclose(linear(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-4)
    except RuntimeError:
        return False
