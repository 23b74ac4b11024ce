"""The torch backend's batch: the index tensors of one step (slots, gathers, groups, masks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_runner.attention_backends.base import AttentionSpec, ForwardBatch
from model_runner.attention_backends.torch_backend import GatherMetadata, TorchAttention
from model_runner.step import StepRows
from scheduler.output import ScheduledSeq
from tests.model_runner.oracle import DEVICE, seq

NEG = float("-inf")


def build(
    prefill: Sequence[ScheduledSeq],
    decode: Sequence[ScheduledSeq],
    block_size: int,
    sliding_window: int | None = None,
) -> ForwardBatch[GatherMetadata]:
    """The torch backend's batch of these seqs (2 heads, head_dim 8, fp32)."""
    spec = AttentionSpec(2, 2, 8, block_size, torch.float32, torch.float32, DEVICE, sliding_window)
    step = StepRows.from_seqs(prefill, decode, block_size)
    return TorchAttention(spec).build(step)


def test_prefill_then_decode_rows_and_slots() -> None:
    """Prefill chunk rows come first, then decode rows; slots follow the block tables
    (position p -> block_ids[p // 4] * 4 + p % 4)."""
    batch = build(
        [seq("a", list(range(10, 16)), 2, 6, [7, 3])],
        [seq("b", list(range(10, 20)), 9, 10, [5, 1, 8])],
        block_size=4,
    )
    assert batch.num_tokens == 5
    assert batch.input_ids.tolist() == [12, 13, 14, 15, 19]
    assert batch.positions.tolist() == [2, 3, 4, 5, 9]
    assert batch.slot_mapping.tolist() == [30, 31, 12, 13, 33]
    (chunk,) = batch.metadata.prefills
    assert (chunk.row_start, chunk.row_end, chunk.num_keys) == (0, 4, 6)
    assert chunk.block_index is not None and chunk.block_index.tolist() == [7, 3]
    assert chunk.mask is not None
    assert chunk.mask.tolist() == [[k <= q for k in range(6)] for q in range(2, 6)]
    (dec,) = batch.metadata.decodes
    assert (dec.row_start, dec.num_seqs, dec.context_len) == (4, 1, 12)
    assert dec.block_index.tolist() == [5, 1, 8]
    assert dec.mask.squeeze(1).tolist() == [[0.0] * 10 + [NEG] * 2]


def test_fresh_prompt_attends_to_itself() -> None:
    """A chunk starting at position 0 gathers nothing and runs plain causal attention."""
    batch = build([seq("a", list(range(7)), 0, 7, [2, 9])], [], 4)
    (chunk,) = batch.metadata.prefills
    assert chunk.block_index is None and chunk.mask is None
    assert batch.metadata.decodes == []


def test_decodes_are_grouped_by_context_length() -> None:
    """Longest-first decodes of 23, 18, 11, 4 and 1 blocks form groups [23, 18], [11], [4, 1]
    (a group never pads a context to more than twice its length once above 8 blocks); each
    group pads its gather with the row's own last block and masks the padding."""
    lengths = [90, 70, 40, 12, 3]  # positions; blocks = pos // 4 + 1
    decode = [
        seq(f"r{i}", [1] * (n + 1), n, n + 1, list(range(100 * i, 100 * i + n // 4 + 1)))
        for i, n in enumerate(lengths)
    ]
    batch = build([], decode, 4)
    shapes = [(d.row_start, d.num_seqs, d.context_len) for d in batch.metadata.decodes]
    assert shapes == [(0, 2, 92), (2, 1, 44), (3, 2, 16)]
    last = batch.metadata.decodes[2]
    assert last.block_index.tolist() == [300, 301, 302, 303, 400, 400, 400, 400]
    assert last.mask.squeeze(1).tolist() == [[0.0] * 13 + [NEG] * 3, [0.0] * 4 + [NEG] * 12]


def test_sliding_window_starts_gathers_inside_the_window() -> None:
    """Window 8, block size 4: a decode at position 21 sees keys 14..21, so it gathers from
    block 3 (keys 12..) and masks 12 and 13; released blocks before it are never listed."""
    table = [0, 0, 0, 6, 7, 8]  # blocks 0-2 released to the null block
    batch = build([], [seq("a", [1] * 22, 21, 22, table)], 4, sliding_window=8)
    (dec,) = batch.metadata.decodes
    assert dec.block_index.tolist() == [6, 7, 8]
    assert dec.mask.squeeze(1).tolist() == [[NEG, NEG] + [0.0] * 8 + [NEG, NEG]]


def test_per_layer_windows_attend_as_uniform_windows() -> None:
    """Layers of their own windows (Gemma 3: 6, 6, None): each layer's output equals the
    backend's with that window on every layer, for a fresh chunk past the window, a chunk
    over a cached prefix and decodes; a window every layer shares (6, 6, 6) is every
    layer's, not none; gathers of a windowed layer start at its window's block."""
    from model_runner.kv_pool import KVPool

    prefill = [seq("a", list(range(20)), 0, 14, [1, 2, 3, 4, 5]),
               seq("b", list(range(20)), 9, 17, [6, 7, 8, 9, 10])]  # fmt: skip
    decode = [seq("c", list(range(30)), 29, 30, [11, 12, 13, 14, 15, 16, 17, 18])]
    step = StepRows.from_seqs(prefill, decode, 4)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(step.num_rows, 6, 8, generator=g).to(DEVICE)
    pool = KVPool(3, 2, 8, 20, 4, torch.float32, DEVICE)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g))

    def outputs(windows: tuple[int | None, ...], sliding: int | None = None) -> list[torch.Tensor]:
        spec = AttentionSpec(2, 2, 8, 4, torch.float32, torch.float32, DEVICE, sliding,
                             layer_windows=windows)  # fmt: skip
        backend = TorchAttention(spec)
        batch = backend.build(step)
        outs = []
        for layer in range(3):
            out = torch.empty(step.num_rows, 16, device=DEVICE)
            backend.forward(layer, qkv.clone(), batch, pool, out)
            outs.append(out)
        return outs

    layered = outputs((6, 6, None))
    windowed, full = outputs((), 6), outputs(())
    for layer, ref in ((0, windowed), (1, windowed), (2, full)):
        torch.testing.assert_close(layered[layer], ref[layer], rtol=0, atol=0)
    assert not torch.equal(windowed[2], full[2])
    shared = outputs((6, 6, 6))
    for layer in range(3):
        torch.testing.assert_close(shared[layer], windowed[layer], rtol=0, atol=0)
    batch = build(prefill, decode, 4)
    spec = AttentionSpec(2, 2, 8, 4, torch.float32, torch.float32, DEVICE,
                         layer_windows=(6, None))  # fmt: skip
    meta = TorchAttention(spec).build(step).metadata
    assert [m.decodes[0].block_index.tolist() for m in meta.per_layer] == [
        [17, 18], batch.metadata.decodes[0].block_index.tolist()
    ]  # fmt: skip
