"""KV cache strategies (``--kv-strategy``) through the scheduler, with exact block ids.

Every step runs through ``step()``: the FakeRunner checks each plan against a shadow paged KV
of token ids (a recomputed sequence must hold its tokens again), and the cache invariants are
checked after every step.
"""

from __future__ import annotations

import pytest

from cache_manager import KVCacheConfig
from scheduler import SchedulerStats
from tests.scheduler.helpers import (
    Step,
    assert_no_blocks_held,
    decode_view,
    make_request,
    make_runner,
    make_scheduler,
    prefill_view,
    run_until_done,
)


def test_disabled_recomputes_the_whole_sequence_every_step() -> None:
    """disabled: each step prefills the whole sequence from position 0 into blocks 0 and 1,
    samples one token and frees the blocks again (tail first, so the same blocks come back);
    the dropped KV is counted."""
    sched, kv = make_scheduler(num_blocks=8, kv_strategy="disabled")
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=6, max_tokens=3))
    steps = run_until_done(sched, runner)
    assert [prefill_view(s.plan) for s in steps] == [
        [("r0", 0, 6, [0, 1], True)],
        [("r0", 0, 7, [0, 1], True)],
        [("r0", 0, 8, [0, 1], True)],
    ]
    assert all(s.plan.decode == [] for s in steps)
    assert kv.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    stats = sched.make_stats().kv
    assert (stats.kv_strategy, stats.strategy_dropped_tokens_total) == ("disabled", 6 + 7)
    assert_no_blocks_held(kv)


def test_disabled_gives_the_same_tokens_as_always() -> None:
    """The FakeRunner's tokens depend on the whole sequence: both strategies emit the same
    ones. always takes 5 steps (a prefill, then decodes); disabled 7, because the 9- and
    10-token recomputations exceed the 8-token step budget and run as two chunks each."""
    tokens = {}
    num_steps = {}
    for strategy in ("always", "disabled"):
        sched, kv = make_scheduler(num_blocks=8, kv_strategy=strategy)
        runner = make_runner(kv)
        sched.add_request(make_request("r0", prompt_len=6, max_tokens=5))
        steps = run_until_done(sched, runner)
        tokens[strategy] = [t for s in steps for o in s.outputs for t in o.new_token_ids]
        num_steps[strategy] = len(steps)
    assert tokens["always"] == tokens["disabled"] and len(tokens["always"]) == 5
    assert num_steps == {"always": 5, "disabled": 7}


def test_disabled_turns_prefix_caching_off() -> None:
    """disabled keeps nothing for later requests either: no key, no hit."""
    sched, kv = make_scheduler(num_blocks=8, kv_strategy="disabled", enable_prefix_caching=True)
    runner = make_runner(kv)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, prompt_len=9, max_tokens=1))
        run_until_done(sched, runner)
    stats = sched.make_stats().kv
    assert (stats.prefix_hits_tokens_total, stats.num_blocks_cached_free) == (0, 0)


def test_long_sequence_only_recomputes_below_the_threshold() -> None:
    """Threshold 8: with 7 tokens the KV is dropped and recomputed; from 8 tokens on it is
    kept and the request decodes on blocks 0, 1, then 2."""
    sched, kv = make_scheduler(
        num_blocks=8, kv_strategy="long-sequence-only", kv_strategy_threshold=8
    )
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=6, max_tokens=5))
    steps = run_until_done(sched, runner)
    assert [prefill_view(s.plan) for s in steps[:2]] == [
        [("r0", 0, 6, [0, 1], True)],
        [("r0", 0, 7, [0, 1], True)],
    ]
    assert [decode_view(s.plan) for s in steps[2:]] == [
        [("r0", 7, [0, 1])],
        [("r0", 8, [0, 1, 2])],
        [("r0", 9, [0, 1, 2])],
    ]
    assert sched.make_stats().kv.strategy_dropped_tokens_total == 6
    assert_no_blocks_held(kv)


def _two_requests(
    strategy: str, num_blocks: int, r1_prompt: int, max_tokens: int = 10
) -> tuple[list[Step], SchedulerStats]:
    sched, kv = make_scheduler(
        num_blocks=num_blocks, kv_strategy=strategy, kv_strategy_threshold=4, max_num_seqs=2
    )
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=8, max_tokens=max_tokens))
    sched.add_request(
        make_request("r1", prompt_len=r1_prompt, max_tokens=max_tokens, first_token=200)
    )
    steps = run_until_done(sched, runner)
    assert_no_blocks_held(kv)
    return steps, sched.make_stats()


