"""The scheduler's bookkeeping types: one ``Entry`` per request, the one constructors of
``RequestOutput`` and ``ScheduledSeq`` (``make_output``, ``make_seq``), the cumulative
``Counters``, and the ``StepPlan`` a step is built in. Plain data; the ``Scheduler`` owns
every change.

One step ahead (vLLM's async scheduling): the engine may plan step N+1 before it applies step
N's result. ``num_computed_tokens`` stays the one measure of progress (KV computed by applied
steps); what is planned and not applied is the entry's ``pending`` seqs, with the tokens they
compute (``num_inflight_tokens``) and the tokens they sample and nobody knows yet
(``num_placeholders``, vLLM's ``num_output_placeholders``)::

    | computed (applied) | in flight: N's chunk | N+1 |
                                        ^ N samples this one: N+1's input is a placeholder

The entry answers where its request stands (the scheduler does no in-flight arithmetic of its
own): the next seq starts after the tokens in flight (``next_pos``), its slots are allocated
past them (``slots_for``), and a token in flight counts as an output token (``max_tokens``:
``num_tokens_ahead``; min_tokens, a seeded draw's index: ``make_seq``). Only applied tokens
get prefix-cache keys (``update`` keys blocks up to ``num_computed_tokens``), so no key covers
a placeholder. A preemption or a KV drop makes what is in flight stale (``drop_pending``):
``update`` drops a seq that is not the oldest pending one (``take_applied``). At most one
sampled token is in flight when a step is planned: the engine applies N before planning N+2.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cache_manager import Allocation, KVCacheManager
from scheduler.fork import ForkGroup
from scheduler.output import (
    PLACEHOLDER_TOKEN_ID,
    RequestOutput,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from scheduler.policies import TokenBudget
from scheduler.queue import WaitingQueue
from scheduler.request import FinishReason, Request
from scheduler.slo import NO_TARGET, SloStep, UnsizedStep


@dataclass(slots=True, eq=False)
class Entry:
    """The scheduler's bookkeeping for one request (the Request stays plain data)."""

    request: Request
    rank: int  # effective priority, fixed at arrival (see QueueOrder)
    sort_key: int  # waiting-queue key, then (arrival_seq, index)
    arrival_seq: int
    index: int = 0  # sample index: 0 for the request the client sent, i for its i-th fork
    group: ForkGroup | None = None  # n > 1, on sample 0: its samples (see scheduler.fork)
    blocked_at_num_free: int | None = None  # free blocks when admission last failed for memory
    moved_late: bool = False  # slo: moved back once, found late at the head (scheduler.slo)
    lora_blocked_since: int | None = None  # max_loras: the step it first waited for a slot
    # For the decode hot path: tokens that may stop it, and the length that ends it.
    stop_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0  # prompt + max_tokens (within max_model_len: checked at admission)
    # Planned and not applied yet, oldest first (see ``Scheduler``'s "one step ahead"): the
    # seqs, the tokens they compute and how many of them sample (tokens not known yet).
    pending: list[ScheduledSeq] = field(default_factory=list)
    num_inflight_tokens: int = 0
    num_placeholders: int = 0
    # Prompt logprobs scored so far (index p: the token at p + 1), until the first output
    # carries them; None when not asked for, or once delivered.
    prompt_logprobs: list[TokenLogprobs] | None = None

    def __post_init__(self) -> None:
        req = self.request
        sampling = req.sampling
        eos = () if sampling.ignore_eos else req.eos_token_ids
        self.stop_ids = frozenset((*sampling.stop_token_ids, *eos))
        self.max_num_tokens = req.num_prompt_tokens + sampling.max_tokens
        if sampling.prompt_logprobs is not None and not req.output_token_ids:
            self.prompt_logprobs = []

    def keep_prompt_logprobs(self, start_pos: int, scored: list[TokenLogprobs]) -> None:
        """A chunk from ``start_pos`` scored ``scored``; a chunk computed again (after a
        preemption) replaces what it scored before."""
        kept = self.prompt_logprobs
        if kept is None:
            return
        if start_pos > len(kept):
            msg = f"{self.request_id!r}: prompt logprobs from {start_pos}, {len(kept)} kept"
            raise RuntimeError(msg)
        del kept[start_pos:]
        kept.extend(scored)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether its prompt is still to be scored: it takes no prefix-cache hit."""
        return self.prompt_logprobs is not None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    # -- where the request stands, one step ahead (the module docstring) -------------------

    def plan(self, seq: ScheduledSeq) -> None:
        """``seq`` was planned for this request: its tokens are in flight until ``update``
        applies it (``take_applied``), unless ``drop_pending`` made it stale."""
        self.pending.append(seq)
        self.num_inflight_tokens += len(seq.token_ids)
        self.num_placeholders += seq.do_sample

    def take_applied(self, seq: ScheduledSeq) -> bool:
        """``seq``'s result is being applied: it is in flight no more. False (nothing
        changed) when it is stale: not the oldest pending seq, as after a preemption or a KV
        drop (its result is then dropped). On the per-token path: a few attribute updates."""
        pending = self.pending
        if not pending or pending[0] is not seq:
            return False
        del pending[0]
        self.num_inflight_tokens -= len(seq.token_ids)
        self.num_placeholders -= seq.do_sample
        return True

    def drop_pending(self) -> None:
        """The request restarts from its computed tokens (preempted, KV dropped): whatever
        is in flight for it is stale."""
        self.pending.clear()
        self.num_inflight_tokens = 0
        self.num_placeholders = 0

    @property
    def in_flight(self) -> bool:
        """Whether a planned seq of it is not applied yet."""
        return bool(self.pending)

    @property
    def samples_in_flight(self) -> bool:
        """Whether a seq in flight samples: its next input token is not known yet (the
        next seq's is a placeholder), and it decodes next whatever its status says."""
        return self.num_placeholders > 0

    @property
    def next_pos(self) -> int:
        """The position its next seq starts at: past the computed tokens and those in
        flight."""
        return self.request.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_tokens_ahead(self) -> int:
        """Its tokens once the seqs in flight are applied: the known ones and those they
        sample."""
        return self.request.num_tokens + self.num_placeholders

    def slots_for(self, num_new: int) -> int:
        """The slots past its computed tokens that ``num_new`` more tokens need: those in
        flight hold theirs (``KVCacheManager.allocate_slots``' count)."""
        return self.num_inflight_tokens + num_new

    @property
    def arrival(self) -> tuple[int, int]:
        return (self.arrival_seq, self.index)

    @property
    def num_computed_tokens(self) -> int:
        return self.request.num_computed_tokens

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before sampling. A parent of forked samples stops one short of
        its prompt: the samples fork there and each computes the last prompt token itself,
        sampling its own first token (n - 1 writes into the shared partial block are copied
        on write; no keyed, full block is ever written)."""
        if self.group is not None and not self.group.forked:
            return self.request.num_prompt_tokens - 1
        return self.request.num_tokens

    @property
    def num_seats(self) -> int:
        """Running slots admission needs: n for a parent not forked yet, else 1."""
        return 1 if self.group is None else 1 + self.group.num_unforked

    @property
    def forked_ids(self) -> tuple[str, ...]:
        """What the parent's output names in ``forked_ids``: its samples, once they are
        forked and until its first token is out (a later output need not repeat them)."""
        group = self.group
        if group is None or not group.forked or len(self.request.output_token_ids) > 1:
            return ()
        return group.child_ids


def make_output(
    entry: Entry,
    new_token_ids: list[int],
    new_logprobs: list[TokenLogprobs],
    reason: FinishReason | None,
    error: str | None = None,
) -> RequestOutput:
    """What a request reports after a step (``reason`` None) or at its end: the one
    ``RequestOutput`` constructor. Positional, as it runs for every token: measured 0.50 us
    against 1.06 us with keywords."""
    req = entry.request
    return RequestOutput(
        req.request_id,
        new_token_ids,
        new_logprobs,
        reason is not None,
        reason,
        req.stop_reason,
        error,
        len(req.prompt_token_ids),
        req.num_cached_tokens,
        len(req.output_token_ids),
        req.parent_id,
        entry.index,
        () if entry.group is None else entry.forked_ids,
    )


def make_seq(
    entry: Entry, num_new: int, block_ids: list[int], drafts: list[int] | None = None
) -> ScheduledSeq:
    """The next ``num_new`` tokens of ``entry``'s request to compute (then its speculative
    ``drafts``, if any) over its current ``block_ids`` (a copy the seq keeps). The one
    ``ScheduledSeq`` constructor: positional, as it runs for every decode.

    They start after the tokens already in flight; a token not known yet (sampled by the
    step in flight) is a placeholder, and is counted as an output token::

        | computed | in flight (planned, not applied) | this seq ...
                                                  ^ the placeholder: sampled in flight
    """
    req = entry.request
    start = entry.next_pos
    end = start + num_new
    all_token_ids = req.all_token_ids
    num_known = len(all_token_ids)
    num_placeholders = entry.num_placeholders
    num_scored = 0
    if entry.prompt_logprobs is not None:
        num_scored = max(0, min(end, len(req.prompt_token_ids) - 1) - start)
    if end > num_known:
        token_ids = all_token_ids[start:num_known] + [PLACEHOLDER_TOKEN_ID] * (end - num_known)
    else:
        token_ids = all_token_ids[start:end] + drafts if drafts else all_token_ids[start:end]
    return ScheduledSeq(
        req.request_id,
        token_ids,
        start,
        block_ids,
        req.sampling,
        end == num_known + num_placeholders,
        all_token_ids,
        len(req.prompt_token_ids),
        len(req.output_token_ids) + num_placeholders,
        req.eos_token_ids,
        len(drafts) if drafts else 0,
        req.lora,
        num_scored,
    )


@dataclass(slots=True)
class Counters:
    """Cumulative counts for ``make_stats``, and the last plan's composition (not the plan
    itself: holding it would keep thousands of objects alive into older GC generations and
    make full collections frequent)."""

    num_prefill_tokens: int = 0  # of the last plan
    num_prefill_reqs: int = 0  # of the last plan
    num_decode_reqs: int = 0  # of the last plan
    num_steps_prefill: int = 0
    num_steps_decode: int = 0
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_finished: Counter[str] = field(default_factory=Counter)  # by FinishReason.value

    def snapshot(
        self,
        step_id: int,
        num_running: int,
        waiting: WaitingQueue[Any],
        num_parked: int,
        kv: KVCacheManager,
        lora_running: dict[str, int] | None = None,
    ) -> SchedulerStats:
        """The scheduler's stats: these counts, the queue's and the cache manager's."""
        return SchedulerStats(
            step_id=step_id,
            num_running=num_running,
            num_waiting=waiting.num_requests,
            num_preempted=waiting.num_preempted,
            num_prefill_tokens=self.num_prefill_tokens,
            num_prefill_reqs=self.num_prefill_reqs,
            num_decode_reqs=self.num_decode_reqs,
            num_steps_prefill_total=self.num_steps_prefill,
            num_steps_decode_total=self.num_steps_decode,
            num_preemptions_total=self.num_preemptions,
            num_recomputed_tokens_total=self.num_recomputed_tokens,
            num_prompt_tokens_total=self.num_prompt_tokens,
            num_generation_tokens_total=self.num_generation_tokens,
            num_finished_total=dict(self.num_finished),
            num_waiting_tokens=waiting.num_tokens,
            kv=kv.make_stats(),
            num_parked=num_parked,
            lora_running=lora_running,
            lora_waiting=_with_base(waiting.adapter_counts(), waiting.num_requests),
            num_spec_draft_tokens_total=self.num_spec_draft_tokens,
            num_spec_accepted_tokens_total=self.num_spec_accepted_tokens,
        )


