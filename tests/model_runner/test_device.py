"""Device, dtype and thread selection."""

from __future__ import annotations

import pytest
import torch

from model_runner.device import (
    configure_threads,
    default_dtype,
    dtype_name,
    resolve_dtype,
    select_device,
)


def test_auto_device_prefers_cuda() -> None:
    """None / "auto" pick CUDA when present, else CPU; "cpu" is always CPU."""
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert select_device(None).type == expected
    assert select_device("auto").type == expected
    assert select_device("cpu") == torch.device("cpu")


def test_unavailable_or_unknown_device_raises() -> None:
    """Asking for CUDA without CUDA, or for an unsupported device type, raises ValueError."""
    if torch.cuda.is_available():
        assert select_device("cuda").type == "cuda"
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            select_device("cuda")
    with pytest.raises(ValueError, match="not supported"):
        select_device("meta")


def test_dtype_defaults_and_names() -> None:
    """fp32 on CPU; names and aliases resolve; unknown names list the choices."""
    cpu = torch.device("cpu")
    assert default_dtype(cpu) == torch.float32
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype(torch.float32, cpu) == torch.float32
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="bfloat16"):
        resolve_dtype("int8", cpu)
    with pytest.raises(ValueError, match="not supported"):
        resolve_dtype(torch.int8, cpu)


def test_configure_threads() -> None:
    """configure_threads(n) sets torch's intra-op threads; None only reports them."""
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 == torch.get_num_threads()
        assert configure_threads(None) == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="got 0"):
        configure_threads(0)
