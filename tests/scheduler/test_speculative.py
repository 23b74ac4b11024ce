"""Speculative decoding in the scheduler: the n-gram drafter, drafts in the plan and the
budget, acceptance, rollback, and runs with drafts equal runs without them."""

from __future__ import annotations

import random

import pytest

from scheduler import RequestOutput
from scheduler.spec import NgramDrafter
from tests.scheduler.helpers import (
    EOS,
    assert_no_blocks_held,
    make_request,
    make_runner,
    make_scheduler,
    run_until_done,
    step,
)

SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "ngram_max": 3, "ngram_min": 2}

# -- the drafter ---------------------------------------------------------------------------


def test_drafter_takes_the_longest_then_latest_match() -> None:
    """The last 3 tokens (7 8 9) occur once earlier: their continuation is drafted, even
    though the last 2 (8 9) occur later too. Without a 3-gram the latest 2-gram wins."""
    drafter = NgramDrafter(num_speculative_tokens=3, ngram_max=3, ngram_min=1)
    assert drafter.propose([7, 8, 9, 1, 2, 3, 8, 9, 4, 5, 7, 8, 9]) == [1, 2, 3]
    assert drafter.propose([8, 9, 1, 2, 8, 9, 4, 5, 6, 8, 9]) == [4, 5, 6]


def test_drafter_limits_and_misses() -> None:
    """At most ``max_num_tokens`` (and k) tokens; nothing without a match of ngram_min
    tokens; a continuation stops at the end of the known tokens."""
    drafter = NgramDrafter(num_speculative_tokens=4, ngram_max=2, ngram_min=2)
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert drafter.propose(tokens) == [3, 4, 5, 6]
    assert drafter.propose(tokens, max_num_tokens=2) == [3, 4]
    assert drafter.propose(tokens, max_num_tokens=0) == []
    assert drafter.propose([1, 2, 3, 4, 5, 9, 2]) == []  # only the 1-gram "2" recurs
    assert drafter.propose([5, 6, 5, 6]) == [5, 6]  # the match ends right before the suffix
    assert drafter.propose([4]) == []
    with pytest.raises(ValueError, match="ngram_min"):
        NgramDrafter(4, ngram_max=2, ngram_min=3)


# -- the scheduler -------------------------------------------------------------------------


def test_drafts_are_planned_verified_and_rolled_back() -> None:
    """Prompt 5..12, output script 5 6 7 42: at the second decode the last two tokens (5 6)
    match the prompt, so 7 8 9 10 are drafted at positions 10..13 (block 3 taken); 7 is
    accepted, 8 rejected (42 sampled instead), and block 3 goes back to the free list."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8, **SPEC)
    runner = make_runner(kv, script={"r0": [5, 6, 7, 42, 11, 12, 77, 78]})
    sched.add_request(make_request("r0", prompt=list(range(5, 13)), max_tokens=8))
    steps = [step(sched, runner) for _ in range(3)]
    assert [s.out("r0").new_token_ids for s in steps] == [[5], [6], [7, 42]]
    verify = steps[2].plan.decode[0]
    assert (verify.start_pos, verify.token_ids, verify.num_draft_tokens) == (9, [6, 7, 8, 9, 10], 4)
    assert verify.block_ids == [0, 1, 2, 3]
    assert steps[2].plan.num_scheduled_tokens == 5
    assert steps[2].result.num_accepted_drafts == {"r0": 1}
    assert kv.block_ids("r0") == [0, 1, 2]
    assert kv.free_block_ids() == [3, 4, 5, 6, 7]
    req = sched.get_request("r0")
    assert req is not None and req.num_computed_tokens == 11
    # 7 42 and 42 11 occur nowhere before: plain decodes. Then 11 12 matches the prompt
    # again, but max_tokens leaves room for one draft only (5, rejected: 77 is sampled).
    rest = run_until_done(sched, runner)
    assert [s.plan.decode[0].token_ids for s in rest] == [[42], [11], [12, 5], [77]]
    assert [s.out("r0").new_token_ids for s in rest] == [[11], [12], [77], [78]]
    assert rest[-1].out("r0").finished
    stats = sched.make_stats()
    assert (stats.num_spec_draft_tokens_total, stats.num_spec_accepted_tokens_total) == (5, 1)
    assert stats.num_generation_tokens_total == 8
    assert_no_blocks_held(kv)


def test_drafts_count_in_the_step_budget() -> None:
    """Budget 7: at step 4, a takes 1 + 4 drafts and b, whose drafter has more to offer,
    gets the 2 tokens left: 1 + 1 draft. No plan exceeds the budget."""
    sched, kv = make_scheduler(
        num_blocks=16, block_size=4, max_num_batched_tokens=7, max_num_seqs=2, **SPEC
    )
    runner = make_runner(kv, script={"a": list(range(5, 13)), "b": [5, 6, 12, 5, 6, 12, 5, 6]})
    sched.add_request(make_request("a", prompt=list(range(5, 13)), max_tokens=8))
    sched.add_request(make_request("b", prompt=[12, 5, 6, 12], max_tokens=8))
    plans = [step(sched, runner).plan for _ in range(3)]
    b = sched.get_request("b")
    assert b is not None
    assert len(NgramDrafter(4, 3, 2).propose(b.all_token_ids)) > 1
    plans.append(step(sched, runner).plan)
    assert [(s.request_id, s.num_draft_tokens) for s in plans[3].decode] == [("a", 4), ("b", 1)]
    assert [p.num_scheduled_tokens for p in plans] == [7, 5, 5, 7]


def test_drafts_never_preempt() -> None:
    """With no free block left and drafts that would need one, the decode runs without
    drafts (its one token fits its last block) rather than preempting the other request."""
    sched, kv = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16, **SPEC)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 5]
    runner = make_runner(kv, script={"a": [6, 7, 8, 9, 10], "b": [1]})
    sched.add_request(make_request("a", prompt=prompt, max_tokens=5))
    sched.add_request(make_request("b", prompt=[40, 41, 42, 43, 44], max_tokens=5))
    step(sched, runner)  # both prefilled: a in 3 blocks, b in 2; none free
    assert kv.num_free_blocks == 0
    s = step(sched, runner)  # a: "5 6" matches; drafts 7 8 9 at positions 10..12: block 3
    assert [(q.request_id, q.num_draft_tokens) for q in s.plan.decode] == [("a", 0), ("b", 0)]
    assert sched.make_stats().num_preemptions_total == 0


def test_a_stop_token_among_accepted_drafts_ends_the_request_there() -> None:
    """Drafts 7 EOS 9 are all what the model samples: the request stops at EOS, the token
    after it is never reported, and its blocks are freed."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8, **SPEC)
    prompt = [5, 6, 7, EOS, 9, 10, 11, 12]
    runner = make_runner(kv, script={"r0": [5, 6, 7, EOS, 9, 10]})
    sched.add_request(make_request("r0", prompt=prompt, max_tokens=8))
    steps = run_until_done(sched, runner)
    assert [s.out("r0").new_token_ids for s in steps] == [[5], [6], [7, EOS]]
    assert steps[-1].plan.decode[0].token_ids == [6, 7, EOS, 9, 10]
    assert steps[-1].out("r0").finished
    assert sched.make_stats().num_generation_tokens_total == 4
    assert_no_blocks_held(kv)


