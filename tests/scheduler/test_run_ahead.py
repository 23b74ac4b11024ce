"""Scheduling one step ahead: step N+1 is planned (and computed) before step N's result is
applied, as the engine does when it overlaps. Placeholders, max_tokens, stale results after a
preemption or an end, prefix keys, n > 1, the synchronous fallback; and random workloads that
give every request the tokens the synchronous loop gives it, invariants checked throughout."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings

from model_runner.fake import FakeRunner
from scheduler import ModelOutput, RequestOutput, Scheduler, SchedulerOutput
from scheduler.cost_model import StepShape
from scheduler.output import PLACEHOLDER_TOKEN_ID
from scheduler.request import Constraint, FinishReason
from tests.scheduler.helpers import (
    EOS,
    assert_no_blocks_held,
    make_request,
    make_runner,
    make_scheduler,
)
from tests.scheduler.test_random_workload import (
    STOP_TOKEN,
    Add,
    Harness,
    configs,
    ops,
)


class Ahead:
    """Drives a scheduler one step ahead: ``step`` plans and computes N+1, then applies N
    (a plan that cannot run ahead is applied at once). Invariants after every call."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.in_flight: tuple[SchedulerOutput, ModelOutput] | None = None
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.reasons: dict[str, FinishReason | None] = {}
        self.plans: list[SchedulerOutput] = []

    def record(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            self.tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.request_id not in self.reasons, f"{out.request_id} ended twice"
                self.reasons[out.request_id] = out.finish_reason
        return outputs

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.plans.append(plan)
        result = self.runner.execute(plan)  # on the "device", before N is applied
        self.scheduler.check_invariants()
        outputs = self.apply()
        self.in_flight = (plan, result)
        if plan.is_empty or not plan.can_run_ahead:
            outputs += self.apply()
        return outputs

    def apply(self) -> list[RequestOutput]:
        if self.in_flight is None:
            return []
        plan, result = self.in_flight
        self.in_flight = None
        outputs = self.record(self.scheduler.update(plan, result))
        self.scheduler.check_invariants()
        return outputs

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests() and self.in_flight is None:
                return
            self.step()
        raise AssertionError("did not finish")


def test_a_decode_planned_ahead_reads_a_placeholder() -> None:
    """While the prefill that samples token 0 is in flight, the next plan decodes a
    placeholder at the position after the prompt, as output token 1, with a slot for it."""
    scheduler, kv = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=5))
    ahead = Ahead(scheduler, make_runner(kv))
    ahead.step()  # prefill, in flight
    assert len(ahead.plans[0].prefill) == 1
    ahead.step()
    [decode] = ahead.plans[1].decode
    assert (decode.token_ids, decode.start_pos, decode.num_output_tokens) == (
        [PLACEHOLDER_TOKEN_ID],
        4,
        1,
    )
    assert decode.do_sample and decode.has_placeholder
    assert len(decode.block_ids) == 2  # position 4 opens the second block
    assert ahead.tokens["a"] == [ahead.runner.default_token("a", 0)]  # only N applied
    ahead.run()
    assert ahead.tokens["a"] == [ahead.runner.default_token("a", i) for i in range(5)]
    assert_no_blocks_held(kv)


def test_no_plan_goes_past_max_tokens() -> None:
    """A request whose last token is in flight is not planned again: max_tokens=2 gives
    exactly one prefill and one decode, and no step computes in vain."""
    scheduler, kv = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=3, max_tokens=2))
    ahead = Ahead(scheduler, make_runner(kv))
    ahead.run()
    assert [(len(p.prefill), len(p.decode)) for p in ahead.plans if not p.is_empty] == [
        (1, 0),
        (0, 1),
    ]
    assert ahead.reasons["a"] is FinishReason.LENGTH and len(ahead.tokens["a"]) == 2
    assert_no_blocks_held(kv)


def test_a_request_ended_at_n_has_its_extra_step_dropped() -> None:
    """EOS at output token 1: the decode planned ahead for token 2 runs and is thrown away;
    the request reports EOS as its last token, once, and its blocks are freed once."""
    scheduler, kv = make_scheduler(num_blocks=8, block_size=4)
    scheduler.add_request(make_request("a", prompt_len=4, max_tokens=8))
    runner = make_runner(kv, script={"a": [7, EOS]})
    ahead = Ahead(scheduler, runner)
    ahead.run()
    assert ahead.tokens["a"] == [7, EOS] and ahead.reasons["a"] is FinishReason.STOP
    assert sum(s.request_id == "a" for p in ahead.plans for s in p.decode) == 2  # 1 thrown away
    assert sum(not p.is_empty for p in ahead.plans) == 3  # prefill, 2 decodes
    assert_no_blocks_held(kv)


