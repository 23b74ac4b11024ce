"""Exact lifecycle: chunk boundaries, batch contents, finishing by length / stop / EOS."""

from __future__ import annotations

import pytest

from scheduler import FinishReason, ModelOutput, RequestOutput, RequestStatus
from tests.scheduler.helpers import (
    EOS,
    assert_no_blocks_held,
    decode_view,
    make_request,
    make_runner,
    make_scheduler,
    prefill_view,
    run_until_done,
    step,
)


def test_long_prompt_is_chunked_at_the_step_budget() -> None:
    """A 10-token prompt under a 4-token budget runs as chunks 0-3, 4-7, 8-9, then decodes."""
    sched, kv = make_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    runner = make_runner(kv)
    req = make_request("r0", prompt_len=10, max_tokens=3)
    sched.add_request(req)

    s1 = step(sched, runner)
    assert prefill_view(s1.plan) == [("r0", 0, 4, [0], False)]
    assert s1.plan.prefill[0].token_ids == [100, 101, 102, 103]
    assert s1.plan.decode == [] and s1.outputs == []
    assert req.num_computed_tokens == 4 and req.status is RequestStatus.PREFILLING

    s2 = step(sched, runner)
    assert prefill_view(s2.plan) == [("r0", 4, 4, [0, 1], False)]
    assert s2.plan.prefill[0].token_ids == [104, 105, 106, 107]
    assert s2.outputs == []

    s3 = step(sched, runner)
    assert prefill_view(s3.plan) == [("r0", 8, 2, [0, 1, 2], True)]
    t0 = runner.default_token("r0", 0)
    assert [(o.request_id, o.new_token_ids, o.finished) for o in s3.outputs] == [
        ("r0", [t0], False)
    ]
    assert req.status is RequestStatus.DECODING and req.num_computed_tokens == 10

    s4 = step(sched, runner)
    assert s4.plan.prefill == []
    assert decode_view(s4.plan) == [("r0", 10, [0, 1, 2])]
    assert s4.plan.decode[0].token_ids == [t0]

    s5 = step(sched, runner)
    assert decode_view(s5.plan) == [("r0", 11, [0, 1, 2])]
    out = s5.out("r0")
    assert out.finished and out.finish_reason is FinishReason.LENGTH
    assert out.new_token_ids == [runner.default_token("r0", 2)]
    assert req.output_token_ids == [runner.default_token("r0", i) for i in range(3)]
    assert not sched.has_unfinished_requests()
    # Freed tail first, each keyless block to the front: the free list is back in id order.
    assert kv.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert_no_blocks_held(kv)


def test_each_step_has_exact_prefill_and_decode_batches() -> None:
    """Stall-free: decodes first, then the leftover budget prefills; exact ids and positions."""
    sched, kv = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    runner = make_runner(kv)
    r0 = make_request("r0", prompt_len=6, max_tokens=3)
    r1 = make_request("r1", prompt_len=5, max_tokens=2, first_token=200)
    sched.add_request(r0)
    sched.add_request(r1)

    s1 = step(sched, runner)
    assert prefill_view(s1.plan) == [("r0", 0, 6, [0, 1], True), ("r1", 0, 2, [2], False)]
    assert s1.plan.decode == []
    assert [o.request_id for o in s1.outputs] == ["r0"]

    s2 = step(sched, runner)
    assert decode_view(s2.plan) == [("r0", 6, [0, 1])]
    assert prefill_view(s2.plan) == [("r1", 2, 3, [2, 3], True)]
    assert s2.plan.prefill[0].token_ids == [202, 203, 204]
    assert [o.request_id for o in s2.outputs] == ["r1", "r0"]  # prefill batch first

    s3 = step(sched, runner)
    assert s3.plan.prefill == []
    assert decode_view(s3.plan) == [("r0", 7, [0, 1]), ("r1", 5, [2, 3])]
    assert [(o.request_id, o.finish_reason) for o in s3.outputs] == [
        ("r0", FinishReason.LENGTH),
        ("r1", FinishReason.LENGTH),
    ]
    final = sched.schedule()
    assert final.is_empty and final.finished_request_ids == ["r0", "r1"]
    assert_no_blocks_held(kv)


def test_scheduled_seq_carries_the_request_view() -> None:
    """A decode seq references the request's token list and reports counts before the step."""
    sched, kv = make_scheduler()
    runner = make_runner(kv)
    req = make_request("r0", prompt_len=3, max_tokens=4, temperature=0.0)
    sched.add_request(req)
    step(sched, runner)
    plan = sched.schedule()
    (seq,) = plan.decode
    assert seq.all_token_ids is req.all_token_ids
    assert (seq.num_prompt_tokens, seq.num_output_tokens) == (3, 1)
    assert seq.sampling is req.sampling and seq.eos_token_ids == (EOS,)
    assert seq.token_ids == [req.output_token_ids[0]] and seq.start_pos == 3


def test_stop_token_finishes_with_its_id() -> None:
    """A stop token id ends the request with STOP and reports the token as stop_reason."""
    sched, kv = make_scheduler()
    runner = make_runner(kv, script={"r0": [7, 9, 11]})
    req = make_request("r0", prompt_len=3, max_tokens=5, stop_token_ids=(9,))
    sched.add_request(req)
    steps = run_until_done(sched, runner)
    last = steps[-1].out("r0")
    assert (last.finish_reason, last.stop_reason, last.new_token_ids) == (FinishReason.STOP, 9, [9])
    assert req.output_token_ids == [7, 9] and req.status is RequestStatus.FINISHED_STOPPED
    assert last.num_output_tokens == 2
    assert_no_blocks_held(kv)


