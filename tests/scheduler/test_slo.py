"""The slo policy on a scripted cost model: exact chunk sizes, deferred admissions, EDF order,
late requests moved back once, no starvation, preemption only when decodes alone break the
target."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler import Request, SamplingParams
from scheduler.cost_model import StepShape
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


@dataclass
class ScriptedCost:
    """A step costs ``base + decode * seqs + prefill * tokens`` milliseconds (0 if empty)."""

    base_ms: float = 10.0
    decode_ms: float = 5.0
    prefill_ms: float = 1.0

    def predict(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        ms = (
            self.base_ms
            + self.decode_ms * shape.decode_seqs
            + self.prefill_ms * shape.prefill_tokens
        )
        return ms / 1e3


def _slo_scheduler(cost: ScriptedCost | None = None, **config: object):  # type: ignore[no-untyped-def]
    config.setdefault("num_blocks", 64)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_num_batched_tokens", 64)
    sched, kv = make_scheduler(policy="slo", cost_model=cost or ScriptedCost(), **config)
    return sched, kv, make_runner(kv)


def _request(rid: str, prompt_len: int, max_tokens: int, first: int, **kw: object) -> Request:
    arrival = float(kw.pop("arrival", 0.0))  # type: ignore[arg-type]
    ttft = kw.pop("ttft", None)
    itl = kw.pop("itl", None)
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(first, first + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_ids=(EOS,),
        arrival_time_s=arrival,
        ttft_slo_s=ttft,  # type: ignore[arg-type]
        itl_slo_s=itl,  # type: ignore[arg-type]
    )


def test_slo_needs_a_cost_model() -> None:
    """The slo policy without a step-cost model is refused at construction."""
    with pytest.raises(ValueError, match="needs a step-cost model"):
        make_scheduler(policy="slo")


def test_chunks_fill_the_itl_target_left_by_the_decodes() -> None:
    """Target 40 ms; two decodes cost 10 + 2 x 5 = 20 ms, so the 40-token prompt goes in
    chunks of 20 (1 ms each) while d0 and d1 get a token every step; with no decode running
    (the first step) nobody waits and the budget is the only limit."""
    sched, kv, runner = _slo_scheduler(itl_slo_ms=40)
    sched.add_request(make_request("d0", prompt_len=2, max_tokens=30))
    sched.add_request(make_request("d1", prompt_len=2, max_tokens=30, first_token=200))
    sched.add_request(make_request("w", prompt_len=50, max_tokens=2, first_token=300))
    first = step(sched, runner)
    # No decodes yet: 2 + 2 + 50 would be 54 ms, but nothing waits on this step.
    assert prefill_view(first.plan) == [
        ("d0", 0, 2, [0], True),
        ("d1", 0, 2, [1], True),
        ("w", 0, 50, list(range(2, 15)), True),
    ]
    sched.add_request(make_request("L", prompt_len=40, max_tokens=2, first_token=500))
    second = step(sched, runner)
    assert [s.request_id for s in second.plan.decode] == ["d0", "d1", "w"]
    # Three decodes: 25 ms; 15 ms left for L.
    assert [(s.request_id, s.start_pos, s.num_tokens) for s in second.plan.prefill] == [
        ("L", 0, 15)
    ]
    third = step(sched, runner)  # w finished: two decodes, 20 ms left
    assert [s.request_id for s in third.plan.decode] == ["d0", "d1"]
    assert [(s.start_pos, s.num_tokens, s.do_sample) for s in third.plan.prefill] == [
        (15, 20, False)
    ]
    fourth = step(sched, runner)
    assert [(s.start_pos, s.num_tokens, s.do_sample) for s in fourth.plan.prefill] == [
        (35, 5, True)
    ]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def test_admission_is_deferred_while_one_more_decode_would_break_the_target() -> None:
    """Target 28 ms: three decodes cost 25 ms, a fourth would cost 30. The waiting request is
    admitted in the step after one of the three finishes, not before."""
    sched, kv, runner = _slo_scheduler(itl_slo_ms=28)
    sched.add_request(make_request("a", prompt_len=2, max_tokens=3))
    sched.add_request(make_request("b", prompt_len=2, max_tokens=6, first_token=200))
    sched.add_request(make_request("c", prompt_len=2, max_tokens=6, first_token=300))
    step(sched, runner)
    sched.add_request(make_request("late", prompt_len=4, max_tokens=2, first_token=400))
    history = []
    while True:
        plan = step(sched, runner).plan
        if "late" in [s.request_id for s in plan.prefill]:
            break
        history.append(([s.request_id for s in plan.decode], plan.prefill))
        assert sched.waiting_request_ids() == ["late"]
    assert history == [(["a", "b", "c"], []), (["a", "b", "c"], [])]
    assert [s.request_id for s in plan.decode] == ["b", "c"]  # a ended: room for one more
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def test_waiting_requests_are_admitted_earliest_ttft_deadline_first() -> None:
    """Waiting requests are ordered and admitted by arrival + TTFT target (EDF), not arrival."""
    sched, kv, runner = _slo_scheduler(max_num_seqs=1, ttft_slo_ms=5000)
    sched.add_request(_request("A", 4, 2, 100, arrival=0.0, ttft=10.0))  # deadline 10
    sched.add_request(_request("B", 4, 2, 200, arrival=0.1, ttft=1.0))  # 1.1
    sched.add_request(_request("C", 4, 2, 300, arrival=0.2))  # default 5: 5.2
    sched.add_request(_request("D", 4, 2, 400, arrival=0.3, ttft=0.5))  # 0.8
    assert sched.waiting_request_ids() == ["D", "B", "C", "A"]
    admitted = []
    for s in run_until_done(sched, runner):
        admitted += [seq.request_id for seq in s.plan.prefill]
    assert admitted == ["D", "B", "C", "A"]
    assert_no_blocks_held(kv)


def test_a_late_request_moves_back_once_behind_those_that_can_still_make_it() -> None:
    """At t=1.2, A (deadline 1.0) is late: it moves to 1.0 + 1.0 = 2.0, behind B (1.5), ahead
    of C (2.6). At t=10 all are late: A does not move again, B moves to 2.5, and C, alone in
    the queue by then, is simply admitted."""
    sched, kv, runner = _slo_scheduler(max_num_seqs=1)
    blocker = _request("X", 4, 3, 900, arrival=0.0, ttft=0.1)
    sched.add_request(blocker)
    step(sched, runner, now_s=0.0)  # X runs; the others wait behind it
    sched.add_request(_request("A", 4, 2, 100, arrival=0.0, ttft=1.0))
    sched.add_request(_request("B", 4, 2, 200, arrival=0.5, ttft=1.0))
    sched.add_request(_request("C", 4, 2, 300, arrival=0.6, ttft=2.0))
    assert sched.waiting_request_ids() == ["A", "B", "C"]
    step(sched, runner, now_s=1.2)
    step(sched, runner, now_s=1.3)  # X is done after this step; A is still late
    assert sched.waiting_request_ids() == ["B", "A", "C"]
    admitted = []
    while sched.has_unfinished_requests():
        admitted += [s.request_id for s in step(sched, runner, now_s=10.0).plan.prefill]
    assert admitted == ["A", "B", "C"]
    assert_no_blocks_held(kv)


def test_no_starvation_under_sustained_overload() -> None:
    """Arrivals every 0.3 s, one request served per 0.5 s (one seat, 5 steps of 0.1 s): the
    queue grows without bound. A request moved back once keeps its new key, so it is always
    admitted before every request that arrived more than its TTFT target after it."""
    ttft = 1.0
    sched, kv, runner = _slo_scheduler(max_num_seqs=1, ttft_slo_ms=ttft * 1e3)
    arrivals: dict[str, float] = {}
    admitted_at: dict[str, int] = {}
    now = 0.0
    for i in range(400):
        if i < 200 and i % 3 == 0:
            rid = f"r{i // 3}"
            arrivals[rid] = now
            sched.add_request(_request(rid, 4, 4, 100 + i, arrival=now))
        for seq in step(sched, runner, now_s=now).plan.prefill:
            admitted_at.setdefault(seq.request_id, i)
        now += 0.1
    run_until_done(sched, runner)
    assert set(admitted_at) == set(arrivals)  # everyone ran
    order = sorted(admitted_at, key=admitted_at.__getitem__)
    rank = {rid: n for n, rid in enumerate(order)}
    for r, a_r in arrivals.items():
        for s, a_s in arrivals.items():
            if a_s > a_r + ttft + 1e-9:
                assert rank[r] < rank[s], (r, s)
    assert order != sorted(arrivals, key=arrivals.__getitem__)  # EDF did move late ones
    assert_no_blocks_held(kv)


def test_decodes_are_preempted_only_when_they_alone_break_the_target() -> None:
    """Target 40 ms, margin 1.25 (50 ms). Four decodes at 5 ms (30 ms) run. The machine gets
    slower (12 ms per decode: 58 ms): from the second such step on, the victim rule's choice
    (equal priority: fewest computed tokens, then the latest arrival) is preempted, leaving
    46 ms, within the margin. It is not admitted back while three decodes would make 58 ms
    again."""
    cost = ScriptedCost()
    sched, kv, runner = _slo_scheduler(cost, itl_slo_ms=40, slo_preempt_margin=1.25)
    for i, rid in enumerate(["a", "b", "c", "d"]):
        sched.add_request(make_request(rid, prompt_len=4, max_tokens=20, first_token=100 * i + 100))
    step(sched, runner)
    s = step(sched, runner)
    assert [d[0] for d in decode_view(s.plan)] == ["a", "b", "c", "d"]
    cost.decode_ms = 12.0
    s = step(sched, runner)  # one step over the margin: maybe an odd prediction
    assert [d[0] for d in decode_view(s.plan)] == ["a", "b", "c", "d"]
    s = step(sched, runner)  # the second in a row: preempt
    assert [d[0] for d in decode_view(s.plan)] == ["a", "b", "c"]
    assert sched.waiting_request_ids() == ["d"]
    assert sched.make_stats().num_preemptions_total == 1
    for _ in range(5):
        s = step(sched, runner)
        assert [d[0] for d in decode_view(s.plan)] == ["a", "b", "c"] and not s.plan.prefill
    cost.decode_ms = 5.0  # fast again: d comes back
    s = step(sched, runner)
    assert [seq.request_id for seq in s.plan.prefill] == ["d"]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def test_a_running_prefill_moves_a_block_per_step_when_decodes_fill_the_target() -> None:
    """Target 20 ms. Admitted while decodes cost 2 ms each, L's prompt is still prefilling
    when they turn out to cost 5 ms: two decodes then take all 20 ms, yet L still moves by
    one block (4 tokens) per step."""
    cost = ScriptedCost(decode_ms=2.0)
    sched, kv, runner = _slo_scheduler(cost, itl_slo_ms=20, max_num_batched_tokens=8)
    sched.add_request(make_request("d0", prompt_len=2, max_tokens=30))
    sched.add_request(make_request("d1", prompt_len=2, max_tokens=30, first_token=200))
    sched.add_request(make_request("L", prompt_len=12, max_tokens=2, first_token=500))
    s = step(sched, runner)  # no decode yet: the budget (8) is the only limit
    assert [(q.request_id, q.start_pos, q.num_tokens) for q in s.plan.prefill] == [
        ("d0", 0, 2),
        ("d1", 0, 2),
        ("L", 0, 4),
    ]
    cost.decode_ms = 5.0
    chunks = []
    for _ in range(2):
        s = step(sched, runner)
        assert [q.request_id for q in s.plan.decode] == ["d0", "d1"]
        chunks += [(q.request_id, q.start_pos, q.num_tokens, q.do_sample) for q in s.plan.prefill]
    assert chunks == [("L", 4, 4, False), ("L", 8, 4, True)]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def _prefill(plan: object) -> list[tuple[str, int, int]]:
    return [(s.request_id, s.start_pos, s.num_tokens) for s in plan.prefill]  # type: ignore[attr-defined]


def _bank(sched, runner, num_steps: int) -> float:  # type: ignore[no-untyped-def]
    """Decode-only steps 10.25 ms apart from t=0.1 (the first decode: first token out then),
    each banking target - 10.25 ms; returns the time of the next step. (The quarter ms
    keeps the banked time off the 1 ms a prompt token costs.)"""
    for i in range(num_steps):
        s = step(sched, runner, now_s=0.1 + 0.01025 * i)
        assert not s.plan.prefill
    return 0.1 + 0.01025 * num_steps


def _wave(num_banked: int, **config: object):  # type: ignore[no-untyped-def]
    """Target 40 ms; d0 (one decode: 10 + 5 = 15 ms) has run ``num_banked`` decode steps
    (``_bank``); then A, B and C (60 tokens each, TTFT 2 s) arrive. Returns the next plan."""
    config.setdefault("max_num_batched_tokens", 256)
    sched, _kv, runner = _slo_scheduler(itl_slo_ms=40, **config)
    sched.add_request(_request("d0", 2, 30, 900))
    step(sched, runner, now_s=0.0)
    now = _bank(sched, runner, num_banked)
    for i, rid in enumerate("ABC"):
        sched.add_request(_request(rid, 60, 2, 100 * i + 100, arrival=now))
    return step(sched, runner, now_s=now).plan


def test_prompts_waiting_stretch_the_step_within_the_time_the_decodes_banked() -> None:
    """Three prompts wait, one decode runs: the step may take 40 x (1 + 3/1) = 160 ms, so
    145 ms of prefill go in (A 60, B 60, C 25) instead of the 25 tokens of a 40 ms step.
    After 5 steps 10.25 ms apart d0 has banked 0.04 x 6 tokens - 0.05125 s = 189 ms, more
    than the 160 ms."""
    plan = _wave(5)
    assert [q.request_id for q in plan.decode] == ["d0"]
    assert _prefill(plan) == [("A", 0, 60), ("B", 0, 60), ("C", 0, 25)]


def test_the_stretch_stops_at_the_time_the_decodes_banked() -> None:
    """After 2 steps 10.25 ms apart d0 has banked 0.04 x 3 - 0.0205 = 99.5 ms: 84.5 ms of
    prefill (A 60, B 24). Right after its first token (nothing banked but this step's 40 ms) the
    step keeps its target: 25 tokens of A."""
    assert _prefill(_wave(2)) == [("A", 0, 60), ("B", 0, 24)]
    assert _prefill(_wave(0)) == [("A", 0, 25)]


def test_without_a_clock_or_with_max_stretch_1_the_step_keeps_its_target() -> None:
    """The same wave with slo_max_stretch 1, or without ``now_s`` (no time is banked): the
    step stays at 40 ms, 25 tokens of A."""
    assert _prefill(_wave(5, slo_max_stretch=1.0)) == [("A", 0, 25)]
    sched, _kv, runner = _slo_scheduler(itl_slo_ms=40, max_num_batched_tokens=256)
    sched.add_request(_request("d0", 2, 30, 900))
    for _ in range(6):
        step(sched, runner)
    for i, rid in enumerate("ABC"):
        sched.add_request(_request(rid, 60, 2, 100 * i + 100))
    assert _prefill(step(sched, runner).plan) == [("A", 0, 25)]


def test_seven_decodes_and_one_prompt_stretch_by_one_seventh() -> None:
    """Target 50 ms; seven decodes cost 45 ms and one prompt waits: the step may take
    50 x (1 + 1/7) = 57.1 ms, so P gets 12 tokens (5 at the plain target)."""
    for max_stretch, chunk in ((8.0, 12), (1.0, 5)):
        sched, _kv, runner = _slo_scheduler(
            itl_slo_ms=50, max_num_batched_tokens=256, slo_max_stretch=max_stretch
        )
        for i in range(7):
            sched.add_request(_request(f"d{i}", 2, 30, 100 * i + 100))
        step(sched, runner, now_s=0.0)
        now = _bank(sched, runner, 2)
        sched.add_request(_request("P", 20, 2, 900, arrival=now))
        s = step(sched, runner, now_s=now)
        assert len(s.plan.decode) == 7
        assert _prefill(s.plan) == [("P", 0, chunk)]


def test_a_head_that_cannot_make_its_ttft_even_alone_moves_behind_one_that_can() -> None:
    """Admission by predicted TTFT: at t=0 'big' (200 tokens, deadline 0.15 s) is not late
    yet, but alone it takes 210 ms: it moves back (to 0.3) behind 'small' (deadline 0.25),
    which is admitted first. (Plain EDF would admit big first, and both would be late.)"""
    sched, kv, runner = _slo_scheduler(max_num_seqs=1)
    sched.add_request(_request("big", 200, 2, 100, arrival=0.0, ttft=0.15))
    sched.add_request(_request("small", 4, 2, 900, arrival=0.0, ttft=0.25))
    assert sched.waiting_request_ids() == ["big", "small"]
    assert _prefill(step(sched, runner, now_s=0.0).plan) == [("small", 0, 4)]
    assert sched.waiting_request_ids() == ["big"]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)


def _doc_then_short(doc_ttft_s: float, short_len: int):  # type: ignore[no-untyped-def]
    """Target 40 ms, no stretch. t=0: d0 and 'doc' (200 tokens) arrive; the first step (no
    decode: the budget, 32 tokens, is the limit) prefills d0 and 30 tokens of doc. t=0.1:
    'S' arrives (TTFT 0.3 s) beside d0's decode (15 ms). Returns the plan at t=0.1."""
    sched, kv, runner = _slo_scheduler(
        itl_slo_ms=40, max_num_batched_tokens=32, num_blocks=128, slo_max_stretch=1.0
    )
    sched.add_request(_request("d0", 2, 30, 900, ttft=0.1))  # deadline first
    sched.add_request(_request("doc", 200, 2, 100, arrival=0.0, ttft=doc_ttft_s))
    assert _prefill(step(sched, runner, now_s=0.0).plan) == [("d0", 0, 2), ("doc", 0, 30)]
    sched.add_request(_request("S", short_len, 2, 600, arrival=0.1, ttft=0.3))
    plan = step(sched, runner, now_s=0.1).plan
    assert [q.request_id for q in plan.decode] == ["d0"]
    run_until_done(sched, runner)
    assert_no_blocks_held(kv)
    return plan


def test_a_running_prefill_that_can_still_make_its_ttft_keeps_its_turn() -> None:
    """doc (deadline 0.5 s) can still make it (its 170 tokens alone: 180 ms, done at 0.28 s):
    running prefills go first, so it takes the 25 tokens the target leaves and S waits."""
    assert _prefill(_doc_then_short(0.5, 10)) == [("doc", 30, 25)]


def test_a_running_prefill_that_cannot_make_its_ttft_yields_to_one_that_can() -> None:
    """doc's deadline is 0.2 s: alone, its 170 tokens would end at 0.28 s, so it is lost and
    goes after the admissions: S (10 tokens, deadline 0.4 s) is prefilled first, doc gets
    the 15 ms left. When S takes the whole target (25 tokens), doc still moves by a block."""
    assert _prefill(_doc_then_short(0.2, 10)) == [("S", 0, 10), ("doc", 30, 15)]
    assert _prefill(_doc_then_short(0.2, 25)) == [("S", 0, 25), ("doc", 30, 4)]
