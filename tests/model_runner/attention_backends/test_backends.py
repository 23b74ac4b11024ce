"""Choosing the attention backend once at start-up, and the runner on the Triton backend
against the runner on the torch reference."""

from __future__ import annotations

import pytest
import torch

from model_runner.attention_backends import (
    AttentionBackend,
    AttentionSpec,
    backend_class,
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


def test_one_table_names_every_backend() -> None:
    """Each row of ``ATTENTION_BACKENDS`` is a class of that name; the server's
    ``--attention-backend`` choices are ``auto`` and the table's names; on a CPU the torch
    reference is available and FlashInfer is not."""
    from dataclasses import fields

    from model_runner.config import ATTENTION_BACKENDS
    from server.config import ServerConfig

    assert [backend_class(n).name for n in ATTENTION_BACKENDS] == list(ATTENTION_BACKENDS)
    (flag,) = [f for f in fields(ServerConfig) if f.name == "attention_backend"]
    assert tuple(flag.metadata["choices"]) == ("auto", *ATTENTION_BACKENDS)
    assert backend_class("torch").available(CPU)
    assert not backend_class("flashinfer").available(CPU)


def test_unknown_and_impossible_choices_raise() -> None:
    """An unknown name and FlashInfer on a CPU raise ValueError naming the problem."""
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        resolve_attention_backend("cuda", CPU)
    with pytest.raises(ValueError, match="flashinfer runs on CUDA"):
        resolve_attention_backend("flashinfer", CPU)


def test_paged_backends_refuse_int8_pools_and_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton or FlashInfer explicitly asked for with an int8 pool or attention sinks raises
    that refusal first, whether Triton's interpreter is on or off (off: as on a CUDA machine
    building for a CPU device), before the device's; ``auto`` falls back to torch instead."""
    pytest.importorskip("triton")
    from model_runner.attention_backends import triton_backend

    for interpreted in (True, False):
        monkeypatch.setattr(triton_backend, "triton_interpreted", lambda on=interpreted: on)
        for name in ("triton", "flashinfer"):
            with pytest.raises(ValueError, match=f"the {name} backend reads float KV pools"):
                _make(name, kv_dtype=torch.int8)
            with pytest.raises(ValueError, match=f"the {name} backend has no attention sinks"):
                _make(name, sinks=4)
        assert _make("auto", kv_dtype=torch.int8).name == "torch"
    with pytest.raises(ValueError, match="runs on CUDA, or on cpu in Triton's interpreter only"):
        _make("triton")  # a float pool: the device is the one problem left


def test_per_layer_windows() -> None:
    """Gemma 3's layers (a sliding one of 8 tokens, a global one): each layer's window, a
    model-wide one bounding both; FlashInfer (one window a plan) refuses them in one line,
    and the probe runs one layer of each window."""
    from model_runner.attention_backends.probe import probe_layers

    spec = AttentionSpec(4, 2, 16, 4, torch.float32, torch.float32, CPU,
                         layer_windows=(8, 8, None, 8))  # fmt: skip
    assert [spec.window(i) for i in range(4)] == [8, 8, None, 8] and spec.layered
    assert probe_layers(spec) == [0, 2]
    bounded = AttentionSpec(4, 2, 16, 4, torch.float32, torch.float32, CPU, 6,
                            layer_windows=(8, None))  # fmt: skip
    assert [bounded.window(i) for i in range(2)] == [6, 6] and not bounded.layered
    with pytest.raises(ValueError, match="flashinfer backend plans one window per step"):
        make_attention_backend("flashinfer", spec)
    with pytest.raises(ValueError, match="attention sinks on a model with per-layer windows"):
        AttentionSpec(4, 2, 16, 4, torch.float32, torch.float32, CPU, 16, 4, torch.ones(8),
                      layer_windows=(8, None))  # fmt: skip


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "phi4-mini", "gemma3"])
def test_runner_on_triton_matches_the_torch_runner(kind: str) -> None:
    """A GQA model (Qwen3: QK-norm, head_dim 32 over hidden 64; Gemma 3: a sliding layer of
    8 tokens and a global one) through prefill chunks over a prefix, then batched decodes:
    every position's logits on the Triton backend equal the torch backend's (fp32, 1e-4),
    and the runner reports its backend."""
    pytest.importorskip("triton")
    hf = tiny_hf(kind)
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


def test_auto_takes_the_fastest_backend_that_measures_right() -> None:
    """Of the backends that match torch within tolerance, the fastest (ties: the first); a
    faster one that measured wrong or raised never; torch when none is right."""
    from model_runner.attention_backends.probe import Measurement, choose_backend

    right, wrong = Measurement(1e-5, 1e-3, 0.002), Measurement(0.5, 1e-3, 0.0001)
    assert choose_backend({"triton": right, "torch": Measurement(0.0, 1e-3, 0.004)}) == "triton"
    assert choose_backend({"flashinfer": wrong, "triton": right}) == "triton"
    failed = Measurement(float("inf"), 1e-3, None, "RuntimeError('no nvcc')")
    assert choose_backend({"flashinfer": failed, "triton": wrong}) == "torch"
    assert choose_backend({"a": right, "b": Measurement(0.0, 1e-3, 0.002)}) == "a"


def test_probe_measures_each_candidate_against_torch() -> None:
    """The probe step (chunks over prefixes and decodes) through the Triton backend (on CUDA,
    else in the interpreter) and torch: both right, timed; a backend that writes zeros is
    wrong; one that raises is recorded with its error and no time."""
    pytest.importorskip("triton")
    from model_runner.attention_backends.probe import ProbeShape, measure_backends
    from model_runner.attention_backends.torch_backend import TorchAttention
    from model_runner.attention_backends.triton_backend import TritonAttention

    class Zeros(TorchAttention):
        name = "zeros"

        def attend(self, layer, qkv, meta, pool, out) -> None:  # type: ignore[no-untyped-def]
            out.zero_()

    class Broken(TorchAttention):
        name = "broken"

        def attend(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            raise RuntimeError("cannot run here")

    spec = AttentionSpec(4, 2, 16, 16, torch.float32, torch.float32, TRITON_DEVICE)
    shape = ProbeShape(num_decodes=3, decode_keys=40, num_chunks=1, chunk_len=20,
                       prefix_len=12, repeats=1)  # fmt: skip
    candidates = [TritonAttention(spec), TorchAttention(spec), Zeros(spec), Broken(spec)]
    measured = measure_backends(candidates, TorchAttention(spec), shape)
    assert measured["triton"].right and measured["triton"].max_abs_err < 1e-4
    assert measured["torch"].right and measured["torch"].max_abs_err <= 1e-6
    assert not measured["zeros"].right and measured["zeros"].seconds is not None
    assert measured["broken"].seconds is None and "cannot run here" in measured["broken"].error