def test_an_abort_while_a_step_is_in_flight_drops_its_result() -> None:
    """Aborted between steps while its decode is in flight: that decode's token never shows,
    its blocks are freed once, and the other request runs on unchanged."""
    scheduler, kv = make_scheduler(num_blocks=8, block_size=4)
    for rid in "ab":
        scheduler.add_request(make_request(rid, prompt_len=3, max_tokens=6))
    ahead = Ahead(scheduler, make_runner(kv))
    for _ in range(3):
        ahead.step()
    num_before = len(ahead.tokens["a"])
    out = scheduler.abort("a")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    scheduler.check_invariants()
    ahead.run()
    assert len(ahead.tokens["a"]) == num_before
    assert ahead.tokens["b"] == [ahead.runner.default_token("b", i) for i in range(6)]
    assert_no_blocks_held(kv)


def test_a_request_preempted_with_a_step_in_flight_recomputes_the_same_tokens() -> None:
    """A pool too small for both: the victim is preempted while its decode is in flight; that
    result is dropped (stale), it is prefilled again later, and both requests get the tokens
    the runner's rule gives them, with no step reading a wrong block (shadow KV)."""
    scheduler, kv = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=16)
    for rid in "ab":
        scheduler.add_request(make_request(rid, prompt_len=6, max_tokens=8, first_token=10))
    ahead = Ahead(scheduler, make_runner(kv))
    ahead.run()
    assert scheduler.make_stats().num_preemptions_total > 0
    for rid in "ab":
        assert ahead.tokens[rid] == [ahead.runner.default_token(rid, i) for i in range(8)]
    assert_no_blocks_held(kv)


def test_prefix_keys_cover_applied_tokens_only() -> None:
    """With prefix caching, a block is keyed only once the step that completes it is applied:
    while the token that fills block 1 is a placeholder, a lookup of the same tokens hits
    block 0 only."""
    scheduler, kv = make_scheduler(num_blocks=8, block_size=4, enable_prefix_caching=True)
    scheduler.add_request(make_request("a", prompt_len=7, max_tokens=4))
    runner = make_runner(kv, script={"a": [50, 51, 52, 53]})
    ahead = Ahead(scheduler, runner)
    ahead.step()  # prefill of 7 samples token 50 (position 7): in flight
    ahead.step()  # decode of the placeholder at position 7 planned; the prefill applied
    probe = make_request("p", prompt=[*range(100, 107), 50, 99])
    assert kv.get_computed_blocks(probe).num_tokens == 4
    ahead.step()  # position 7 computed and applied: block 1 is full and keyed
    assert kv.get_computed_blocks(probe).num_tokens == 8
    ahead.run()
    assert_no_blocks_held(kv)


def test_samples_fork_once_their_parent_step_is_applied() -> None:
    """n = 3: no sample is planned while the parent's fork-point chunk is in flight; then
    each runs ahead on its own, and all three get their own tokens."""
    scheduler, kv = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=4)
    scheduler.add_request(make_request("a", prompt_len=6, max_tokens=4, n=3))
    ahead = Ahead(scheduler, make_runner(kv))
    ahead.run()
    for rid in ("a", "a#1", "a#2"):
        assert ahead.tokens[rid] == [ahead.runner.default_token(rid, i) for i in range(4)], rid
    assert_no_blocks_held(kv)


def test_drafts_and_constraints_fall_back_to_a_synchronous_step() -> None:
    """A plan with drafts, or with a constrained seq that samples, cannot run ahead; plain
    decodes and penalties can."""
    scheduler, kv = make_scheduler(num_blocks=16, speculative="ngram", ngram_min=1)
    scheduler.add_request(make_request("s", prompt=[5, 6, 5, 6, 5], max_tokens=6))
    scheduler.add_request(
        make_request("c", prompt_len=3, constraint=Constraint("regex", "a+"), max_tokens=2)
    )
    runner = make_runner(kv, script={"s": [6, 5, 6, 5, 6, 5]})
    seen = Ahead(scheduler, runner)
    seen.run()
    with_drafts = [p for p in seen.plans if p.num_draft_tokens]
    assert with_drafts and not any(p.can_run_ahead for p in with_drafts)
    assert not any(
        p.can_run_ahead for p in seen.plans if any(s.request_id == "c" for s in p.decode)
    )
    assert SchedulerOutput.make_empty().can_run_ahead
    assert_no_blocks_held(kv)


