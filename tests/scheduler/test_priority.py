"""Priority order: preemption when max_num_seqs or memory binds, aging, place in line."""

from __future__ import annotations

from scheduler import FinishReason, RequestStatus
from tests.scheduler.helpers import (
    assert_no_blocks_held,
    decode_view,
    make_request,
    make_runner,
    make_scheduler,
    prefill_view,
    run_until_done,
    step,
)


def _two_low_priority_decoding(queue_order: str):  # type: ignore[no-untyped-def]
    sched, kv = make_scheduler(
        num_blocks=16, max_num_seqs=2, queue_order=queue_order, aging_steps=0
    )
    runner = make_runner(kv)
    sched.add_request(make_request("lo1", prompt_len=3, max_tokens=10, priority=5))
    sched.add_request(make_request("lo2", prompt_len=3, max_tokens=10, priority=5, first_token=200))
    step(sched, runner)  # both prefill (3 tokens each) and sample
    step(sched, runner)  # both decode: 4 computed each
    sched.add_request(make_request("hi", prompt_len=3, max_tokens=2, priority=0, first_token=300))
    return sched, kv, runner


def test_high_priority_arrival_preempts_when_max_num_seqs_binds() -> None:
    """With both seats taken, a priority-0 arrival preempts the later of two equal victims."""
    sched, kv, runner = _two_low_priority_decoding("priority")
    s3 = step(sched, runner)
    # lo2 was planned for decode (and got block 3), then preempted: its seat and blocks go to
    # hi. Its blocks were freed tail first to the front of the free list: [1, 3, ...].
    assert decode_view(s3.plan) == [("lo1", 4, [0, 2])]
    assert prefill_view(s3.plan) == [("hi", 0, 3, [1], True)]
    lo2 = sched.get_request("lo2")
    assert lo2 is not None and lo2.status is RequestStatus.PREEMPTED
    assert lo2.num_computed_tokens == 0
    assert lo2.output_token_ids == [runner.default_token("lo2", 0), runner.default_token("lo2", 1)]
    stats = sched.make_stats()
    assert (stats.num_preemptions_total, stats.num_recomputed_tokens_total) == (1, 4)
    assert stats.num_preemptions_total == 1
    assert sched.waiting_request_ids() == ["lo2"]
    steps = run_until_done(sched, runner)
    assert lo2.output_token_ids == [runner.default_token("lo2", i) for i in range(10)]
    assert s3.out("hi").new_token_ids == [runner.default_token("hi", 0)]
    assert steps[0].out("hi").finish_reason is FinishReason.LENGTH
    assert_no_blocks_held(kv)


def test_fcfs_never_preempts_for_a_seat() -> None:
    """Under FCFS the same priority-0 arrival waits for a free seat."""
    sched, _, runner = _two_low_priority_decoding("fcfs")
    s3 = step(sched, runner)
    assert [s.request_id for s in s3.plan.decode] == ["lo1", "lo2"] and s3.plan.prefill == []
    assert sched.make_stats().num_preemptions_total == 0
    assert sched.waiting_request_ids() == ["hi"]


def test_high_priority_arrival_preempts_when_memory_binds() -> None:
    """Under priority order a waiting request also preempts a worse one for blocks."""
    sched, kv = make_scheduler(
        num_blocks=4, max_num_batched_tokens=16, queue_order="priority", aging_steps=0
    )
    runner = make_runner(kv)
    sched.add_request(make_request("lo", prompt_len=13, max_tokens=3, priority=5))
    step(sched, runner)
    assert kv.num_free_blocks == 0
    sched.add_request(make_request("hi", prompt_len=3, max_tokens=2, priority=0, first_token=300))
    s2 = step(sched, runner)
    assert s2.plan.decode == []  # lo was planned, then preempted: [3, 2, 1, 0] to the front
    assert prefill_view(s2.plan) == [("hi", 0, 3, [0], True)]
    run_until_done(sched, runner)
    assert sched.make_stats().num_preemptions_total == 1
    assert_no_blocks_held(kv)


def test_equal_priority_never_preempts() -> None:
    """A waiting request preempts only a strictly worse effective priority."""
    sched, kv = make_scheduler(num_blocks=16, max_num_seqs=1, queue_order="priority")
    runner = make_runner(kv)
    sched.add_request(make_request("a", prompt_len=3, max_tokens=3, priority=1))
    step(sched, runner)
    sched.add_request(make_request("b", prompt_len=3, max_tokens=3, priority=1, first_token=200))
    s2 = step(sched, runner)
    assert [s.request_id for s in s2.plan.decode] == ["a"] and s2.plan.prefill == []


def test_preempted_request_keeps_its_place_in_line() -> None:
    """A preempted request goes back ahead of every request that arrived after it."""
    sched, _, runner = _two_low_priority_decoding("priority")
    sched.add_request(make_request("lo3", prompt_len=3, max_tokens=2, priority=5, first_token=400))
    step(sched, runner)  # hi preempts lo2
    sched.add_request(make_request("lo4", prompt_len=3, max_tokens=2, priority=5, first_token=500))
    assert sched.waiting_request_ids() == ["lo2", "lo3", "lo4"]


def _run_low_priority_under_high_priority_stream(aging_steps: int, num_steps: int):  # type: ignore[no-untyped-def]
    """One seat; L (priority 2) and H_0 arrive, then a new priority-0 H_k before every step.
    Each H takes two steps (prefill + one decode), so without aging the H queue never empties."""
    sched, kv = make_scheduler(
        num_blocks=8, max_num_seqs=1, queue_order="priority", aging_steps=aging_steps
    )
    runner = make_runner(kv)
    low = make_request("L", prompt_len=2, max_tokens=2, priority=2, first_token=900)
    sched.add_request(low)
    finished_at: dict[str, int] = {}
    for k in range(num_steps):
        sched.add_request(make_request(f"H{k}", prompt_len=2, max_tokens=2, first_token=10 + k))
        s = step(sched, runner)
        for out in s.outputs:
            if out.finished:
                finished_at[out.request_id] = s.plan.step_id
    return sched, low, finished_at


def test_aging_lets_a_low_priority_request_finish_under_a_high_priority_stream() -> None:
    """aging_steps=4: H_k has rank k // 4, L has rank 2 and arrived first, so L runs right after
    H_0..H_7 (ranks 0 and 1). Each H holds the seat for steps 2j+1, 2j+2: L is admitted at step
    17 and finishes at step 18, never preempted (later arrivals rank >= 2)."""
    sched, low, finished_at = _run_low_priority_under_high_priority_stream(4, 30)
    assert finished_at["L"] == 18
    assert [finished_at[f"H{k}"] for k in range(8)] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert "H8" not in finished_at or finished_at["H8"] == 20
    assert low.finish_reason is FinishReason.LENGTH and low.num_preemptions == 0
    assert sched.make_stats().num_preemptions_total == 0


def test_without_aging_the_low_priority_request_starves() -> None:
    """Control for the aging test: with aging_steps=0, L never leaves the waiting queue."""
    sched, low, finished_at = _run_low_priority_under_high_priority_stream(0, 30)
    assert "L" not in finished_at and low.status is RequestStatus.WAITING
    assert sched.waiting_request_ids()[-1] == "L"
