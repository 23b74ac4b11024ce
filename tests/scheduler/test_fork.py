"""n > 1: samples forked after the prompt, sharing its blocks with copy-on-write."""

from __future__ import annotations

from scheduler import FinishReason
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


def test_samples_fork_before_the_last_prompt_token_and_copy_the_shared_block() -> None:
    """The prompt but its last token is computed once; the 3 samples fork there and each
    computes the last token, sampling its own first token. Writes into the shared partial
    block 1 are copied on write."""
    sched, kv = make_scheduler(num_blocks=8)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=6, max_tokens=3, n=3))
    s1 = step(sched, runner)
    assert prefill_view(s1.plan) == [("r0", 0, 5, [0, 1], False)]
    assert s1.outputs == []
    assert sched.running_request_ids() == ["r0", "r0#1", "r0#2"]

    s2 = step(sched, runner)
    # r0 writes position 5 into block 1 (shared by 3, holding position 4): it gets block 2, a
    # copy of 1. r0#1 then shares block 1 with r0#2 only: it gets block 3. r0#2 is the last
    # holder of block 1 and writes in place.
    assert decode_view(s2.plan) == [("r0", 5, [0, 2]), ("r0#1", 5, [0, 3]), ("r0#2", 5, [0, 1])]
    assert all(seq.token_ids == [105] for seq in s2.plan.decode)
    assert s2.plan.block_copies == [(1, 2), (1, 3)]
    assert [(o.request_id, o.parent_id, o.index, o.new_token_ids) for o in s2.outputs] == [
        ("r0", None, 0, [runner.default_token("r0", 0)]),
        ("r0#1", "r0", 1, [runner.default_token("r0#1", 0)]),
        ("r0#2", "r0", 2, [runner.default_token("r0#2", 0)]),
    ]
    steps = run_until_done(sched, runner)
    finished = [o for s in steps for o in s.outputs if o.finished]
    assert sorted((o.request_id, o.num_output_tokens) for o in finished) == [
        ("r0", 3),
        ("r0#1", 3),
        ("r0#2", 3),
    ]
    assert sched.make_stats().kv.cow_copies_total == 2
    assert_no_blocks_held(kv)


def test_children_seats_are_held_from_admission() -> None:
    """A 3-sample request holds 3 seats of 4 from its first chunk: a 1-seat request fits beside
    it, a second one waits until a sample finishes."""
    sched, kv = make_scheduler(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=4)
    runner = make_runner(kv)
    sched.add_request(make_request("p", prompt_len=6, max_tokens=3, n=3))
    sched.add_request(make_request("a", prompt_len=2, max_tokens=5, first_token=200))
    sched.add_request(make_request("b", prompt_len=2, max_tokens=5, first_token=300))
    s1 = step(sched, runner)  # p's first chunk (4 of 6 tokens), seats for its samples held
    assert [s.request_id for s in s1.plan.prefill] == ["p"]
    s2 = step(sched, runner)  # p's 5th token (then it forks), a's prompt; b has no seat
    assert prefill_view(s2.plan) == [("p", 4, 1, [0, 1], False), ("a", 0, 2, [2], True)]
    assert sched.waiting_request_ids() == ["b"]
    assert sched.num_running == 4  # p, its 2 samples, a


def test_abort_of_the_parent_aborts_its_samples() -> None:
    """abort(parent) ends every sample; theirs are reported by the next update."""
    sched, kv = make_scheduler()
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=5, max_tokens=8, n=2))
    step(sched, runner)
    step(sched, runner)
    out = sched.abort("r0")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert_no_blocks_held(kv)
    plan = sched.schedule()
    assert plan.is_empty and plan.finished_request_ids == ["r0", "r0#1"]
    outs = sched.update(plan, runner.execute(plan))
    assert [(o.request_id, o.finish_reason, o.parent_id, o.index) for o in outs] == [
        ("r0#1", FinishReason.ABORT, "r0", 1)
    ]
    assert not sched.has_unfinished_requests()


def test_a_one_token_prompt_forks_at_admission() -> None:
    """With nothing to compute before the last prompt token, the samples fork at admission
    and all compute position 0 in that same step, each into its own block."""
    sched, kv = make_scheduler(num_blocks=8)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=1, max_tokens=2, n=2))
    s1 = step(sched, runner)
    assert sched.running_request_ids() == ["r0", "r0#1"]
    assert s1.plan.prefill == [] and decode_view(s1.plan) == [("r0", 0, [0]), ("r0#1", 0, [1])]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def test_parent_preempted_before_the_fork_forks_after_its_recompute() -> None:
    """A parent preempted mid-prefill releases its samples' seats and forks once, later."""
    sched, kv = make_scheduler(
        num_blocks=16, max_num_seqs=2, queue_order="priority", max_num_batched_tokens=4
    )
    runner = make_runner(kv)
    sched.add_request(make_request("p", prompt_len=6, max_tokens=2, n=2, priority=3))
    step(sched, runner)  # p's first chunk; it holds 2 seats
    sched.add_request(make_request("hi", prompt_len=2, max_tokens=2, priority=0, first_token=300))
    sched.add_request(make_request("h2", prompt_len=2, max_tokens=2, priority=0, first_token=400))
    s2 = step(sched, runner)  # p holds both seats: hi preempts it (its chunk is dropped)
    assert [s.request_id for s in s2.plan.prefill] == ["hi", "h2"]
    assert sched.waiting_request_ids() == ["p"]
    steps = run_until_done(sched, runner)
    forked = [o.request_id for s in steps for o in s.outputs if o.parent_id == "p"]
    assert forked == ["p#1", "p#1"]
    assert sched.make_stats().num_preemptions_total == 1
    assert_no_blocks_held(kv)


def test_a_parent_ended_before_the_fork_releases_its_seats_and_sample_ids() -> None:
    """A 3-sample parent mid-prefill holds 3 seats of 3 and the ids 'p#1', 'p#2'; aborting it
    releases both: a waiting request and two new requests with those ids are admitted."""
    sched, kv = make_scheduler(num_blocks=16, max_num_seqs=3, long_prefill_token_threshold=4)
    runner = make_runner(kv)
    sched.add_request(make_request("p", prompt_len=10, max_tokens=2, n=3))
    step(sched, runner)  # p's first chunk
    sched.add_request(make_request("a", prompt_len=2, max_tokens=2, first_token=200))
    s2 = step(sched, runner)  # p's second chunk; no seat for a
    assert prefill_view(s2.plan) == [("p", 4, 4, [0, 1], False)]
    assert sched.waiting_request_ids() == ["a"]
    sched.abort("p")
    sched.add_request(make_request("p#1", prompt_len=2, max_tokens=2, first_token=300))
    sched.add_request(make_request("p#2", prompt_len=2, max_tokens=2, first_token=400))
    s3 = step(sched, runner)
    assert [s.request_id for s in s3.plan.prefill] == ["a", "p#1", "p#2"]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)
