"""The CUDA path's LoRA kernels (``lora.triton_ops``: SGMV for prefill segments, BGMV for
decode rows) against the torch reference; on CPU in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from model_runner.lora import triton_ops  # noqa: E402

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
    segments = torch.tensor(seg_rows, dtype=torch.int32, device=DEVICE)
    rows = torch.tensor([r for r, s in decode if s >= 0], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([s for r, s in decode if s >= 0], dtype=torch.int32, device=DEVICE)
    triton_ops.sgmv_shrink(x, a, t, segments)
    triton_ops.bgmv_shrink(x, a, t, rows, slots)
    got = y.clone()
    triton_ops.sgmv_expand(t, bt, got, scale, segments, col0)
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
        seg = torch.tensor(segs, dtype=torch.int32, device=DEVICE).reshape(-1, 3)
        rows = torch.tensor([r for r, _ in dec], dtype=torch.int32, device=DEVICE)
        slots = torch.tensor([s for _, s in dec], dtype=torch.int32, device=DEVICE)
        triton_ops.sgmv_shrink(x, a, t, seg)
        triton_ops.bgmv_shrink(x, a, t, rows, slots)
        triton_ops.sgmv_expand(t, bt, out, scale, seg)
        triton_ops.bgmv_expand(t, bt, out, scale, rows, slots)
        return out

    together = run([(0, 18, 0), (18, 3, 1)], [(21, 1), (22, 0), (23, 0)])
    assert torch.equal(run([(0, 18, 0)], [])[:18], together[:18])
    assert torch.equal(run([(18, 3, 1)], [])[18:21], together[18:21])
    assert torch.equal(run([], [(22, 0)])[22], together[22])


def test_triton_lora_equals_the_torch_path_on_a_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TritonLora (the CUDA path's step object) adds the same updates as TorchLora for a step
    of prefill chunks and decodes of three adapters and the base model, on every target."""
    from model_runner.lora.cuda import TritonLora
    from model_runner.lora.step import LoraStep, TorchLora
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
    step = StepRows.from_seqs(prefill, decode, 4)
    weights = {n: runner.lora.weights(ref[n]) for n in "xyz"}
    lora = LoraStep.of(step, weights)  # type: ignore[arg-type]
    assert lora is not None
    config = runner.config
    cpu = torch.device("cpu")
    g = torch.Generator().manual_seed(2)
    for layer in range(config.num_layers):
        for spans, in_features, out_width in (
            ((("q", 0), ("k", 64), ("v", 96)), 64, 128),
            ((("o", 0),), 64, 64),
            ((("gate", 0), ("up", 128)), 64, 256),
            ((("down", 0),), 128, 64),
        ):
            x = torch.randn(step.num_rows, in_features, generator=g)
            y = torch.randn(step.num_rows, out_width, generator=g)
            want, got = y.clone(), y.clone()
            TorchLora(lora, config, cpu).add_(layer, spans, x, want)
            TritonLora(lora, step, config, cpu).add_(layer, spans, x, got)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
