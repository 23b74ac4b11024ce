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