class _Recording(Harness):
    """The random-workload harness, also keeping every request's tokens, its end, what it
    asked for, and which requests were ended or failed from outside."""

    def __init__(self, cfg: dict[str, object]) -> None:
        super().__init__(cfg)
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.reasons: dict[str, FinishReason | None] = {}
        self.asked: dict[str, Add] = {}
        self.touched: set[str] = set()  # aborted, finished or failed from outside

    def add(self, op: Add) -> None:
        num_before = len(self.ids)
        super().add(op)
        if len(self.ids) > num_before:
            self.asked[self.ids[-1]] = op

    def record(self, outputs: list[RequestOutput]) -> None:
        super().record(outputs)
        for out in outputs:
            self.tokens[out.request_id] += out.new_token_ids
            if out.finished:
                self.reasons[out.request_id] = out.finish_reason

    def pick(self, k: int) -> str | None:
        rid = super().pick(k)  # only aborts, stop strings and runner failures pick
        if rid is not None:
            self.touched.add(rid)
        return rid

    def check_outputs(self) -> None:
        """Every request's tokens follow the runner's rule; one nothing ended from outside
        ends exactly where its rule, min_tokens, stop ids and max_tokens say."""
        for rid, tokens in self.tokens.items():
            assert tokens == _expected(self.runner, rid, len(tokens)), rid
        for rid, reason in self.reasons.items():
            parent = rid.split("#")[0]
            if parent in self.touched:
                continue  # ended from outside: how far it got depends on when
            assert (self.tokens[rid], reason) == _natural(self.runner, rid, self.asked[parent])


class _AheadHarness(_Recording):
    """The same workload, one step ahead (``Ahead``'s order), with the scheduler's own
    in-flight invariants after every schedule and update."""

    def __init__(self, cfg: dict[str, object]) -> None:
        super().__init__(cfg)
        self.in_flight: tuple[SchedulerOutput, ModelOutput] | None = None

    def step(self) -> SchedulerOutput:
        sched = self.sched
        plan = sched.schedule(self.now_s)
        shape = StepShape.of_plan(plan)
        self.cost.observe(shape, 1e-3 + 3e-4 * shape.prefill_tokens + 6e-4 * shape.decode_seqs)
        self.now_s += 0.05
        assert plan.num_scheduled_tokens <= self.config.max_num_batched_tokens
        assert sched.num_running <= self.config.max_num_seqs
        result = self.runner.execute(plan)  # before the step in flight is applied
        sched.check_invariants()
        self.apply()
        self.in_flight = (plan, result)
        if plan.is_empty or not plan.can_run_ahead:
            self.apply()
        return plan

    def apply(self) -> None:
        if self.in_flight is not None:
            plan, result = self.in_flight
            self.in_flight = None
            self.record(self.sched.update(plan, result))
            self.sched.check_invariants()

    def run(self, operations: list[object]) -> None:
        super().run(operations)
        self.apply()  # the last step in flight holds only requests that ended: stale
        assert_no_blocks_held(self.kv)


def _expected(runner: FakeRunner, rid: str, n: int) -> list[int]:
    script = runner.script.get(rid, [])
    return [script[i] if i < len(script) else runner.default_token(rid, i) for i in range(n)]


def _natural(runner: FakeRunner, rid: str, asked: Add) -> tuple[list[int], FinishReason]:
    """The tokens and end of a request left alone: its rule's tokens up to the first stop
    (EOS unless ignore_eos, or the stop token) once min_tokens are out, else max_tokens."""
    tokens = _expected(runner, rid, asked.max_tokens)
    min_tokens = min(asked.min_tokens, asked.max_tokens)
    for i, token in enumerate(tokens):
        if i + 1 >= min_tokens and (token == STOP_TOKEN or (token == EOS and not asked.ignore_eos)):
            return tokens[: i + 1], FinishReason.STOP
    return tokens, FinishReason.LENGTH


@settings(
    max_examples=200,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cfg=configs, operations=ops)
def test_random_workloads_run_ahead_give_the_synchronous_tokens(
    cfg: dict[str, object], operations: list[object]
) -> None:
    """Random workloads (preemption, prefix hits, windows, n > 1, drafts, aborts, stop
    strings, runner failures), synchronous and one step ahead: every invariant holds after
    every schedule and update, no block leaks, every request ends exactly once, its tokens
    follow the runner's rule, and one nothing ended from outside ends exactly where a
    request left alone would (the same oracle holds the synchronous run)."""
    sync = _Recording(cfg)
    sync.run(operations)
    sync.check_outputs()
    ahead = _AheadHarness(cfg)
    ahead.run(operations)
    ahead.check_outputs()