def _with_base(by_adapter: dict[str, int], total: int) -> dict[str, int]:
    """Requests by adapter with the base model's under "" (the rest of ``total``)."""
    base = total - sum(by_adapter.values())
    return {"": base, **by_adapter} if base else by_adapter


@dataclass(slots=True)
class StepPlan:
    """One step's plan while it is being built."""

    step_id: int
    budget: TokenBudget
    slo: SloStep | UnsizedStep = NO_TARGET  # the slo policy's sizing of this step
    prefill: dict[str, ScheduledSeq] = field(default_factory=dict)
    decode: dict[str, ScheduledSeq] = field(default_factory=dict)
    copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def add_prefill(self, seq: ScheduledSeq, allocation: Allocation) -> None:
        self.prefill[seq.request_id] = seq
        if allocation.block_copies:
            self.copies[seq.request_id] = allocation.block_copies

    def add_decode(self, seq: ScheduledSeq, allocation: Allocation) -> None:
        self.decode[seq.request_id] = seq
        if allocation.block_copies:
            self.copies[seq.request_id] = allocation.block_copies

    def unschedule(self, request_id: str) -> None:
        """Take a preempted request out of this step, giving its tokens back to the budget.

        Its copy-on-write copies go too: their destination blocks were just freed.
        """
        seq = self.prefill.pop(request_id, None) or self.decode.pop(request_id, None)
        if seq is not None:
            self.budget.give_back(seq.num_tokens)
        self.copies.pop(request_id, None)

    def refresh_block_ids(self, request_id: str, block_ids: list[int]) -> None:
        """A request of this step had old blocks released (adaptive strategy): its planned
        seq reads the new table, so no freed block is read."""
        seq = self.prefill.get(request_id) or self.decode.get(request_id)
        if seq is not None:
            seq.block_ids = block_ids

    def build(
        self,
        finished_request_ids: list[str],
        null_block_id: int | None,
        running: dict[str, Entry],
    ) -> SchedulerOutput:
        """The step's plan; from now on each of its seqs is in flight for its request's
        entry in ``running`` (``Entry.plan``) until ``update`` applies it."""
        for seq in self.prefill.values():
            running[seq.request_id].plan(seq)
        for seq in self.decode.values():
            running[seq.request_id].plan(seq)
        copies = [c for seq_copies in self.copies.values() for c in seq_copies]
        return SchedulerOutput(
            step_id=self.step_id,
            prefill=list(self.prefill.values()),
            decode=list(self.decode.values()),
            block_copies=copies,
            finished_request_ids=finished_request_ids,
            null_block_id=null_block_id,
        )


def check_in_flight(
    entries: dict[str, Entry], running: dict[str, Entry], kv: KVCacheManager
) -> None:
    """For tests (``Scheduler.check_invariants``): each request's pending seqs follow on from
    its computed tokens, their counts match, only running requests have any, and the block
    table covers every planned slot."""
    for rid, entry in entries.items():
        pending = entry.pending
        assert entry.num_inflight_tokens == sum(len(s.token_ids) for s in pending), rid
        assert entry.num_placeholders == sum(s.do_sample for s in pending), rid
        if running.get(rid) is not entry:
            assert not pending, f"{rid} is not running but has seqs in flight"
            continue
        pos = entry.request.num_computed_tokens
        for seq in pending:
            assert seq.start_pos == pos, (rid, seq.start_pos, pos)
            pos = seq.end_pos
        if kv.has_request(rid):
            assert len(kv.block_ids(rid)) * kv.block_size >= pos, (rid, pos)
