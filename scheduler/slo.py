"""The ``slo`` policy's parts: a step sized to a latency target, and EDF admission.

A fixed token budget is right on one machine for one context length. The ``slo`` policy
asks a step-cost model (``scheduler.cost_model``) instead::

    every decode runs (stall-free)             predicted(decodes) = d
    prefill chunks are added while             predicted(decodes + chunks) <= limit
    the step's limit is                        target * min(1 + prompts / decodes,
                                                            slo_max_stretch),
                                               at most the decodes' TPOT slack
    a waiting request is admitted only if      predicted(decodes after it joins) <= target
    decodes are preempted only if              d > target * slo_preempt_margin

With no decode running nobody waits on the step, so prefill takes the whole token budget.
The ITL target of a step is the tightest of its decodes' targets (a request may carry its
own). The token budget (``max_num_batched_tokens``) stays a ceiling. TTFT counts against
ITL in the limit: ``prompts`` are those waiting for their first token that can still make
their TTFT (``SloStep.stretch`` says why they weigh as much as a decode), and the TPOT slack
(``banked_s``) keeps every decode within its ITL target on average, as goodput judges it.

Admission is earliest deadline first: the waiting queue is keyed by ``arrival + TTFT
target``, which EDF fixes at arrival, so the queue stays a heap. Plain EDF is optimal while
every deadline can be met and collapses under overload (a request already late is served
first and makes the next one late too). A request at the head of the queue that cannot
make its deadline even if prefilled alone from now (its predicted TTFT) is therefore moved
back once, by its own TTFT target: requests that can still make their deadline go first.
Moved once, its key stays finite and every later arrival's key beyond it is larger, so it
cannot starve: that is the aging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from scheduler.config import SchedulerConfig
from scheduler.cost_model import CostPredictor, StepShape
from scheduler.request import Request

_US = 1_000_000


def banked_s(req: Request, itl_target_s: float, now_s: float) -> float:
    """The time a decode has banked against its ITL target at ``now_s``: the target for each
    token after its first, counting this step's, less the time since its first token. A
    step this long keeps its time per output token (``time_per_output_token``, as goodput
    judges it) within the target if the steps after it run within the target too::

        first token          now         this step's token
            |---- elapsed ----|--- banked ---|
            <--- itl_target * (tokens after the first, this step's included) --->
    """
    assert req.first_token_s is not None
    return itl_target_s * req.num_output_tokens - (now_s - req.first_token_s)


def time_per_output_token(
    first_token_s: float | None, last_token_s: float | None, num_later_tokens: int
) -> float | None:
    """Time per output token after the first (DistServe's TPOT): the time from the first
    token to the last over the tokens after the first. None for a request of one token."""
    if first_token_s is None or last_token_s is None or num_later_tokens < 1:
        return None
    return max(0.0, last_token_s - first_token_s) / num_later_tokens


def attained(
    ttft_s: float | None,
    tpot_s: float | None,
    ttft_target_s: float | None,
    itl_target_s: float | None,
) -> tuple[bool, bool]:
    """Whether a request met its (TTFT, ITL) targets: the first token within the TTFT
    target, and the time per output token after it (``time_per_output_token``) within the
    ITL target (met by a request of one token). A target of None sets no limit. No first
    token meets no target but an absent one. The one judge of "met its targets" for the
    metrics, the simulator and the load tester."""
    if ttft_s is None:
        return ttft_target_s is None, itl_target_s is None
    ttft_ok = ttft_target_s is None or ttft_s <= ttft_target_s
    return ttft_ok, itl_target_s is None or tpot_s is None or tpot_s <= itl_target_s


class DeadlineOrder:
    """Earliest TTFT deadline first: the ``slo`` policy's ``QueueOrder``. Waiting requests
    never preempt running ones: the policy defers admission instead."""

    preempts_for_admission = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.default_ttft_s = config.ttft_slo_s

    def rank(self, priority: int, arrival_step: int) -> int:
        return priority

    def ttft_target_s(self, request: Request) -> float:
        target = request.ttft_slo_s
        return self.default_ttft_s if target is None else target

    def sort_key(self, rank: int, arrival_seq: int, request: Request) -> int:
        """The TTFT deadline, ``arrival + target``, in whole microseconds."""
        return round((request.arrival_time_s + self.ttft_target_s(request)) * _US)

    def late_key(self, rank: int, arrival_seq: int, request: Request) -> int:
        """Where a request found late moves to: its deadline plus its TTFT target again."""
        return self.sort_key(rank, arrival_seq, request) + round(self.ttft_target_s(request) * _US)


@dataclass(slots=True)
class SloStep:
    """One step being sized to its ITL target.

    ``shape``: what the step computes so far (decodes, then chunks as they are added).
    ``future``: the decode-only shape of the next steps: this step's decodes, plus every
    running prefill and every admission, each as one decode over its prompt.
    """

    cost: CostPredictor
    target_s: float
    has_decodes: bool
    shape: StepShape
    future: StepShape
    # How long the step may take: the target, or longer for waiting prompts (``stretch``).
    limit_s: float = 0.0
    # The decodes' TPOT slack: the least time a decode has banked (``banked_s``), the
    # longest this step may take with every decode still on its ITL target; inf without a
    # clock.
    slack_s: float = math.inf

    @classmethod
    def begin(
        cls,
        cost: CostPredictor,
        default_target_s: float,
        decodes: Iterable[tuple[Request, int, int]],
        prefills: Iterable[Request],
        now_s: float | None = None,
    ) -> SloStep:
        """``decodes``: (request, start position, tokens) of this step's decodes (more than
        one token: speculative drafts, ``StepShape.with_drafts``); ``prefills``:
        the running requests still prefilling; ``now_s``: the step's time (None: no slack
        is known and the step never stretches). A decode without ``first_token_s`` gets
        ``now_s``: its first token came out at the end of the previous step."""
        # Sums first, one StepShape at the end: this runs every step over every decode.
        target = default_target_s
        num_decodes = context = draft_tokens = draft_attention = 0
        slack = math.inf
        for req, start, num_tokens in decodes:
            num_decodes += 1
            context += start + 1
            if num_tokens > 1:
                draft_tokens += num_tokens - 1
                draft_attention += StepShape.chunk_attention(num_tokens - 1, start + 1)
            itl = req.itl_slo_s
            if itl is not None and itl < target:
                target = itl
            if now_s is not None:
                if req.first_token_s is None:
                    req.first_token_s = now_s
                banked = banked_s(req, default_target_s if itl is None else itl, now_s)
                if banked < slack:
                    slack = banked
        num_future, future_context = num_decodes, context
        for req in prefills:
            num_future += 1
            future_context += req.num_prompt_tokens + 1
        shape = StepShape(
            prefill_tokens=draft_tokens,
            decode_seqs=num_decodes,
            prefill_attention=draft_attention,
            decode_context=context,
        )
        future = StepShape(decode_seqs=num_future, decode_context=future_context)
        return cls(cost, target, num_decodes > 0, shape, future, target, slack)

    def stretch(self, num_prompts: int, max_stretch: float) -> None:
        """Let the step run past its ITL target for ``num_prompts`` prompts waiting for their
        first token (that can still make their TTFT): to ``target * (1 + prompts /
        decodes)``, at most ``target * max_stretch`` and never past the decodes' TPOT slack.

        Stretching by ``x`` delays each of the step's decodes by ``x`` once (within its slack
        that costs it no target), and moves ``x`` seconds of prefill work forward for every
        waiting prompt, in fewer steps that each pay the decodes' share again. A prompt
        waiting for its first token weighs as much as a decode: with one decode and seven
        prompts the step may run 8x its target, with seven decodes and one prompt 1.14x."""
        num_decodes = self.shape.decode_seqs
        if num_prompts < 1 or num_decodes < 1:
            return
        ratio = min(max_stretch, 1.0 + num_prompts / num_decodes)
        self.limit_s = max(self.target_s, min(self.target_s * ratio, self.slack_s))

    def chunk_limit(self, num_new: int, start: int) -> int:
        """The longest chunk of at most ``num_new`` tokens at ``start`` that keeps the step
        within its limit (``num_new`` when no decode waits on the step)."""
        if not self.has_decodes or num_new == 0:
            return num_new
        predict = self.cost.predict
        shape = self.shape
        target = self.limit_s
        if predict(shape.with_chunk(num_new, start)) <= target:
            return num_new
        # Bisect: predict grows with the chunk while the fitted coefficients are >= 0 (and
        # the answer fits the target whatever they are).
        lo, hi = 0, num_new
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if predict(shape.with_chunk(mid, start)) <= target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add_chunk(self, num_new: int, start: int) -> None:
        self.shape = self.shape.with_chunk(num_new, start)

    def admits(self, request: Request) -> bool:
        """Whether ``request``, once decoding, keeps the decode-only step under target."""
        if not self.has_decodes and self.future.decode_seqs == 0:
            return True  # nothing runs: always admit
        joined = self.future.with_decode(request.num_prompt_tokens + 1)
        return self.cost.predict(joined) <= self.target_s

    def admit(self, request: Request) -> None:
        self.future = self.future.with_decode(request.num_prompt_tokens + 1)


class UnsizedStep:
    """A step without a latency target: every chunk fits, every request is admitted."""

    __slots__ = ()

    def chunk_limit(self, num_new: int, start: int) -> int:
        return num_new

    def add_chunk(self, num_new: int, start: int) -> None:
        pass

    def admits(self, request: Request) -> bool:
        return True

    def admit(self, request: Request) -> None:
        pass


NO_TARGET = UnsizedStep()


class Queued(Protocol):
    """What the planner reads and moves of a waiting request (``scheduler.entry.Entry``)."""

    request: Request
    rank: int
    sort_key: int
    arrival_seq: int
    moved_late: bool


class SloPlanner:
    """The ``slo`` policy's state across steps: the step-cost model, the deadline order, the
    clock of the step being planned, and how many steps in a row the decodes alone were
    predicted over the target. The scheduler asks it; ``NoSloPlanner`` answers for every
    other policy, so the scheduler never asks which policy runs."""

    def __init__(self, config: SchedulerConfig, cost: CostPredictor, order: DeadlineOrder) -> None:
        self.cost = cost
        self.order = order
        self.itl_target_s = config.itl_slo_s
        self.preempt_margin = config.slo_preempt_margin
        self.max_stretch = config.slo_max_stretch
        self.now_s: float | None = None  # of the step being planned (late requests)
        self.num_over_steps = 0  # steps in a row with decodes predicted over the margin

    def begin(self, now_s: float | None) -> None:
        """A new step is being planned at ``now_s`` (None: nobody is found late)."""
        self.now_s = now_s

    def size(
        self, decodes: Iterable[tuple[Request, int, int]], prefills: Iterable[Request]
    ) -> SloStep | UnsizedStep:
        """Start sizing the step to its ITL target, once its decodes are taken (see
        ``SloStep.begin`` for the arguments)."""
        return SloStep.begin(self.cost, self.itl_target_s, decodes, prefills, self.now_s)

    def stretch(self, sized: SloStep | UnsizedStep, prompts: Iterable[Request]) -> None:
        """Before the step's prefill chunks: count the ``prompts`` (running prefills, then
        the head of the queue) that can still make their TTFT, and let the step stretch
        for them (``SloStep.stretch``)."""
        assert isinstance(sized, SloStep)
        if self.now_s is None or not sized.has_decodes or self.max_stretch <= 1.0:
            return
        sized.stretch(sum(1 for req in prompts if self.can_make_ttft(req)), self.max_stretch)

    def can_make_ttft(self, req: Request) -> bool:
        """Whether ``req`` can still have its first token by its TTFT deadline: its prompt's
        rest, prefilled alone in one step from now, is predicted to end in time."""
        assert self.now_s is not None
        start = req.num_computed_tokens
        rest = StepShape().with_chunk(req.num_prompt_tokens - start, start)
        deadline_s = req.arrival_time_s + self.order.ttft_target_s(req)
        return self.now_s + self.cost.predict(rest) <= deadline_s

    def ttft_lost(self, req: Request) -> bool:
        """Whether ``req``, still waiting for its first token, can no longer make its TTFT
        (``can_make_ttft``); False without a clock."""
        return self.now_s is not None and not self.can_make_ttft(req)

    def should_preempt(self, sized: SloStep | UnsizedStep, num_decodes: int) -> bool:
        """Whether to preempt a decode: the decodes alone are predicted well over the target
        for a second step in a row (one odd prediction preempts nobody)."""
        assert isinstance(sized, SloStep)
        shape = sized.shape
        decodes = StepShape(  # without their drafts: those go before any decode does
            decode_seqs=shape.decode_seqs, decode_context=shape.decode_context
        )
        over = num_decodes > 1 and self.cost.predict(decodes) > sized.target_s * self.preempt_margin
        if not over:
            self.num_over_steps = 0
            return False
        self.num_over_steps += 1
        return self.num_over_steps >= 2

    def move_if_late(self, head: Queued, num_waiting: int) -> bool:
        """Give the head of the queue its moved-back key once if it cannot make its TTFT
        deadline any more (``can_make_ttft``: admitted now and prefilled alone, it would
        still be late) and others wait behind it; return whether it moved (requeue it
        then). Admission goes by predicted TTFT: a request already lost does not take the
        step from those that can still make theirs."""
        order = self.order
        if self.now_s is None or head.moved_late or num_waiting < 2:
            return False
        req = head.request
        if self.can_make_ttft(req):
            return False
        head.moved_late = True
        key = order.late_key(head.rank, head.arrival_seq, req)
        if key <= head.sort_key:  # a forked sample: its key came from a moved parent
            return False
        head.sort_key = key
        return True


class NoSloPlanner:
    """Every policy but ``slo``: no target, nobody late, no preemption for latency."""

    __slots__ = ()

    def begin(self, now_s: float | None) -> None:
        pass

    def size(
        self, decodes: Iterable[tuple[Request, int, int]], prefills: Iterable[Request]
    ) -> SloStep | UnsizedStep:
        return NO_TARGET

    def should_preempt(self, sized: SloStep | UnsizedStep, num_decodes: int) -> bool:
        return False

    def stretch(self, sized: SloStep | UnsizedStep, prompts: Iterable[Request]) -> None:
        pass

    def ttft_lost(self, req: Request) -> bool:
        return False

    def move_if_late(self, head: Queued, num_waiting: int) -> bool:
        return False


def make_slo_planner(
    config: SchedulerConfig, cost: CostPredictor | None, order: object
) -> SloPlanner | NoSloPlanner:
    """The planner ``config.policy`` asks for (the slo policy needs ``cost`` and its
    ``DeadlineOrder``)."""
    if config.policy != "slo":
        return NoSloPlanner()
    if cost is None:
        raise ValueError("the slo policy needs a step-cost model (cost_model=...)")
    assert isinstance(order, DeadlineOrder)
    return SloPlanner(config, cost, order)