def test_eos_counts_only_after_min_tokens() -> None:
    """EOS before min_tokens is kept as a token; the first EOS at min_tokens stops."""
    sched, kv = make_scheduler()
    runner = make_runner(kv, script={"r0": [EOS, EOS, 5]})
    req = make_request("r0", prompt_len=3, max_tokens=5, min_tokens=2)
    sched.add_request(req)
    steps = run_until_done(sched, runner)
    assert req.output_token_ids == [EOS, EOS]
    last = steps[-1].out("r0")
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, None)


def test_ignore_eos_runs_to_max_tokens() -> None:
    """With ignore_eos, EOS tokens do not stop the request; max_tokens does (LENGTH)."""
    sched, kv = make_scheduler()
    runner = make_runner(kv, script={"r0": [EOS, EOS, EOS]})
    req = make_request("r0", prompt_len=3, max_tokens=3, ignore_eos=True)
    sched.add_request(req)
    steps = run_until_done(sched, runner)
    assert req.output_token_ids == [EOS, EOS, EOS]
    assert steps[-1].out("r0").finish_reason is FinishReason.LENGTH


def test_stop_token_before_min_tokens_is_ignored() -> None:
    """A stop token id below min_tokens does not stop; the next one at min_tokens does."""
    sched, kv = make_scheduler()
    runner = make_runner(kv, script={"r0": [9, 9, 4]})
    req = make_request("r0", prompt_len=3, max_tokens=5, min_tokens=2, stop_token_ids=(9,))
    sched.add_request(req)
    run_until_done(sched, runner)
    assert req.output_token_ids == [9, 9] and req.stop_reason == 9


def test_stop_wins_over_length_on_the_last_token() -> None:
    """A stop token that is also the max_tokens-th token reports STOP, not LENGTH."""
    sched, kv = make_scheduler()
    runner = make_runner(kv, script={"r0": [1, 9]})
    req = make_request("r0", prompt_len=3, max_tokens=2, stop_token_ids=(9,))
    sched.add_request(req)
    steps = run_until_done(sched, runner)
    assert steps[-1].out("r0").finish_reason is FinishReason.STOP


def test_finish_from_outside_frees_blocks_and_is_reported_to_the_runner() -> None:
    """finish() (a stop string) ends a decoding request; the next plan lists it as finished."""
    sched, kv = make_scheduler()
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=5, max_tokens=8))
    sched.add_request(make_request("r1", prompt_len=2, max_tokens=8, first_token=300))
    step(sched, runner)
    out = sched.finish("r0", "###")
    assert out is not None
    assert (out.finished, out.finish_reason, out.stop_reason) == (True, FinishReason.STOP, "###")
    assert out.num_output_tokens == 1
    assert sched.finish("r0", "###") is None
    plan = sched.schedule()
    assert plan.finished_request_ids == ["r0"]
    assert [s.request_id for s in plan.decode] == ["r1"]
    assert kv.block_ids("r1") == [2] and not kv.has_request("r0")


def test_runner_failure_ends_one_request_only() -> None:
    """A request in ModelOutput.failed finishes with ERROR; the rest of the batch continues."""
    sched, kv = make_scheduler()
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=3, max_tokens=3))
    sched.add_request(make_request("r1", prompt_len=3, max_tokens=3, first_token=300))
    step(sched, runner)
    runner.fail_request("r1", "bad logits")
    s2 = step(sched, runner)
    failed = s2.out("r1")
    assert (failed.finish_reason, failed.error, failed.new_token_ids) == (
        FinishReason.ERROR,
        "bad logits",
        [],
    )
    assert s2.out("r0").new_token_ids == [runner.default_token("r0", 1)]
    assert not kv.has_request("r1")
    run_until_done(sched, runner)
    assert sched.make_stats().num_finished_total == {"error": 1, "length": 1}
    assert_no_blocks_held(kv)


def test_fail_ends_a_request_in_any_state() -> None:
    """fail() ends a waiting request with ERROR and the message; unknown ids give None."""
    sched, _kv = make_scheduler()
    sched.add_request(make_request("r0"))
    out = sched.fail("r0", "tokenizer exploded")
    assert out is not None and (out.finish_reason, out.error) == (
        FinishReason.ERROR,
        "tokenizer exploded",
    )
    assert sched.fail("r0", "again") is None
    assert sched.num_waiting == 0 and not sched.has_unfinished_requests()


def test_missing_sampled_token_is_a_runner_bug() -> None:
    """A do_sample seq without a sampled token raises instead of silently stalling."""
    sched, _ = make_scheduler()
    sched.add_request(make_request("r0", prompt_len=3))
    plan = sched.schedule()
    with pytest.raises(RuntimeError, match="no token for 'r0'"):
        sched.update(plan, ModelOutput())


def test_the_hot_path_and_its_slow_branch_give_the_same_outputs() -> None:
    """update() is one loop: a result that sends every seq down the slow branch (a failure
    of an unknown id) gives outputs equal, field by field, to the plain decode path's."""
    outputs: list[list[list[RequestOutput]]] = []
    for slow in (False, True):
        sched, kv = make_scheduler(num_blocks=16, max_num_batched_tokens=16)
        runner = make_runner(kv)
        sched.add_request(make_request("a", prompt_len=5, max_tokens=6, n=2))
        sched.add_request(make_request("b", prompt_len=3, max_tokens=4, first_token=200))
        sched.add_request(make_request("c", prompt_len=2, max_tokens=9, first_token=300))
        steps = []
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            result = runner.execute(plan)
            if slow:
                result.failed["nobody"] = "not in this step"
            steps.append(sched.update(plan, result))
            kv.check_invariants()
        outputs.append(steps)
        assert_no_blocks_held(kv)
    assert outputs[0] == outputs[1]
    assert sum(len(step_outs) for step_outs in outputs[0]) == 6 + 6 + 4 + 9