def test_adaptive_windows_the_longest_request_instead_of_preempting() -> None:
    """5 usable blocks (block 0 is the null block). When r0 needs a 4th block at position 12
    nothing is free: adaptive releases r0's blocks 1 and 2 (positions 0..7; it keeps its last
    4 tokens, in block 3), and r0 takes block 1 back. At position 16 it releases block 3 the
    same way. Nobody is preempted; ``always`` preempts r1 on the same workload."""
    steps, stats = _two_requests("adaptive", num_blocks=6, r1_prompt=4)
    decodes = [decode_view(s.plan) for s in steps]
    assert decodes[4] == [("r0", 11, [1, 2, 3]), ("r1", 6, [4, 5])]
    assert decodes[5] == [("r0", 12, [0, 0, 3, 1]), ("r1", 7, [4, 5])]
    assert decodes[6] == [("r0", 13, [0, 0, 3, 1]), ("r1", 8, [4, 5, 2])]
    assert decodes[9] == [("r0", 16, [0, 0, 0, 1, 3]), ("r1", 11, [4, 5, 2])]
    assert stats.num_preemptions_total == 0
    assert (stats.kv.kv_strategy, stats.kv.strategy_windowed_tokens_total) == ("adaptive", 12)
    _, always = _two_requests("always", num_blocks=6, r1_prompt=4)
    assert always.num_preemptions_total > 0 and always.kv.strategy_windowed_tokens_total == 0


def test_adaptive_windows_a_request_already_in_the_plan() -> None:
    """r1 (scheduled after r0 in the decode batch) needs a block at position 4; the longest
    request is r0, already planned at position 11 on [1, 2, 3]: block 1 is released, and the
    planned seq reads the new table [0, 2, 3], so no freed block is read (the FakeRunner's
    shadow KV checks every position it does read)."""
    steps, stats = _two_requests("adaptive", num_blocks=5, r1_prompt=2, max_tokens=8)
    decodes = [decode_view(s.plan) for s in steps]
    assert decodes[3] == [("r0", 10, [1, 2, 3]), ("r1", 3, [4])]
    assert decodes[4] == [("r0", 11, [0, 2, 3]), ("r1", 4, [4, 1])]
    assert decodes[5] == [("r0", 12, [0, 0, 3, 2]), ("r1", 5, [4, 1])]
    assert stats.num_preemptions_total == 0


def test_adaptive_evicts_cached_prefixes_before_windowing() -> None:
    """A finished request left blocks 1 and 2 cached. Under pressure they are handed out
    first (evicted: r1 gets 2, then 1); only when nothing is free does r0 lose its old
    blocks 3 and 4."""
    sched, kv = make_scheduler(
        num_blocks=6,
        kv_strategy="adaptive",
        kv_strategy_threshold=4,
        max_num_seqs=2,
        enable_prefix_caching=True,
    )
    runner = make_runner(kv)
    sched.add_request(make_request("p", prompt_len=8, max_tokens=1, first_token=300))
    run_until_done(sched, runner)
    assert kv.free_block_ids() == [3, 4, 5, 2, 1]
    sched.add_request(make_request("r0", prompt_len=8, max_tokens=6))
    sched.add_request(make_request("r1", prompt_len=2, max_tokens=8, first_token=200))
    steps = run_until_done(sched, runner)
    assert prefill_view(steps[1].plan) == [("r1", 0, 2, [2], True)]
    assert decode_view(steps[4].plan) == [("r0", 11, [3, 4, 5]), ("r1", 4, [2, 1])]
    assert decode_view(steps[5].plan) == [("r0", 12, [0, 0, 5, 4]), ("r1", 5, [2, 1])]
    stats = sched.make_stats()
    # Evicted: p's blocks 2 and 1, then r0's own block 4 (keyed when full, released by the
    # window, handed out again).
    assert (stats.kv.evictions_total, stats.kv.strategy_windowed_tokens_total) == (3, 8)
    assert stats.num_preemptions_total == 0
    assert_no_blocks_held(kv)


def test_strategy_config_is_validated() -> None:
    """Unknown strategies and thresholds below 1 are refused with the allowed values."""
    with pytest.raises(ValueError, match="kv_strategy must be one of"):
        KVCacheConfig(num_blocks=4, kv_strategy="sometimes")
    with pytest.raises(ValueError, match="kv_strategy_threshold must be >= 1"):
        KVCacheConfig(num_blocks=4, kv_strategy_threshold=0)
