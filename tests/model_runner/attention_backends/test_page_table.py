"""The block table -> page table conversion and FlashInfer's plan arguments, exactly."""

from __future__ import annotations

import torch

from model_runner.attention_backends.base import AttentionSpec
from model_runner.attention_backends.flashinfer_backend import (
    FlashInferPlan,
    flashinfer_plan_args,
    window_left,
)
from model_runner.attention_backends.page_table import build_page_table, sink_rotation
from tests.model_runner.oracle import seq

CPU = torch.device("cpu")


def _ids(n: int) -> list[int]:
    return list(range(n))


def test_pages_cover_the_context_and_the_last_page_length() -> None:
    """A decode at 9 (3 pages, 2 keys in the last), a chunk 4..11 over a 4-token prefix
    (3 pages, last full) and a 1-token prompt: exact indptrs, page ids and lengths."""
    table = build_page_table(
        [
            seq("a", _ids(10), 9, 10, [5, 1, 8, 30]),
            seq("b", _ids(12), 4, 12, [7, 3, 2]),
            seq("c", _ids(1), 0, 1, [11]),
        ],
        block_size=4,
    )
    assert table.qo_indptr == [0, 1, 9, 10]
    assert table.kv_indptr == [0, 3, 6, 7]
    assert table.kv_indices == [5, 1, 8, 7, 3, 2, 11]
    assert table.kv_last_page_len == [2, 4, 1]
    assert table.kv_start_pos == [0, 0, 0]
    assert table.kv_lens == [10, 12, 1]
    assert table.qo_lens == [1, 8, 1]


def test_window_drops_pages_before_the_first_visible_key() -> None:
    """Window 8, block size 4: a decode at 17 sees keys 10..17, so its pages start at block
    2 (keys 8..); a chunk 12..15 starts where its FIRST query's window does (block 1)."""
    table = build_page_table(
        [
            seq("a", _ids(18), 17, 18, [0, 0, 4, 5, 6]),
            seq("b", _ids(16), 12, 16, [9, 10, 11, 12]),
        ],
        block_size=4,
        sliding_window=8,
    )
    assert table.kv_indptr == [0, 3, 6]
    assert table.kv_indices == [4, 5, 6, 10, 11, 12]
    assert table.kv_start_pos == [8, 4]
    assert table.kv_last_page_len == [2, 4]
    assert table.kv_lens == [10, 12]


def test_released_null_blocks_are_never_listed() -> None:
    """Without a window, blocks the adaptive strategy released to the null block 0 are
    skipped: pages start at the first live block."""
    table = build_page_table(
        [seq("a", _ids(15), 14, 15, [0, 0, 5, 6])], block_size=4, null_block_id=0
    )
    assert table.kv_indices == [5, 6]
    assert table.kv_start_pos == [8]
    assert table.kv_lens == [7]


def test_sinks_list_the_sink_blocks_then_the_window() -> None:
    """4 sinks, window 8, block size 4: a decode at 17 lists the sink block, then blocks 2..4
    (14 relative keys); one at 9 still reaches the sinks, so its pages run from block 0."""
    table = build_page_table(
        [
            seq("a", _ids(18), 17, 18, [7, 0, 4, 5, 6]),
            seq("b", _ids(10), 9, 10, [1, 2, 3]),
        ],
        block_size=4,
        sliding_window=8,
        attention_sinks=4,
    )
    assert table.kv_indices == [7, 4, 5, 6, 1, 2, 3]
    assert table.kv_indptr == [0, 4, 7]
    assert table.kv_lens == [14, 10]
    assert table.kv_start_pos == [0, 0]


def test_sink_rotation_turns_each_row_back_by_its_gap() -> None:
    """Window 8, 4 sinks: rows at 10, 11 and 20 have gaps 0, 0 and 9; the rotation is
    ``-gap * inv_freq`` as fp32 cos and sin."""
    inv_freq = torch.tensor([1.0, 0.25], dtype=torch.float64)
    cos, sin = sink_rotation(
        [seq("a", _ids(12), 10, 12, [1, 2, 3]), seq("b", _ids(21), 20, 21, [4])], 8, 4, inv_freq
    )
    angles = torch.tensor([[0.0, 0.0], [0.0, 0.0], [-9.0, -2.25]], dtype=torch.float64)
    assert cos.dtype == torch.float32
    assert torch.equal(cos, angles.cos().float())
    assert torch.equal(sin, angles.sin().float())


def test_padding_appends_empty_slots() -> None:
    """``padded(4)`` of a 2-request table adds 2 slots with no queries, pages or keys."""
    table = build_page_table(
        [seq("a", _ids(6), 5, 6, [3, 4]), seq("b", _ids(1), 0, 1, [9])], block_size=4
    ).padded(4)
    assert table.qo_indptr == [0, 1, 2, 2, 2]
    assert table.kv_indptr == [0, 2, 3, 3, 3]
    assert table.kv_indices == [3, 4, 9]
    assert table.kv_last_page_len == [2, 1, 0, 0]
    assert table.kv_lens == [6, 1, 0, 0]


def test_device_tensors_are_int32_slices_of_the_lists() -> None:
    """``to_device`` gives int32 tensors equal to the lists, and the maxima of the lengths."""
    table = build_page_table(
        [seq("a", _ids(10), 9, 10, [5, 1, 8]), seq("b", _ids(7), 2, 7, [6, 2])], block_size=4
    )
    dev = table.to_device(torch.device("cpu"))
    assert dev.kv_indices.dtype == torch.int32
    assert dev.qo_indptr.tolist() == [0, 1, 6]
    assert dev.kv_indptr.tolist() == [0, 3, 5]
    assert dev.kv_indices.tolist() == [5, 1, 8, 6, 2]
    assert dev.kv_last_page_len.tolist() == [2, 3]
    assert dev.kv_lens.tolist() == [10, 7]
    assert (dev.max_qo_len, dev.max_kv_len) == (5, 10)


def test_flashinfer_decode_plan_arguments() -> None:
    """The decode wrapper's plan: indptr, indices, last page lengths, heads, head_dim,
    page size; window_left W - 1, sm_scale 1 (Q is pre-scaled), the dtypes."""
    table = build_page_table(
        [seq("a", _ids(10), 9, 10, [5, 1, 8]), seq("b", _ids(3), 2, 3, [4])], block_size=4
    )
    spec = AttentionSpec(32, 8, 128, 4, torch.bfloat16, torch.bfloat16, CPU, 4096)
    plan = flashinfer_plan_args(table, spec, decode=True)
    assert plan == FlashInferPlan(
        ([0, 3, 4], [5, 1, 8, 4], [2, 3], 32, 8, 128, 4),
        {
            "window_left": 4095,
            "sm_scale": 1.0,
            "q_data_type": torch.bfloat16,
            "kv_data_type": torch.bfloat16,
        },
    )


def test_flashinfer_prefill_plan_arguments() -> None:
    """The prefill wrapper's plan: qo_indptr first, causal, no window (-1)."""
    table = build_page_table([seq("a", _ids(7), 2, 7, [6, 2])], block_size=4)
    spec = AttentionSpec(4, 2, 16, 4, torch.float16, torch.float16, CPU)
    plan = flashinfer_plan_args(table, spec, decode=False)
    assert plan.args == ([0, 5], [0, 2], [6, 2], [3], 4, 2, 16, 4)
    assert plan.kwargs == {
        "causal": True,
        "window_left": -1,
        "sm_scale": 1.0,
        "q_data_type": torch.float16,
        "kv_data_type": torch.float16,
    }
    assert (window_left(None), window_left(1), window_left(8)) == (-1, 0, 7)
