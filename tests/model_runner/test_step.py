"""StepRows: one step's rows (ids, positions, slots, tables, sampled rows), exactly."""

from __future__ import annotations

import dataclasses

import pytest

from model_runner.step import StepLimits, StepRows, num_accepted_drafts, verify_rows
from scheduler.output import SchedulerOutput
from tests.model_runner.oracle import seq

LIMITS = StepLimits(block_size=4, num_blocks=64, max_model_len=64, vocab_size=100)


def draft(rid: str, ids: list[int], pos: int, num_drafts: int, table: list[int]):  # type: ignore[no-untyped-def]
    """A decode at ``pos`` carrying ``num_drafts`` drafts (the tokens after it in ``ids``)."""
    s = seq(rid, ids, pos, pos + 1 + num_drafts, table)
    return dataclasses.replace(s, all_token_ids=ids[: pos + 1], num_draft_tokens=num_drafts)


def test_rows_run_prefill_then_drafts_then_decodes_longest_first() -> None:
    """A 3-token chunk, decodes at 9 and 2 and a decode with 2 drafts at 5: rows are the chunk,
    the three rows of the draft decode, then the decodes longest first; slots follow the
    tables (p -> block_ids[p // 4] * 4 + p % 4)."""
    ids = list(range(10, 30))
    plan = SchedulerOutput(
        1,
        prefill=[seq("p", ids, 2, 5, [7, 3])],
        decode=[
            seq("s", ids, 2, 3, [6]),
            draft("v", ids, 5, 2, [1, 2]),
            seq("l", ids, 9, 10, [5, 1, 8]),
        ],
        null_block_id=0,
    )
    step = StepRows.of(plan, LIMITS)
    assert [s.request_id for s in step.seqs] == ["p", "v", "l", "s"]
    assert step.num_verify == 1
    assert [s.request_id for s in step.chunks] == ["p", "v"]
    assert [s.request_id for s in step.plain_decodes] == ["l", "s"]
    assert step.token_ids == [12, 13, 14, 15, 16, 17, 19, 12]
    assert step.positions == [2, 3, 4, 5, 6, 7, 9, 2]
    assert step.slot_mapping == [30, 31, 12, 9, 10, 11, 33, 26]
    assert step.block_tables() == [[7, 3]] * 3 + [[1, 2]] * 3 + [[5, 1, 8], [6]]
    assert (step.num_rows, step.num_prefill_rows, step.max_position) == (8, 3, 9)
    assert step.null_block_id == 0 and step.failed == {}


def test_sample_rows_are_a_chunks_last_and_every_decode_row() -> None:
    """A sampling chunk samples its last row, a middle chunk none, a decode with k drafts its
    k + 1 rows; ``sampled`` lists the seqs that sample in row order."""
    ids = list(range(20))
    step = StepRows.from_seqs(
        [seq("a", ids, 0, 4, [1]), seq("b", ids, 0, 3, [2], do_sample=False)],
        [draft("v", ids, 6, 2, [3, 4, 6]), seq("d", ids, 3, 4, [5])],
        block_size=4,
    )
    assert step.sample_rows() == [3, 7, 8, 9, 10]
    assert [s.request_id for s in step.sampled()] == ["a", "v", "d"]


def test_bad_seqs_fail_alone() -> None:
    """A seq with a token outside the vocabulary or a table too short is in ``failed`` with
    the reason, and has no rows; the others run."""
    ids = list(range(10))
    plan = SchedulerOutput(
        0,
        prefill=[seq("ok", ids, 0, 4, [1]), seq("short", ids, 0, 6, [2])],
        decode=[seq("vocab", [*ids, 500], 10, 11, [3, 4, 5])],
    )
    step = StepRows.of(plan, LIMITS)
    assert [s.request_id for s in step.seqs] == ["ok"]
    assert step.failed == {
        "short": "block table of 1 blocks cannot hold position 5 with block_size 4",
        "vocab": "token id outside the vocabulary of 100",
    }


def test_positions_past_max_model_len_fail_unless_unbounded() -> None:
    """A decode at position 64 of a 64-token model fails; with attention sinks (unbounded
    positions) it runs."""
    ids = list(range(65))
    plan = SchedulerOutput(0, decode=[seq("a", ids, 64, 65, list(range(17)))])
    assert StepRows.of(plan, LIMITS).failed == {
        "a": "positions 64..64 outside the model's max_model_len 64"
    }
    unbounded = dataclasses.replace(LIMITS, unbounded_positions=True)
    assert StepRows.of(plan, unbounded).num_rows == 1


def test_drafts_must_come_first_among_decodes() -> None:
    """``from_seqs`` refuses a decode with drafts after a plain one (its rows would not be
    chunks)."""
    ids = list(range(10))
    with pytest.raises(ValueError, match="drafts must come first"):
        StepRows.from_seqs([], [seq("d", ids, 2, 3, [1]), draft("v", ids, 4, 1, [2, 3])], 4)


def test_split_and_one_row_decodes() -> None:
    """``split`` gives the prefill rows and the decode rows as two steps; ``one_row_decodes``
    turns a decode with 2 drafts into 3 one-token decodes at consecutive positions."""
    ids = list(range(20))
    step = StepRows.from_seqs(
        [seq("p", ids, 0, 3, [1])],
        [draft("v", ids, 6, 2, [3, 4, 6]), seq("d", ids, 3, 4, [5])],
        4,
        0,
    )
    prefill, decode = step.split()
    assert (prefill.token_ids, decode.token_ids) == ([0, 1, 2], [6, 7, 8, 3])
    assert decode.num_verify == 1 and decode.null_block_id == 0
    rows = step.one_row_decodes()
    assert [(s.request_id, s.token_ids, s.start_pos) for s in rows] == [
        ("v", [6], 6), ("v", [7], 7), ("v", [8], 8), ("d", [3], 3)
    ]  # fmt: skip
    assert all(s.num_draft_tokens == 0 and s.block_ids == [3, 4, 6] for s in rows[:3])


def test_verify_rows_and_accepted_drafts() -> None:
    """Row i of a decode with drafts samples output token ``num_output_tokens + i``; drafts
    are accepted while they equal the tokens sampled before them."""
    s = dataclasses.replace(draft("v", list(range(20)), 6, 3, [3, 4]), num_output_tokens=5)
    rows = verify_rows(s)
    assert [(r.token_ids, r.start_pos, r.num_output_tokens) for r in rows] == [
        ([6], 6, 5), ([7], 7, 6), ([8], 8, 7), ([9], 9, 8)
    ]  # fmt: skip
    assert num_accepted_drafts(s, [7, 8, 9, 1]) == 3
    assert num_accepted_drafts(s, [7, 0, 9, 1]) == 1
    assert num_accepted_drafts(s, [1, 8, 9, 1]) == 0
