"""Preemption by recompute under memory pressure: exact victims, recomputation, reserve mode."""

from __future__ import annotations

from scheduler import RequestStatus
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


def test_victim_is_the_least_computed_among_the_lowest_priority() -> None:
    """a (prio 0) needs a block; b and c (prio 1) do not: c, with fewer computed tokens, goes."""
    sched, kv = make_scheduler(num_blocks=5, max_num_batched_tokens=32)
    runner = make_runner(kv)
    sched.add_request(make_request("a", prompt_len=8, max_tokens=2, priority=0))
    sched.add_request(make_request("b", prompt_len=5, max_tokens=4, priority=1, first_token=200))
    sched.add_request(make_request("c", prompt_len=3, max_tokens=3, priority=1, first_token=300))
    s1 = step(sched, runner)
    assert prefill_view(s1.plan) == [
        ("a", 0, 8, [0, 1], True),
        ("b", 0, 5, [2, 3], True),
        ("c", 0, 3, [4], True),
    ]
    s2 = step(sched, runner)
    # a's token at position 8 needs a third block; c's freed block 4 is it.
    assert decode_view(s2.plan) == [("a", 8, [0, 1, 4]), ("b", 5, [2, 3])]
    c = sched.get_request("c")
    assert c is not None and c.status is RequestStatus.PREEMPTED and c.num_preemptions == 1
    stats = sched.make_stats()
    assert (stats.num_preemptions_total, stats.num_recomputed_tokens_total) == (1, 3)
    assert (stats.num_preempted, stats.num_waiting_tokens) == (1, 4)
    # a finished in step 2 (max_tokens=2), freeing [4, 1, 0] tail first to the front.
    s3 = step(sched, runner)
    assert decode_view(s3.plan) == [("b", 6, [2, 3])]
    # c is recomputed: its prompt and its one output token, sampling its second token.
    assert prefill_view(s3.plan) == [("c", 0, 4, [0], True)]
    assert s3.plan.prefill[0].token_ids == [300, 301, 302, runner.default_token("c", 0)]
    assert s3.plan.prefill[0].num_output_tokens == 1
    run_until_done(sched, runner)
    # Preemption does not change what a request generates.
    assert c.output_token_ids == [runner.default_token("c", i) for i in range(3)]
    assert sched.make_stats().num_preempted == 0
    assert_no_blocks_held(kv)


def test_victim_is_the_lowest_priority_before_the_least_computed() -> None:
    """b (prio 2, more computed) is preempted before c (prio 1, less computed)."""
    sched, kv = make_scheduler(num_blocks=5, max_num_batched_tokens=32)
    runner = make_runner(kv)
    sched.add_request(make_request("a", prompt_len=8, max_tokens=2, priority=0))
    sched.add_request(make_request("b", prompt_len=5, max_tokens=4, priority=2, first_token=200))
    sched.add_request(make_request("c", prompt_len=3, max_tokens=3, priority=1, first_token=300))
    step(sched, runner)
    s2 = step(sched, runner)
    # b's blocks [2, 3] are freed tail first to the front: a takes 2.
    assert decode_view(s2.plan) == [("a", 8, [0, 1, 2]), ("c", 3, [4])]
    b = sched.get_request("b")
    assert b is not None and b.status is RequestStatus.PREEMPTED
    assert sched.make_stats().num_recomputed_tokens_total == 5


def test_requester_preempts_itself_when_it_is_the_worst() -> None:
    """A running request that is itself the victim leaves the step; others are untouched."""
    sched, kv = make_scheduler(num_blocks=3, max_num_batched_tokens=32)
    runner = make_runner(kv)
    sched.add_request(make_request("a", prompt_len=4, max_tokens=3, priority=1))
    sched.add_request(make_request("b", prompt_len=5, max_tokens=3, priority=0, first_token=200))
    step(sched, runner)  # a: [0], b: [1, 2]
    s2 = step(sched, runner)  # a's position 4 needs a block: a is the worst, so a goes
    assert decode_view(s2.plan) == [("b", 5, [1, 2])]
    a = sched.get_request("a")
    assert a is not None and a.status is RequestStatus.PREEMPTED
    run_until_done(sched, runner)
    assert a.output_token_ids == [runner.default_token("a", i) for i in range(3)]
    assert_no_blocks_held(kv)


