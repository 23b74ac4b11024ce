"""park() / unpark(): a parked request keeps its blocks and its place but is not scheduled."""

from __future__ import annotations

from scheduler import FinishReason
from tests.scheduler.helpers import (
    assert_no_blocks_held,
    decode_view,
    make_request,
    make_runner,
    make_scheduler,
    prefill_view,
    step,
)


def test_a_parked_decode_is_skipped_keeps_its_blocks_and_resumes_exactly() -> None:
    """r0 and r1 decode; parked, r0 is left out of the decode batch (r1 goes on) with its
    block table unchanged; unparked, it decodes again where it stopped and finishes with its
    scripted tokens."""
    sched, kv = make_scheduler(num_blocks=8)
    runner = make_runner(kv, script={"r0": [50, 51, 52, 53], "r1": [60, 61, 62, 63]})
    sched.add_request(make_request("r0", prompt_len=3, max_tokens=4))
    sched.add_request(make_request("r1", prompt_len=3, max_tokens=4, first_token=200))
    step(sched, runner)  # both prefill and sample their first token
    assert sched.park("r0") is True and sched.park("nobody") is False
    blocks = kv.block_ids("r0")
    parked = [step(sched, runner) for _ in range(2)]
    assert [[v[:2] for v in decode_view(s.plan)] for s in parked] == [[("r1", 3)], [("r1", 4)]]
    assert kv.block_ids("r0") == blocks and sched.make_stats().num_parked == 1
    sched.unpark("r0")
    resumed = step(sched, runner)
    assert decode_view(resumed.plan)[0] == ("r0", 3, blocks)
    outs = [resumed, *(step(sched, runner) for _ in range(2))]
    tokens = [t for s in outs for o in s.outputs if o.request_id == "r0" for t in o.new_token_ids]
    assert tokens == [51, 52, 53] and sched.make_stats().num_parked == 0
    assert_no_blocks_held(kv)


def test_a_parked_prefill_waits_and_abort_frees_a_parked_request_once() -> None:
    """A request parked between two prefill chunks gets no chunk while parked; aborting it
    parked frees its blocks once and clears it from the parked count."""
    sched, kv = make_scheduler(num_blocks=8, max_num_batched_tokens=4)
    runner = make_runner(kv)
    sched.add_request(make_request("r0", prompt_len=10))
    first = step(sched, runner)
    assert prefill_view(first.plan)[0][:3] == ("r0", 0, 4)
    sched.park("r0")
    assert step(sched, runner).plan.is_empty
    out = sched.abort("r0")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert sched.make_stats().num_parked == 0 and sched.abort("r0") is None
    assert_no_blocks_held(kv)
