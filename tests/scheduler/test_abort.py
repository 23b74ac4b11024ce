"""abort() works in every state, returns the final output, and frees blocks exactly once."""

from __future__ import annotations

from scheduler import FinishReason, RequestStatus
from tests.scheduler.helpers import (
    assert_no_blocks_held,
    make_request,
    make_runner,
    make_scheduler,
    step,
)


def test_abort_waiting_request() -> None:
    """A request that never ran ends with ABORT and leaves the waiting queue and its counts."""
    sched, kv = make_scheduler()
    req = make_request("r0", prompt_len=6)
    sched.add_request(req)
    out = sched.abort("r0")
    assert out is not None
    assert (out.request_id, out.finished, out.finish_reason) == ("r0", True, FinishReason.ABORT)
    assert req.status is RequestStatus.FINISHED_ABORTED
    stats = sched.make_stats()
    assert (stats.num_waiting, stats.num_waiting_tokens, stats.num_finished_total) == (
        0,
        0,
        {"abort": 1},
    )
    assert sched.schedule().is_empty
    assert_no_blocks_held(kv)


def test_abort_mid_prefill_returns_the_chunk_blocks() -> None:
    """Aborting between two chunks of a prompt frees the blocks of the first chunk."""
    sched, kv = make_scheduler(max_num_batched_tokens=4)
    runner = make_runner(kv)
    req = make_request("r0", prompt_len=10)
    sched.add_request(req)
    step(sched, runner)
    assert req.status is RequestStatus.PREFILLING and kv.block_ids("r0") == [0]
    out = sched.abort("r0")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert_no_blocks_held(kv)
    assert sched.schedule().finished_request_ids == ["r0"]


def test_abort_decoding_request() -> None:
    """Aborting a decoding request frees its blocks; the output reports its tokens so far."""
    sched, kv = make_scheduler()
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=5, max_tokens=8))
    step(sched, runner)
    step(sched, runner)
    assert kv.block_ids("r0") == [0, 1]
    out = sched.abort("r0")
    assert out is not None and (out.num_prompt_tokens, out.num_output_tokens) == (5, 2)
    assert_no_blocks_held(kv)
    assert kv.free_block_ids()[:2] == [0, 1]  # freed tail first, each to the front


def test_abort_preempted_request() -> None:
    """A preempted request (waiting, holding no blocks) aborts without touching the cache."""
    sched, kv = make_scheduler(num_blocks=4, max_num_batched_tokens=16)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=7, max_tokens=8))
    sched.add_request(make_request("r1", prompt_len=7, max_tokens=8, first_token=200))
    step(sched, runner)
    step(sched, runner)
    step(sched, runner)  # r0 needs a third block: r1 (same rank and progress, later) yields
    r1 = sched.get_request("r1")
    assert r1 is not None and r1.status is RequestStatus.PREEMPTED
    assert sched.make_stats().num_preempted == 1
    used_before = kv.make_stats().num_blocks_used
    out = sched.abort("r1")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert kv.make_stats().num_blocks_used == used_before == 3
    assert sched.make_stats().num_preempted == 0 and sched.num_waiting == 0
    sched.abort("r0")
    assert_no_blocks_held(kv)


def test_abort_between_schedule_and_update_frees_once() -> None:
    """A request aborted after it was planned is skipped by update; blocks are freed once."""
    sched, kv = make_scheduler()
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=5, max_tokens=4))
    sched.add_request(make_request("r1", prompt_len=2, max_tokens=4, first_token=300))
    plan = sched.schedule()
    result = runner.execute(plan)
    assert sched.abort("r0") is not None
    outputs = sched.update(plan, result)
    assert [o.request_id for o in outputs] == ["r1"]
    assert not kv.has_request("r0") and kv.block_ids("r1") == [2]
    kv.check_invariants()
    sched.abort("r1")
    assert_no_blocks_held(kv)


def test_abort_unknown_or_finished_returns_none() -> None:
    """abort of an unknown or already finished id is a no-op returning None."""
    sched, kv = make_scheduler()
    runner = make_runner(kv)
    assert sched.abort("nope") is None
    sched.add_request(make_request("r0", prompt_len=3, max_tokens=1))
    step(sched, runner)
    assert sched.get_request("r0") is None
    assert sched.abort("r0") is None
    assert sched.make_stats().num_finished_total == {"length": 1}
    assert_no_blocks_held(kv)
