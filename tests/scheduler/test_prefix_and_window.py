"""Prefix-cache hits at admission, and sliding-window release of dead blocks."""

from __future__ import annotations

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


def test_admission_starts_after_the_cached_prefix_and_records_it() -> None:
    """r1 shares r0's first 8 tokens: it starts at position 8 on r0's cached blocks 0 and 1,
    and reports num_cached_tokens=8."""
    sched, kv = make_scheduler(num_blocks=8, enable_prefix_caching=True)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=10, max_tokens=2))
    run_until_done(sched, runner)
    # r0 computed 11 tokens: blocks 0 and 1 are full and cached; block 2 went keyless.
    r1 = make_request("r1", prompt=[*range(100, 108), 7, 7], max_tokens=2)
    sched.add_request(r1)
    s = step(sched, runner)
    assert prefill_view(s.plan) == [("r1", 8, 2, [0, 1, 2], True)]
    assert s.plan.prefill[0].token_ids == [7, 7]
    assert r1.num_cached_tokens == 8 and s.out("r1").num_cached_tokens == 8
    kv_stats = sched.make_stats().kv
    assert (kv_stats.prefix_queries_tokens_total, kv_stats.prefix_hits_tokens_total) == (20, 8)
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def test_cache_salt_isolates_prefixes() -> None:
    """The same prompt with another cache_salt gets no hit."""
    sched, kv = make_scheduler(num_blocks=8, enable_prefix_caching=True)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=10, max_tokens=2))
    run_until_done(sched, runner)
    r1 = make_request("r1", prompt_len=10, max_tokens=2)
    r1.cache_salt = "tenant-b"
    sched.add_request(r1)
    s = step(sched, runner)
    assert prefill_view(s.plan)[0][1:3] == (0, 8) and r1.num_cached_tokens == 0


def test_sliding_window_releases_blocks_out_of_the_window() -> None:
    """Window 8, blocks of 4, null block 0: once 12 tokens are computed block 1 (positions
    0..3) is dead and its table entry points at block 0; the freed block is reused next."""
    sched, kv = make_scheduler(num_blocks=8, sliding_window=8)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=4, max_tokens=20))
    s1 = step(sched, runner)
    assert prefill_view(s1.plan) == [("r0", 0, 4, [1], True)]
    plans = {p: step(sched, runner).plan for p in range(4, 17)}  # decode of position p
    assert decode_view(plans[4]) == [("r0", 4, [1, 2])]
    assert decode_view(plans[11]) == [("r0", 11, [1, 2, 3])]
    assert decode_view(plans[12]) == [("r0", 12, [0, 2, 3, 1])]
    assert decode_view(plans[16]) == [("r0", 16, [0, 0, 3, 1, 2])]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)