def run_workload(speculative: str, seed: int) -> tuple[dict[str, list[int]], set[str], object]:
    """A seeded random workload on a small pool (preemption) with prefix sharing and
    aborts; each request's script copies its prompt with a few changes, so drafts are
    partly accepted. Aborts fire once a request has reported ``after`` tokens."""
    rng = random.Random(seed)
    sched, kv = make_scheduler(
        num_blocks=14,
        block_size=4,
        enable_prefix_caching=True,
        max_num_batched_tokens=12,
        max_num_seqs=4,
        long_prefill_token_threshold=8,
        **({**SPEC, "speculative": speculative}),
    )
    runner = make_runner(kv)
    shared = [rng.randrange(10, 20) for _ in range(8)]
    arrivals: list[tuple[int, str, list[int]]] = []
    abort_after: dict[str, int] = {}
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(10, 20) for _ in range(12)]
        script = [t if rng.random() < 0.8 else rng.randrange(20, 30) for t in prompt]
        rid = f"r{i}"
        runner.set_script(rid, script[rng.randrange(0, 4) :])
        arrivals.append((rng.randrange(0, 20), rid, prompt))
        if i % 4 == 1:
            abort_after[rid] = rng.randrange(1, 8)
    tokens: dict[str, list[int]] = {rid: [] for _, rid, _ in arrivals}
    aborted: set[str] = set()
    step_id = 0
    while step_id < 20 or sched.has_unfinished_requests():
        for at, rid, prompt in arrivals:
            if at == step_id:
                sched.add_request(make_request(rid, prompt=prompt, max_tokens=16))
        outputs: list[RequestOutput] = step(sched, runner).outputs
        for out in outputs:
            tokens[out.request_id] += out.new_token_ids
            limit = abort_after.get(out.request_id)
            if limit is not None and not out.finished and len(tokens[out.request_id]) >= limit:
                assert sched.abort(out.request_id) is not None
                aborted.add(out.request_id)
        step_id += 1
        assert step_id < 1000
    assert_no_blocks_held(kv)
    return tokens, aborted, sched.make_stats()


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_with_drafts_equals_without(seed: int) -> None:
    """Same workload, speculation off and on: every request that ran to its end has the
    same tokens; an aborted one (aborted after a number of tokens, which a verify step may
    overshoot) has consistent tokens. The run preempted, hit the prefix cache, accepted and
    rejected drafts; the shadow KV and the invariants were checked after every step."""
    off, aborted_off, _ = run_workload("off", seed)
    on, aborted_on, stats = run_workload("ngram", seed)
    assert aborted_on == aborted_off
    for rid, tokens in off.items():
        if rid in aborted_off:
            n = min(len(tokens), len(on[rid]))
            assert on[rid][:n] == tokens[:n], rid
        else:
            assert on[rid] == tokens, rid
    assert stats.num_preemptions_total > 0  # type: ignore[attr-defined]
    assert stats.kv.prefix_hits_tokens_total > 0  # type: ignore[attr-defined]
    accepted = stats.num_spec_accepted_tokens_total  # type: ignore[attr-defined]
    assert 0 < accepted < stats.num_spec_draft_tokens_total  # type: ignore[attr-defined]
