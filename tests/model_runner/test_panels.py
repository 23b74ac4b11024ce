"""Rows held in panels (model_runner/interleave.py, ``panel_cols``; kernels/qmatmul.h,
``group_records``): a weight's records panel after panel, each panel's row groups in turn.
The layout byte for byte, and the kernels over it giving the numbers of the same records
held as whole rows, bit for bit: every format, both activation precisions, every ISA family
this CPU has, 1 and 2 threads, M = 1..64 (the panel-by-panel order below 32 rows, K chunks
ending at panel ends above), every epilogue, stacks, and a model against transformers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_runner import interleave, kernels, quant
from tests.model_runner.test_quant import (
    KERNEL_TOL,
    ROWS,
    assert_close,
    hf_logits_quantized_acts,
    isa,
    make_weight,
    quantized_pair,
    reference,
    threads,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")
__all__ = ["isa", "threads"]  # fixtures

FORMATS = [*quant.FORMATS, "int8"]


def whole_rows(w: quant.QuantWeight) -> quant.QuantWeight:
    """The same records as whole rows, group after group (the layout before panels)."""
    twin = quant.QuantWeight(w.fmt, w.grouped().clone(), w.out_features, w.in_features, w.source)
    assert twin.panel == 0
    return twin


def test_panel_widths() -> None:
    """Rows of up to 1024 stay whole; up to 2048 take panels of 1024; longer ones 2048."""
    assert [interleave.panel_cols(k) for k in (256, 1024, 1280, 2048, 2304, 8192)] == [
        0, 0, 1024, 1024, 2048, 2048,
    ]  # fmt: skip
    assert (
        interleave.panel_blocks("Q4_K", 8192) == 8 and interleave.panel_blocks("Q8_0", 2048) == 32
    )


@pytest.mark.parametrize("fmt, n, k", [("Q4_K", 20, 2560), ("Q6_K", 8, 2048), ("Q8_0", 13, 1100)])
def test_records_lie_panel_after_panel(fmt: str, n: int, k: int) -> None:
    """Record b of row group g sits at (c * per * groups + g * len_c + b % per) records
    (c = b // per its panel, len_c that panel's records a row: the last one shorter), the
    address kernels/qmatmul.h computes; and the file's bytes come back exactly."""
    spec = quant.FORMATS[fmt]
    nb = -(-k // spec.block)
    raw = np.random.default_rng(k).integers(0, 256, (n, nb * spec.block_bytes), dtype=np.uint8)
    w = quant.QuantWeight.from_blocks(raw, fmt, (n, nb * spec.block))
    whole = interleave.to_records(raw, fmt, n, nb * spec.block)
    per, groups, size = w.panel, -(-n // 8), interleave.record_bytes(fmt)
    assert per == interleave.panel_cols(k) // spec.block and w.records.dim() == 1
    flat = w.records.numpy()
    for g in range(groups):
        for b in range(nb):
            c = b // per
            at = c * per * groups + g * min(per, nb - c * per) + b % per
            assert np.array_equal(flat[at * size : (at + 1) * size], whole[g, b]), (g, b)
    assert np.array_equal(w.grouped().numpy(), whole)
    assert np.array_equal(w.blocks(), raw)
    assert w.nbytes == whole.nbytes


@pytest.mark.parametrize("bits", quant.ACTIVATION_BITS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_panels_give_the_numbers_of_whole_rows(fmt: str, bits: int, isa: str, threads: int) -> None:
    """Bit for bit the whole-rows numbers, for every row count: K = 1280 (1024 + 256); the
    K-quants also 2560 (a 2048 panel and a 512 one: K chunks of 512 end at the panel's end),
    int8 also 1100 (a last panel of 3 blocks, the last one partial)."""
    ks = [2560, 1280] if fmt in ("Q4_K", "Q5_K", "Q6_K") else [1280, 1100]
    for k in ks:
        if fmt != "int8" and k % quant.FORMATS[fmt].block:
            continue
        w = make_weight(fmt, 24, k, seed=k)
        assert w.panel
        paneled, whole = quant.QLinear(w, None, bits), quant.QLinear(whole_rows(w), None, bits)
        for m in ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            y = paneled(x)
            assert torch.equal(y, whole(x)), (k, m)
        assert_close(y, reference(w, x, bits), KERNEL_TOL)


@pytest.mark.parametrize("m", [1, 5, 40])
def test_epilogues_stacks_and_row_operations_over_panels(m: int, isa: str) -> None:
    """add, silu_mul and GELU-mul over panels equal whole rows'; a QKV-style stack of Q4_K,
    Q6_K and Q8_0 paneled parts runs each part in its panels; cat_rows, rows, scaled and
    the embedding lookup (dequant) keep the exact values."""
    k = 2304
    parts = [
        make_weight("Q4_K", 24, k),
        make_weight("Q6_K", 16, k, seed=1),
        make_weight("Q8_0", 8, k, seed=2),
    ]
    stack = quant.cat_rows(parts)
    assert isinstance(stack, quant.QuantStack) and all(p.panel for p in stack.parts)
    whole = quant.cat_rows([whole_rows(p) for p in parts])
    a, b = quant.QLinear(stack, None), quant.QLinear(whole, None)
    x, res = torch.randn(m, k), torch.randn(m, 48)
    assert torch.equal(a(x), b(x))
    assert torch.equal(a.silu_mul(x), b.silu_mul(x))
    assert torch.equal(a.add(x, res.clone()), b.add(x, res.clone()))
    out = torch.empty(m, 24)
    assert torch.equal(
        a._gemm(x, out, kernels.EPI_GELU_MUL), b._gemm(x, out.clone(), kernels.EPI_GELU_MUL)
    )
    assert_close(a(x), reference(stack, x), KERNEL_TOL)
    same = quant.cat_rows([parts[0], make_weight("Q4_K", 8, k, seed=4)])
    assert isinstance(same, quant.QuantWeight) and same.panel
    torch.testing.assert_close(
        same.dequantize(),
        torch.cat([parts[0].dequantize(), make_weight("Q4_K", 8, k, seed=4).dequantize()]),
    )
    perm = torch.randperm(24)
    torch.testing.assert_close(
        parts[0].rows(perm).dequantize(), parts[0].dequantize()[perm], rtol=0, atol=0
    )
    torch.testing.assert_close(
        parts[0].scaled(0.5).dequantize(), parts[0].dequantize() * 0.5, rtol=0, atol=0
    )
    ids = torch.tensor([3, 0, 23, 3])
    torch.testing.assert_close(
        quant.QEmbedding(parts[0])(ids), parts[0].dequantize()[ids], rtol=0, atol=0
    )


@pytest.mark.parametrize("fused", [True, False])
def test_a_model_with_paneled_rows_tracks_transformers(fused: bool) -> None:
    """A llama whose MLP is 1280 wide (down's rows in panels of 1024 and 256) on Q4 weights:
    prefill and decode logits within 2e-3 of transformers' on the dequantized weights with
    the kernels' activations, through the fused step and the torch path."""
    from tests.model_runner.oracle import plan, random_ids, seq

    runner, hf = quantized_pair("llama", "q4", {"intermediate_size": 1280}, fused_step=fused)
    down = runner.model.layers[0].down.weight  # type: ignore[attr-defined]
    assert down.panel == 1024 // quant.FORMATS[down.fmt].block
    ids = random_ids(40, seed=3)
    blocks = list(range(10))
    ref = hf_logits_quantized_acts(hf, ids, 16)
    out = runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 30, blocks)]))["a"]
    assert_close(out, ref[:30], 2e-3)
    for pos in range(30, 34):
        out = runner.step_logits(plan(pos, decode=[seq("a", ids, pos, pos + 1, blocks)]))["a"]
        assert_close(out, ref[pos : pos + 1], 2e-3)
