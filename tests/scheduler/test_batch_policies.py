"""Batch formation: stall-free keeps decodes flowing; prefill-first with a starvation guard."""

from __future__ import annotations

from scheduler import SchedulerOutput
from scheduler.policies import BatchKind, PrefillFirst, StallFree
from tests.scheduler.helpers import (
    assert_no_blocks_held,
    make_request,
    make_runner,
    make_scheduler,
    prefill_view,
    run_until_done,
    step,
)

DECODE, PREFILL = BatchKind.DECODE, BatchKind.PREFILL


def _kind(plan: SchedulerOutput) -> str:
    return ("P" if plan.prefill else "") + ("D" if plan.decode else "")


def _two_decoding_then_long_prompt(policy: str, **config: object):  # type: ignore[no-untyped-def]
    sched, kv = make_scheduler(num_blocks=32, policy=policy, **config)
    runner = make_runner(kv)
    sched.add_request(make_request("d0", prompt_len=2, max_tokens=30))
    sched.add_request(make_request("d1", prompt_len=2, max_tokens=30, first_token=200))
    first = step(sched, runner)
    assert prefill_view(first.plan) == [("d0", 0, 2, [0], True), ("d1", 0, 2, [1], True)]
    sched.add_request(make_request("L", prompt_len=40, max_tokens=2, first_token=500))
    return sched, kv, runner


def test_stall_free_gives_every_decode_a_token_every_step_while_a_long_prompt_prefills() -> None:
    """Budget 8, two decodes: the 40-token prompt goes in chunks of 6 (6 x 6 + 4) while d0 and
    d1 each get one token in every one of those 7 steps."""
    sched, kv, runner = _two_decoding_then_long_prompt("stall-free")
    chunks = []
    for _ in range(7):
        s = step(sched, runner)
        assert [seq.request_id for seq in s.plan.decode] == ["d0", "d1"]
        assert {o.request_id for o in s.outputs if o.new_token_ids} >= {"d0", "d1"}
        (chunk,) = s.plan.prefill
        chunks.append((chunk.start_pos, chunk.num_tokens, chunk.do_sample))
        assert s.plan.num_scheduled_tokens <= 8
    assert chunks == [
        (0, 6, False),
        (6, 6, False),
        (12, 6, False),
        (18, 6, False),
        (24, 6, False),
        (30, 6, False),
        (36, 4, True),
    ]
    d0 = sched.get_request("d0")
    assert d0 is not None and d0.num_output_tokens == 1 + 7
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def test_long_prefill_threshold_caps_one_requests_chunk() -> None:
    """long_prefill_token_threshold=4 caps the chunk below the leftover budget of 6."""
    sched, _, runner = _two_decoding_then_long_prompt("stall-free", long_prefill_token_threshold=4)
    s = step(sched, runner)
    assert [(c.start_pos, c.num_tokens) for c in s.plan.prefill] == [(0, 4)]


def test_prefill_first_skips_decodes_at_most_max_starvation_steps_in_a_row() -> None:
    """max_decode_starvation_steps=2: prefill, prefill, decode, ... until the prompt is done
    (5 chunks of 8), then every step decodes."""
    sched, kv, runner = _two_decoding_then_long_prompt(
        "prefill-first", max_decode_starvation_steps=2
    )
    kinds = [_kind(step(sched, runner).plan) for _ in range(9)]
    assert kinds == ["P", "P", "D", "P", "P", "D", "P", "D", "D"]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def test_prefill_first_chunks_use_the_whole_budget() -> None:
    """Without decodes in the step, a prefill-first chunk takes all 8 budget tokens."""
    sched, _, runner = _two_decoding_then_long_prompt("prefill-first")
    s = step(sched, runner)
    assert prefill_view(s.plan)[0][:3] == ("L", 0, 8) and s.plan.decode == []


def test_prefill_first_decodes_when_nothing_waits() -> None:
    """With no prefill work, prefill-first runs the decode batch every step."""
    sched, kv = make_scheduler(policy="prefill-first")
    runner = make_runner(kv)
    sched.add_request(make_request("d0", prompt_len=2, max_tokens=4))
    kinds = [_kind(s.plan) for s in run_until_done(sched, runner)]
    assert kinds == ["P", "D", "D", "D"]


def test_policies_return_the_order_of_batch_kinds() -> None:
    """Stall-free: decodes, then prefill chunks, every step. Prefill-first: prefill chunks,
    else decodes; after 2 steps with decodes pending but not run, decodes only, once."""
    stall_free = StallFree()
    assert (stall_free.order(lambda: True), stall_free.exclusive) == ((DECODE, PREFILL), False)
    policy = PrefillFirst(max_starvation_steps=2)
    assert policy.exclusive
    orders = []
    for took_decodes in (False, False, True, False):
        orders.append(policy.order(lambda: True))
        policy.observe(took_decodes, lambda: True)
    assert orders == [(PREFILL, DECODE), (PREFILL, DECODE), (DECODE,), (PREFILL, DECODE)]
    policy.observe(False, lambda: False)  # nothing was pending: no starvation
    policy.observe(False, lambda: True)
    assert policy.order(lambda: True) == (PREFILL, DECODE)
