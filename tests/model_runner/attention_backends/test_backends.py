"""Choosing the attention backend once at start-up, and the runner on the Triton backend
against the runner on the torch reference."""

from __future__ import annotations

import pytest
import torch

from model_runner.attention_backends import (
    AttentionBackend,
    AttentionSpec,
    make_attention_backend,
    resolve_attention_backend,
)
from tests.model_runner.oracle import make_runner, plan, random_ids, seq, tiny_hf

CPU = torch.device("cpu")
# Where Triton runs here: the GPU, else a CPU in its interpreter (see conftest.py).
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _make(
    name: str,
    kv_dtype: torch.dtype = torch.float32,
    sinks: int = 0,
    device: torch.device = CPU,
) -> AttentionBackend:
    inv_freq = torch.ones(8) if sinks else None
    window = 16 if sinks else None
    spec = AttentionSpec(4, 2, 16, 4, torch.float32, kv_dtype, device, window, sinks, inv_freq)
    return make_attention_backend(name, spec)


def test_auto_is_torch_on_a_cpu() -> None:
    """``auto`` on a CPU is the torch reference (Triton there is a test interpreter)."""
    assert resolve_attention_backend("auto", CPU) == "torch"
    assert _make("auto").name == "torch"


def test_unknown_and_impossible_choices_raise() -> None:
    """An unknown name and FlashInfer on a CPU raise ValueError naming the problem."""
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        resolve_attention_backend("cuda", CPU)
    with pytest.raises(ValueError, match="flashinfer runs on CUDA"):
        resolve_attention_backend("flashinfer", CPU)


def test_paged_backends_refuse_int8_pools_and_sinks() -> None:
    """Triton explicitly asked for with an int8 pool or attention sinks raises; ``auto``
    would fall back to torch instead."""
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="float KV pools"):
        _make("triton", kv_dtype=torch.int8, device=TRITON_DEVICE)
    with pytest.raises(ValueError, match="no attention sinks"):
        _make("triton", sinks=4, device=TRITON_DEVICE)
    assert _make("auto", kv_dtype=torch.int8, device=TRITON_DEVICE).name == "torch"


def test_runner_on_triton_matches_the_torch_runner() -> None:
    """A GQA model through prefill chunks over a prefix, then batched decodes: every
    position's logits on the Triton backend equal the torch backend's (fp32, 1e-4), and the
    runner reports its backend."""
    pytest.importorskip("triton")
    hf = tiny_hf("llama-gqa")
    ids_a, ids_b = random_ids(11, 1), random_ids(6, 2)
    steps = [
        plan(0, prefill=[seq("a", ids_a, 0, 7, [3, 4, 5]), seq("b", ids_b, 0, 5, [8, 9])]),
        plan(
            1, prefill=[seq("a", ids_a, 7, 10, [3, 4, 5])], decode=[seq("b", ids_b, 5, 6, [8, 9])]
        ),
        plan(2, decode=[seq("a", ids_a, 10, 11, [3, 4, 5])]),
    ]
    logits = {}
    for backend in ("torch", "triton"):
        runner = make_runner(hf, attention_backend=backend)
        assert runner.info.extra["attention_backend"] == backend
        logits[backend] = [runner.step_logits(p) for p in steps]
    for ref, ours in zip(logits["torch"], logits["triton"], strict=True):
        assert ref.keys() == ours.keys()
        for rid in ref:
            assert (ours[rid] - ref[rid]).abs().max().item() <= 1e-4
