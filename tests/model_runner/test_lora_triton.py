"""The CUDA path's LoRA kernels (``lora.triton_ops``: SGMV for prefill segments, BGMV for
decode rows) against the torch reference; on CPU in Triton's interpreter."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

triton = pytest.importorskip("triton")

from model_runner.lora import triton_ops  # noqa: E402
from tests.model_runner.test_sampler_sync import _SYNCING, _has_bool_index  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stacked(
    ranks: list[int], k: int, n: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, R, k] and Bt [S, R, n] of adapters of ``ranks``, zero past each one's rank."""
    g = torch.Generator().manual_seed(seed)
    r = triton_ops.padded_rank(max(ranks))
    a = torch.zeros(len(ranks), r, k)
    bt = torch.zeros(len(ranks), r, n)
    for s, rank in enumerate(ranks):
        a[s, :rank] = torch.randn(rank, k, generator=g) / k**0.5
        bt[s, :rank] = torch.randn(rank, n, generator=g)
    return a.to(DEVICE, dtype), bt.to(DEVICE, dtype)


def segment_table(segments: list[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    """``(start, length, slot)`` segments as the kernels take them: a [3, G] int32 table and
    the longest segment's length."""
    table = torch.tensor(segments, dtype=torch.int32).reshape(-1, 3).t().contiguous()
    return table.to(DEVICE), max((n for _, n, _ in segments), default=0)


def reference(x, a, bt, y, scale, row_slot, col0):  # type: ignore[no-untyped-def]
    """y[b, col0:col0+n] += scale[b] * (x[b] @ a[s]^T) @ bt[s] in float64 for rows of slot s."""
    out = y.double().clone()
    n = bt.shape[2]
    for b, s in enumerate(row_slot):
        if s < 0:
            continue
        t = x[b].double() @ a[s].double().t()
        out[b, col0 : col0 + n] += scale[b].double() * (t @ bt[s].double())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("ranks", [[4], [2, 8, 16], [32, 8]])
def test_sgmv_and_bgmv_match_the_reference(dtype: torch.dtype, ranks: list[int]) -> None:
    """Prefill segments (one longer than a tile, two of one adapter back to back) through
    SGMV and decode rows through BGMV, base rows untouched, per-row scales, an output column
    offset and K / N that are no multiple of the tiles: the reference's values (fp32 within
    1e-4, fp16 within 2e-2 of max)."""
    k, n, col0, width = 96, 80, 24, 128
    a, bt = stacked(ranks, k, n, dtype, seed=len(ranks))
    num_s = len(ranks)
    # rows: | seg slot 0 (19 rows) | base (3) | seg slot last (5) | seg slot last (4) | decodes |
    seg_rows = [(0, 19, 0), (22, 5, num_s - 1), (27, 4, num_s - 1)]
    decode = [(31, 0), (32, -1), (33, num_s - 1), (34, min(1, num_s - 1))]
    total = 35
    row_slot = [-1] * total
    for start, length, slot in seg_rows:
        row_slot[start : start + length] = [slot] * length
    for row, slot in decode:
        row_slot[row] = slot
    g = torch.Generator().manual_seed(7)
    x = torch.randn(total, k, generator=g).to(DEVICE, dtype)
    y = torch.randn(total, width, generator=g).to(DEVICE, dtype)
    scale = torch.tensor([0.5 if b % 3 == 0 else 1.0 for b in range(total)], device=DEVICE)
    want = reference(x, a, bt, y, scale, row_slot, col0)
    t = torch.zeros(total, a.shape[1], device=DEVICE)
    segments, longest = segment_table(seg_rows)
    rows = torch.tensor([r for r, s in decode if s >= 0], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([s for r, s in decode if s >= 0], dtype=torch.int32, device=DEVICE)
    triton_ops.sgmv_shrink(x, a, t, segments, longest)
    triton_ops.bgmv_shrink(x, a, t, rows, slots)
    got = y.clone()
    triton_ops.sgmv_expand(t, bt, got, scale, segments, longest, col0)
    triton_ops.bgmv_expand(t, bt, got, scale, rows, slots, col0)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = (got.double() - want).abs().max().item()
    assert err <= tol * want.abs().max().item(), err
    untouched = [b for b, s in enumerate(row_slot) if s < 0]
    assert torch.equal(got[untouched], y[untouched])
    assert torch.equal(got[:, :col0], y[:, :col0]) and torch.equal(
        got[:, col0 + n :], y[:, col0 + n :]
    )


def test_a_rows_result_does_not_depend_on_its_neighbours() -> None:
    """A segment's rows and a decode row give the same bits alone as beside other
    segments and rows of other adapters (fp32)."""
    k, n = 64, 48
    a, bt = stacked([8, 4], k, n, torch.float32, seed=3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, k, generator=g).to(DEVICE)
    y = torch.zeros(24, n, device=DEVICE)
    scale = torch.ones(24, device=DEVICE)

    def run(segs: list[tuple[int, int, int]], dec: list[tuple[int, int]]) -> torch.Tensor:
        t = torch.zeros(24, a.shape[1], device=DEVICE)
        out = y.clone()
        seg, longest = segment_table(segs)
        rows = torch.tensor([r for r, _ in dec], dtype=torch.int32, device=DEVICE)
        slots = torch.tensor([s for _, s in dec], dtype=torch.int32, device=DEVICE)
        triton_ops.sgmv_shrink(x, a, t, seg, longest)
        triton_ops.bgmv_shrink(x, a, t, rows, slots)
        triton_ops.sgmv_expand(t, bt, out, scale, seg, longest)
        triton_ops.bgmv_expand(t, bt, out, scale, rows, slots)
        return out

    together = run([(0, 18, 0), (18, 3, 1)], [(21, 1), (22, 0), (23, 0)])
    assert torch.equal(run([(0, 18, 0)], [])[:18], together[:18])
    assert torch.equal(run([(18, 3, 1)], [])[18:21], together[18:21])
    assert torch.equal(run([], [(22, 0)])[22], together[22])


def test_triton_lora_equals_the_torch_path_on_a_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The Triton backend (the CUDA path's) adds the same updates as the torch backend for a
    step of prefill chunks and decodes of three adapters and the base model, on every
    projection (``lora.targets``' spans)."""
    from model_runner.paths import lora_backend
    from model_runner.step import StepRows
    from tests.model_runner.lora_oracle import peft_adapter, with_lora
    from tests.model_runner.oracle import make_runner, random_ids, seq, tiny_hf

    hf = tiny_hf("llama-gqa")
    runner = make_runner(hf)
    for name, r in (("x", 2), ("y", 8), ("z", 4)):
        peft_adapter(hf, tmp_path / name, r=r, seed=r, targets=None if name != "z" else ["q_proj"])
        runner.lora.load(name, tmp_path / name)
    ref = {n: runner.lora.resolve(n) for n in "xyz"}
    ids = random_ids(40, seed=1)
    prefill = [with_lora(seq("p0", ids, 0, 17, list(range(1, 6))), ref["x"]),
               with_lora(seq("p1", ids, 0, 5, [6, 7]), None),
               with_lora(seq("p2", ids, 0, 9, [8, 9, 10]), ref["z"])]  # fmt: skip
    decode = [with_lora(seq(f"d{i}", ids, 20, 21, list(range(11, 17))), ref[n])
              for i, n in enumerate("yxy")]  # fmt: skip
    weights = {n: runner.lora.weights(ref[n]) for n in "xyz"}
    step = StepRows.from_seqs(prefill, decode, 4, weights=weights)  # type: ignore[arg-type]
    assert step.lora is not None and step.lora.names == ("x", "y", "z")
    config = runner.config
    cpu = torch.device("cpu")
    torch_updates = lora_backend(config, cpu, "torch").updates(step)
    triton_updates = lora_backend(config, cpu, "triton").updates(step)
    g = torch.Generator().manual_seed(2)
    for layer in range(config.num_layers):
        for projection, in_features, out_width in (
            ("qkv", 64, 128),  # q 64 columns, k and v 32 each (4 heads, 2 KV heads, D 16)
            ("o", 64, 64),
            ("gate_up", 64, 256),
            ("down", 128, 64),
        ):
            assert torch_updates.touches(layer, projection)
            x = torch.randn(step.num_rows, in_features, generator=g)
            y = torch.randn(step.num_rows, out_width, generator=g)
            want, got = y.clone(), y.clone()
            torch_updates.add_(layer, projection, x, want)
            triton_updates.add_(layer, projection, x, got)
            assert not torch.equal(want, y)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class LoraHostReads(TorchFunctionMode):
    """Counts the torch calls made from the LoRA code (a frame in ``model_runner/lora/``):
    ``reads`` those that read a device value back on the host (a synchronisation on a GPU:
    ``test_sampler_sync._SYNCING``, boolean-mask indexing), ``calls`` all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and _LORA_DIR not in frame.f_code.co_filename:
            frame = frame.f_back
        if frame is not None:
            self.calls += 1
            name = getattr(func, "__name__", "")
            if name in _SYNCING or (name == "__getitem__" and _has_bool_index(args[1:2])):
                where = frame.f_code.co_filename.split(_LORA_DIR)[-1]
                self.reads.append(f"{name} at lora/{where}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


_LORA_DIR = os.path.join("model_runner", "lora", "")


def _lora_steps(runner: Any, refs: dict[str, Any]) -> list[tuple[dict[str, int], list[str], int]]:
    """Three steps with adapters x, y and the base model: prefills (y's a middle chunk),
    then y's last chunk over its cached prefix beside two decodes, then three decodes. Per
    step: the tokens, the LoRA code's host reads and how many torch calls it made."""
    from tests.model_runner.lora_oracle import with_lora
    from tests.model_runner.oracle import plan, random_ids, seq

    ids = {"a": random_ids(7, seed=41), "b": random_ids(10, seed=42), "c": random_ids(5, seed=43)}
    tables = {"a": [1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}
    adapters = {"a": refs["x"], "b": refs["y"], "c": None}

    def at(rid: str, start: int, end: int, sample: bool = True) -> Any:
        return with_lora(seq(rid, ids[rid], start, end, tables[rid], sample), adapters[rid])

    def last(rid: str) -> Any:
        return at(rid, len(ids[rid]) - 1, len(ids[rid]))

    plans = [
        lambda: plan(0, prefill=[at("a", 0, 7), at("b", 0, 5, False), at("c", 0, 5)]),
        lambda: plan(1, prefill=[at("b", 5, 10)], decode=[last("a"), last("c")]),
        lambda: plan(2, decode=[last(r) for r in "abc"]),
    ]
    steps = []
    for make in plans:
        with LoraHostReads() as counter:
            result = runner.execute(make())
        assert not result.failed, result.failed
        for rid, token in result.sampled_token_ids.items():
            ids[rid].append(token)
        steps.append((result.sampled_token_ids, counter.reads, counter.calls))
    return steps


def test_a_lora_step_reads_nothing_back_from_the_device(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A runner's LoRA steps through the Triton kernels (as on CUDA; here in the interpreter)
    make no call that reads a device value back (0 per step: the launch grids come from the
    host plan), and give the torch path's greedy tokens, step after step."""
    from model_runner.paths import lora_backend
    from tests.model_runner.lora_oracle import peft_adapter
    from tests.model_runner.oracle import make_runner, tiny_hf

    hf = tiny_hf("llama-gqa", seed=5)
    got = {}
    for kernels in ("torch", "triton"):
        runner = make_runner(hf, num_blocks=16)
        for name, r in (("x", 4), ("y", 8)):
            peft_adapter(hf, tmp_path / name, r=r, seed=r)
            runner.lora.load(name, tmp_path / name)
        runner.paths.eager.lora = lora_backend(runner.config, runner.device, kernels)
        got[kernels] = _lora_steps(runner, {n: runner.lora.resolve(n) for n in "xy"})
    for kernels, steps in got.items():
        assert [reads for _, reads, _ in steps] == [[], [], []], kernels
        assert all(calls > 0 for _, _, calls in steps), kernels  # the LoRA code ran, watched
    tokens = [[t for t, _, _ in got[k]] for k in ("torch", "triton")]
    assert tokens[0] == tokens[1]
    assert [sorted(t) for t in tokens[0]] == [["a", "c"], ["a", "b", "c"], ["a", "b", "c"]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lora_step_makes_no_synchronisation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """On CUDA, preparing a LoRA step's tables (pinned, non-blocking copies) and running its
    kernels over every layer and target makes no synchronisation (torch's sync debug mode
    raises on one, an unpinned copy included)."""
    from model_runner.paths import lora_backend
    from model_runner.step import StepRows
    from tests.model_runner.lora_oracle import peft_adapter, with_lora
    from tests.model_runner.oracle import make_runner, random_ids, seq, tiny_hf

    hf = tiny_hf("llama-gqa")
    runner = make_runner(hf)
    peft_adapter(hf, tmp_path / "x", r=8, seed=8)
    runner.lora.load("x", tmp_path / "x")
    ref = runner.lora.resolve("x")
    ids = random_ids(30, seed=4)
    step = StepRows.from_seqs(
        [with_lora(seq("p", ids, 0, 19, [1, 2, 3, 4, 5]), ref)],
        [with_lora(seq("d", ids, 20, 21, [6, 7, 8, 9, 10, 11]), ref)],
        4,
        weights={"x": runner.lora.weights(ref)},  # type: ignore[dict-item]
    )
    device = torch.device("cuda")
    x = torch.randn(step.num_rows, 64, device=device)
    y = torch.zeros(step.num_rows, 128, device=device)
    backend = lora_backend(runner.config, device)
    assert backend.name == "triton"
    backend.updates(step).add_(0, "qkv", x, y)  # compiles the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        adapters = backend.updates(step)
        for layer in range(runner.config.num_layers):
            adapters.add_(layer, "qkv", x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(y.abs().sum() > 0)