def test_newest_and_least_computed_rules_break_ties_differently() -> None:
    """Among the priority-1 requests b (older, 3 computed) and c (newer, 5 computed), the
    'priority' rule preempts b (less work lost) and 'newest' preempts c."""
    for rule, decodes, waiting in (
        ("priority", [("a", 8, [0, 1, 2]), ("c", 5, [3, 4])], ["b"]),
        ("newest", [("a", 8, [0, 1, 3]), ("b", 3, [2])], ["c"]),
    ):
        sched, kv = make_scheduler(num_blocks=5, max_num_batched_tokens=32, preemption=rule)
        runner = make_runner(kv)
        sched.add_request(make_request("a", prompt_len=8, max_tokens=2, priority=0))
        sched.add_request(
            make_request("b", prompt_len=3, max_tokens=4, priority=1, first_token=200)
        )
        sched.add_request(
            make_request("c", prompt_len=5, max_tokens=3, priority=1, first_token=300)
        )
        step(sched, runner)  # a: [0, 1], b: [2], c: [3, 4]
        s2 = step(sched, runner)
        assert decode_view(s2.plan) == decodes, rule
        assert sched.waiting_request_ids() == waiting, rule


def test_recompute_after_preemption_reuses_the_prefix_cache() -> None:
    """A preempted request's full blocks stay cached: re-admission hits them and recomputes
    only the rest; num_cached_tokens keeps the first admission's value (0)."""
    sched, kv = make_scheduler(num_blocks=6, max_num_batched_tokens=32, enable_prefix_caching=True)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=9, max_tokens=6))
    sched.add_request(make_request("r1", prompt_len=9, max_tokens=6, first_token=200))
    for _ in range(4):  # prefill, then decodes at positions 9, 10, 11
        step(sched, runner)
    assert (kv.block_ids("r0"), kv.block_ids("r1")) == ([0, 1, 2], [3, 4, 5])
    s5 = step(sched, runner)
    # Position 12 of r0 needs a block: r1 (tie on rank and progress, later arrival) goes.
    # Its full, cached blocks are freed tail first to the back of the LRU list [5, 4, 3]; the
    # list has no empty block, so r0 evicts block 5.
    assert decode_view(s5.plan) == [("r0", 12, [0, 1, 2, 5])]
    r1 = sched.get_request("r1")
    assert r1 is not None and r1.status is RequestStatus.PREEMPTED
    # Re-admitting r1 was tried in step 5 (2 free blocks, 4 needed) and failed: a failed
    # admission counts no prefix query, so only r0's and r1's first admissions are counted.
    queried = sched.make_stats().kv.prefix_queries_tokens_total
    assert queried == 9 + 9
    s5b = step(sched, runner)
    assert decode_view(s5b.plan) == [("r0", 13, [0, 1, 2, 5])] and s5b.plan.prefill == []
    assert sched.make_stats().kv.prefix_queries_tokens_total == queried
    sched.abort("r0")  # frees 5 (unkeyed: to the front) then 2, 1, 0 (to the LRU back)
    s6 = step(sched, runner)
    # r1 (9 prompt + 4 output tokens) hits blocks 3 and 4 (tokens 0..7) and recomputes
    # 8..12 into fresh blocks: 5 (empty, at the front) and 2 (evicted from the LRU front).
    assert prefill_view(s6.plan) == [("r1", 8, 5, [3, 4, 5, 2], True)]
    assert r1.num_cached_tokens == 0
    stats = sched.make_stats()
    assert stats.num_recomputed_tokens_total == 12
    # The successful re-admission counts its 13 tokens and 8 hits; the failed one nothing.
    assert stats.kv.prefix_queries_tokens_total == 9 + 9 + 13
    assert stats.kv.prefix_hits_tokens_total == 8
    run_until_done(sched, runner)
    assert r1.output_token_ids == [runner.default_token("r1", i) for i in range(6)]
    assert_no_blocks_held(kv)


def test_reserve_mode_never_preempts() -> None:
    """Reserve mode admits r1 only when blocks for its whole length are free; optimistic mode
    admits both at once and must preempt r1 at position 8 (its blocks then hold r0's tail)."""
    for mode, expected_preemptions in (("optimistic", 1), ("reserve", 0)):
        sched, kv = make_scheduler(num_blocks=4, max_num_batched_tokens=16, memory_mode=mode)
        runner = make_runner(kv)
        sched.add_request(make_request("r0", prompt_len=7, max_tokens=8))
        sched.add_request(make_request("r1", prompt_len=7, max_tokens=8, first_token=200))
        s1 = step(sched, runner)
        if mode == "reserve":
            # 7 + 8 = 15 tokens: all four blocks are reserved for r0 up front.
            assert prefill_view(s1.plan) == [("r0", 0, 7, [0, 1, 2, 3], True)]
        else:
            assert prefill_view(s1.plan) == [("r0", 0, 7, [0, 1], True), ("r1", 0, 7, [2, 3], True)]
        steps = run_until_done(sched, runner)
        stats = sched.make_stats()
        assert stats.num_preemptions_total == expected_preemptions, mode
        # r0 takes 8 steps; r1 is (re)admitted right after it finishes, in step 9.
        first_r1 = next(
            s for s in [s1, *steps] if any(p.request_id == "r1" for p in s.plan.prefill)
        )
        assert first_r1.plan.step_id == (9 if mode == "reserve" else 1)
        assert_no_blocks_held(kv)
