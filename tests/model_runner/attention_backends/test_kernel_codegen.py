"""The Triton kernels compiled for an H100 without one: both products on tensor cores, K/V
copied 16 bytes at a time, nothing spilled (``sm90_codegen``, in a process of its own)."""

from __future__ import annotations

import pytest

from tests.model_runner.sm90 import compiled_counts

pytest.importorskip("triton")


def test_kernels_compile_to_tensor_core_products_and_16_byte_copies_for_sm90() -> None:
    """Decode (group 4 padded to 16 rows; split 8 ways with a window and sinks) and
    prefill (64-row tiles) for bf16, head_dim 128, pages of 16: ``mma`` / ``wgmma`` products,
    ``cp.async`` 16-byte K/V copies, no scalar 2-byte loads of K/V, no local memory."""
    counts = compiled_counts("tests.model_runner.attention_backends.sm90_codegen")
    for name in ("decode", "decode_split_sinks"):
        assert counts[name]["mma.sync"] > 0, counts
    assert counts["prefill"]["wgmma.mma_async"] > 0, counts
    for name, c in counts.items():
        assert c["cp.async.cg"] > 0 and c[".local"] == 0, (name, c)
    # The sink rotation loads Q once more with its pairs swapped (2-byte loads, once per
    # program); K and V never load 2 bytes at a time.
    assert counts["decode"]["ld.global.b16"] == counts["prefill"]["ld.global.b16"] == 0, counts
