"""Placeholders: the step in flight's rows, substituted into the next step's rows and resolved
on the device, exactly (model_runner.future)."""

from __future__ import annotations

import dataclasses

import torch

from model_runner.future import FutureTokens, Placeholders
from model_runner.step import StepLimits, StepRows
from scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledSeq, SchedulerOutput
from tests.model_runner.oracle import seq

CPU = torch.device("cpu")
LIMITS = StepLimits(block_size=4, num_blocks=64, max_model_len=64, vocab_size=100)


def ahead(rid: str, known: list[int], table: list[int]) -> ScheduledSeq:
    """A decode planned one step ahead: its one token is the placeholder for the token the
    step in flight samples (output token ``len(known)``, at position ``len(known)``)."""
    s = seq(rid, [*known, 0], len(known), len(known) + 1, table)
    return dataclasses.replace(s, token_ids=[PLACEHOLDER_TOKEN_ID], all_token_ids=known)


def test_a_placeholder_becomes_its_requests_row_and_resolves_to_its_token() -> None:
    """The step in flight sampled b, a, c (rows 0, 1, 2): the next step's placeholders for
    a and c become -2 and -3 in its rows (a known token stays as it is), and resolve to the
    ids that step published at rows 1 and 2."""
    placeholders = Placeholders(8, CPU)
    ids = list(range(10, 20))
    assert placeholders.advance([seq(r, ids, 0, 3, [1]) for r in "bac"])
    placeholders.publish(torch.tensor([71, 72, 73]))
    plan = SchedulerOutput(
        2,
        decode=[ahead("a", ids[:3], [1]), seq("d", ids, 4, 5, [2, 3]), ahead("c", ids[:5], [4, 5])],
    )
    rows = StepRows.of(plan, LIMITS, placeholders)
    assert rows.failed == {}
    assert [(s.request_id, s.token_ids) for s in rows.decode] == [
        ("c", [-3]),
        ("d", [14]),
        ("a", [-2]),
    ]
    resolved = placeholders.resolve(torch.tensor(rows.token_ids))
    assert resolved.tolist() == [73, 14, 72]
    assert [placeholders.history_id(s) for s in rows.decode] == [-3, None, -2]


def test_placeholders_without_a_row_or_outside_a_decode_fail_alone() -> None:
    """A placeholder whose request the step in flight did not sample, one in a prefill chunk
    and one past the buffer's capacity fail with their reasons; the rest runs."""
    placeholders = Placeholders(2, CPU)
    ids = list(range(10, 20))
    placeholders.advance([seq(r, ids, 0, 3, [1]) for r in "abz"])  # z: past capacity 2
    chunk = dataclasses.replace(seq("p", ids, 0, 3, [6]), token_ids=[10, 11, PLACEHOLDER_TOKEN_ID])
    plan = SchedulerOutput(
        3,
        prefill=[chunk],
        decode=[ahead("a", ids[:3], [1]), ahead("x", ids[:3], [2]), ahead("z", ids[:3], [3])],
    )
    rows = StepRows.of(plan, LIMITS, placeholders)
    none = "a placeholder token, but the step before sampled none for it"
    assert rows.failed == {
        "p": "a placeholder token outside a one-token decode",
        "x": none,
        "z": none,
    }
    assert [(s.request_id, s.token_ids) for s in rows.seqs] == [("a", [-1])]


def test_a_step_that_publishes_nothing_leaves_no_row() -> None:
    """After a step with drafts (or one that computes nothing) no placeholder has a row, and
    without ``Placeholders`` a placeholder is a token outside the vocabulary."""
    placeholders = Placeholders(4, CPU)
    ids = list(range(10, 20))
    assert placeholders.advance([seq("a", ids, 0, 3, [1])])
    assert not placeholders.advance(None)
    plan = SchedulerOutput(4, decode=[ahead("a", ids[:3], [1])])
    assert StepRows.of(plan, LIMITS, placeholders).failed == {
        "a": "a placeholder token, but the step before sampled none for it"
    }
    assert StepRows.of(plan, LIMITS).failed == {"a": "token id outside the vocabulary of 100"}


def test_future_tokens_publish_the_first_capacity_rows() -> None:
    """A step sampling more rows than the buffer holds publishes its first ``capacity``;
    ``encode`` names row j as -(j + 1), and known ids pass through ``resolve``."""
    future = FutureTokens(3, CPU)
    future.publish(torch.tensor([5, 6, 7, 8]))
    assert future.ids.tolist() == [5, 6, 7]
    ids = torch.tensor([FutureTokens.encode(2), 42, FutureTokens.encode(0)])
    assert future.resolve(ids).tolist() == [7, 42, 5]
