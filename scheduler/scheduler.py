"""The iteration-level scheduler: every step, who runs and as what (prefill or decode).

One engine step is three calls::

    plan = scheduler.schedule()          # allocate blocks, form the prefill + decode batches
    result = runner.execute(plan)        # compute; sample a token per do_sample seq
    outs = scheduler.update(plan, result)  # advance progress, append tokens, finish, free

Progress is one counter per request, ``num_computed_tokens`` (tokens whose KV is in the
cache). A request needs ``num_tokens - num_computed_tokens`` more tokens computed::

    | prompt ................................ | output ...... |
    | cached (prefix hit) | computed | chunk this step | rest  |
                                     ^ start_pos      ^ end_pos (== num_tokens: sample)

A chunk that ends at the last known token samples the next one (``do_sample``). A decode is
the chunk of exactly that last token. ``schedule`` allocates blocks for every scheduled
token; ``update`` advances ``num_computed_tokens`` to the chunk's end and registers newly
full blocks in the prefix cache.

Speculative decoding (``speculative="ngram"``): a decode carries up to k drafts from
``scheduler.spec.NgramDrafter``, counted in the step's token budget and given KV slots like
any token (drafts never preempt: without room the decode runs alone). ``update`` appends the
accepted drafts and the token sampled after them, then ``kv.rollback_slots`` drops the KV of
the rejected ones::

    | computed ........ | last | draft 0 | draft 1 | draft 2 |     scheduled: 1 + k tokens
    | computed ...................... | accepted | rejected  |     + the sampled token
                                      ^ num_computed_tokens: slots past it are rolled back

Request states: ``WAITING -> PREFILLING -> DECODING -> FINISHED_*``, and
``PREFILLING|DECODING -> PREEMPTED`` (back in the waiting queue, at its old place in line)
``-> PREFILLING``. Preemption is by recompute: the blocks are freed, the output tokens kept,
and the whole sequence is prefilled again (cheap with the prefix cache).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from cache_manager import Allocation, KVCacheManager, PrefixHit
from scheduler.config import SchedulerConfig
from scheduler.cost_model import CostPredictor, StepShape
from scheduler.errors import OverloadError
from scheduler.fork import ForkGroup, ForkTable, make_sample
from scheduler.output import (
    ModelOutput,
    RequestOutput,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from scheduler.policies import (
    BatchKind,
    TokenBudget,
    make_batch_policy,
    make_queue_order,
    make_victim_rule,
)
from scheduler.queue import WaitingQueue
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.slo import DeadlineOrder, SloStep
from scheduler.spec import NgramDrafter

_WAITING = RequestStatus.WAITING
_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING
_PREEMPTED = RequestStatus.PREEMPTED
_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
_FINISHED_LENGTH = RequestStatus.FINISHED_LENGTH
_FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED
_FINISHED_ERROR = RequestStatus.FINISHED_ERROR


@dataclass(slots=True, eq=False)
class _Entry:
    """The scheduler's bookkeeping for one request (the Request stays plain data)."""

    request: Request
    rank: int  # effective priority, fixed at arrival (see QueueOrder)
    sort_key: int  # waiting-queue key, then (arrival_seq, index)
    arrival_seq: int
    index: int = 0  # sample index: 0 for the request the client sent, i for its i-th fork
    num_full_blocks: int = 0  # full computed blocks already handed to cache_full_blocks
    group: ForkGroup | None = None  # n > 1, on sample 0: its samples (see scheduler.fork)
    blocked_at_num_free: int | None = None  # free blocks when admission last failed for memory
    moved_late: bool = False  # slo: moved back once, found late at the head (scheduler.slo)
    # For the decode hot path: tokens that may stop it, and the length that ends it.
    stop_ids: frozenset[int] = frozenset()
    max_num_tokens: int = 0  # prompt + max_tokens (within max_model_len: checked at admission)

    def __post_init__(self) -> None:
        req = self.request
        sampling = req.sampling
        eos = () if sampling.ignore_eos else req.eos_token_ids
        self.stop_ids = frozenset((*sampling.stop_token_ids, *eos))
        self.max_num_tokens = req.num_prompt_tokens + sampling.max_tokens

    @property
    def request_id(self) -> str:
        return self.request.request_id

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


def _output(
    entry: _Entry,
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


@dataclass(slots=True)
class _Counters:
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


@dataclass(slots=True)
class _Step:
    """One step's plan while it is being built."""

    step_id: int
    budget: TokenBudget
    slo: SloStep | None = None  # the slo policy's sizing of this step
    prefill: dict[str, ScheduledSeq] = field(default_factory=dict)
    decode: dict[str, ScheduledSeq] = field(default_factory=dict)
    copies: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def add(self, seq: ScheduledSeq, decode: bool, allocation: Allocation) -> None:
        (self.decode if decode else self.prefill)[seq.request_id] = seq
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

    def build(self, finished_request_ids: list[str], null_block_id: int | None) -> SchedulerOutput:
        copies = [c for seq_copies in self.copies.values() for c in seq_copies]
        return SchedulerOutput(
            step_id=self.step_id,
            prefill=list(self.prefill.values()),
            decode=list(self.decode.values()),
            block_copies=copies,
            finished_request_ids=finished_request_ids,
            null_block_id=null_block_id,
        )


class Scheduler:
    """Continuous batching over a paged KV cache; see the module docstring.

    Not thread-safe: the engine loop owns it and calls every method from one thread.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        cost_model: CostPredictor | None = None,
    ) -> None:
        """``cost_model``: the step-cost model the ``slo`` policy sizes steps with (required
        by it; the engine feeds it measured step times)."""
        if config.policy == "slo" and cost_model is None:
            raise ValueError("the slo policy needs a step-cost model (cost_model=...)")
        self.config = config
        self.kv = kv
        self._block_size = kv.block_size
        self._sliding_window = kv.sliding_window
        self._reserve = config.memory_mode == "reserve"
        self._max_chunk = config.max_chunk_tokens
        self._num_usable_blocks = kv.num_usable_blocks
        self._block_ids = kv.block_ids
        self._policy = make_batch_policy(config)
        self._order = make_queue_order(config)
        self._victim = make_victim_rule(config)
        self._cost = cost_model if config.policy == "slo" else None
        self._deadline = self._order if isinstance(self._order, DeadlineOrder) else None
        self._now_s: float | None = None  # of the step being planned (slo: late requests)
        self._slo_over_steps = 0  # slo: steps in a row with decodes predicted over the margin
        self._drafter: NgramDrafter | None = None
        if config.speculative == "ngram":
            self._drafter = NgramDrafter(
                config.num_speculative_tokens, config.ngram_max, config.ngram_min
            )

        self._entries: dict[str, _Entry] = {}  # every unfinished request
        self._forks = ForkTable()
        self._running: dict[str, _Entry] = {}  # admission order
        self._waiting: WaitingQueue[_Entry] = WaitingQueue()
        self._finished_ids: list[str] = []
        self._pending_outputs: list[RequestOutput] = []  # finished outside update()
        self._parked: set[str] = set()  # not scheduled until unparked (backpressure)
        self._step_id = 0
        self._arrival_seq = 0
        self._counters = _Counters()

    # -- queries ------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def step_id(self) -> int:
        return self._step_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._entries) or bool(self._pending_outputs)

    def get_request(self, request_id: str) -> Request | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.request

    def running_request_ids(self) -> list[str]:
        """Running requests in admission order (the decode batch order)."""
        return list(self._running)

    def waiting_request_ids(self) -> list[str]:
        """Waiting requests in the order they would be admitted."""
        return [entry.request_id for entry in self._waiting.ordered()]

    # -- admission ----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises ``ValueError`` (with the numbers) when it can never run: a duplicate id, an
        empty prompt, prompt + max_tokens beyond max_model_len or beyond the whole KV pool.
        Raises ``OverloadError`` when the waiting queue is over its bounds (retry later).
        """
        rid = request.request_id
        if self._id_in_use(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        if request.status is not _WAITING or request.num_computed_tokens != 0:
            raise ValueError(
                f"request {rid!r} must be new (status waiting, 0 computed tokens), got "
                f"{request.status.value} with {request.num_computed_tokens} computed"
            )
        group = self._check_can_ever_run(request)
        self._check_not_overloaded(request)
        rank = self._order.rank(request.priority, self._step_id)
        entry = _Entry(
            request=request,
            rank=rank,
            sort_key=self._order.sort_key(rank, self._arrival_seq, request),
            arrival_seq=self._arrival_seq,
            group=group,
        )
        self._arrival_seq += 1
        self._entries[rid] = entry
        if group is not None:
            self._forks.reserve(group)
        self._counters.num_prompt_tokens += request.num_prompt_tokens
        self._waiting.push(entry)

    def _id_in_use(self, request_id: str) -> bool:
        return request_id in self._entries or self._forks.is_reserved(request_id)

    def _check_can_ever_run(self, request: Request) -> ForkGroup | None:
        rid = request.request_id
        sampling = request.sampling
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt")
        max_model_len = self.config.max_model_len  # the scheduler's one check of the limit
        num_total = num_prompt + sampling.max_tokens
        if num_prompt > max_model_len or (
            num_total > max_model_len and not self.kv.streams_past_context
        ):
            raise ValueError(
                f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens "
                f"({sampling.max_tokens}) = {num_total} tokens exceeds max_model_len "
                f"({max_model_len})"
            )
        n = sampling.n
        if n > 1 and self._reserve:
            raise ValueError(f"request {rid!r}: n={n} > 1 is not supported in reserve memory mode")
        if n > self.config.max_num_seqs:
            raise ValueError(
                f"request {rid!r}: n={n} samples exceed max_num_seqs ({self.config.max_num_seqs})"
            )
        num_blocks = self._max_blocks_needed(num_prompt, num_total, n)
        usable = self._num_usable_blocks
        if num_blocks > usable:
            raise ValueError(
                f"request {rid!r}: {num_total} tokens x {n} sample(s) need {num_blocks} KV "
                f"blocks of {self._block_size} tokens, but the whole pool has {usable}"
            )
        group = ForkGroup.of(request)
        for cid in () if group is None else group.child_ids:
            if self._id_in_use(cid):
                raise ValueError(f"request {rid!r}: the id of its sample {cid!r} is in use")
        return group

    def _max_blocks_needed(self, num_prompt: int, num_total: int, n: int) -> int:
        """Blocks a request holds at its longest: n samples share the prompt's full blocks."""
        blocks_for = self.kv.num_blocks_for
        window = self._sliding_window
        if window is not None and not self._reserve:  # reserve mode reserves every block
            # Only the window (plus the chunk being written) stays resident.
            return n * self.kv.max_resident_blocks(num_total, self._max_chunk)
        # Samples fork at num_prompt - 1: a last prompt block still partial then is copied.
        shared = (num_prompt - 1) // self._block_size if n > 1 else 0
        return shared + n * (blocks_for(num_total) - shared)

    def _check_not_overloaded(self, request: Request) -> None:
        cfg = self.config
        waiting = self._waiting
        if waiting.num_requests + 1 > cfg.max_waiting_requests:
            raise OverloadError(
                f"waiting queue is full: {waiting.num_requests} requests waiting "
                f"(max_waiting_requests={cfg.max_waiting_requests})"
            )
        num_tokens = waiting.num_tokens + request.num_prompt_tokens
        if num_tokens > cfg.max_waiting_tokens:
            raise OverloadError(
                f"waiting queue is full: {waiting.num_tokens} prompt tokens waiting + "
                f"{request.num_prompt_tokens} new > max_waiting_tokens={cfg.max_waiting_tokens}"
            )

    # -- ending requests from outside ---------------------------------------------------

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request in any state (and its forked samples) and free its blocks once.

        Returns its final output (finish_reason ABORT), or None if the id is unknown or
        already finished. Forked samples that end with it report in the next ``update``.
        Why it was aborted is the caller's to record (``AbortReason``, in metrics).
        """
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        out = self._finish(entry, _FINISHED_ABORTED)
        group = entry.group
        for cid in group.child_ids if group is not None and group.forked else ():
            child = self._entries.get(cid)
            if child is not None:
                self._pending_outputs.append(self._finish(child, _FINISHED_ABORTED))
        return out

    def finish(self, request_id: str, stop_reason: str) -> RequestOutput | None:
        """End a request because a stop string was found (the engine detokenizes)."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        entry.request.stop_reason = stop_reason
        return self._finish(entry, _FINISHED_STOPPED)

    def fail(self, request_id: str, error: str) -> RequestOutput | None:
        """End one request with an error; everyone else continues."""
        entry = self._entries.get(request_id)
        if entry is None:
            return None
        return self._finish(entry, _FINISHED_ERROR, error=error)

    # -- backpressure -------------------------------------------------------------------

    def park(self, request_id: str) -> bool:
        """Stop scheduling a request (its client is not reading): it keeps its blocks and
        its place, and no step computes tokens for it until ``unpark``. False if unknown."""
        if request_id not in self._entries:
            return False
        self._parked.add(request_id)
        return True

    def unpark(self, request_id: str) -> None:
        """Schedule a parked request again (no-op when it is not parked)."""
        self._parked.discard(request_id)

    # -- one step -----------------------------------------------------------------------

    def schedule(self, now_s: float | None = None) -> SchedulerOutput:
        """Plan one step: take the batch kinds in the policy's order (decodes, prefill
        chunks) within the step's token budget, allocating blocks for every scheduled token.

        Running requests that cannot get blocks preempt the victim rule's choice (possibly
        themselves). Waiting requests are admitted in queue order until the budget, the
        seats (``max_num_seqs``) or the memory run out; under priority order they may
        preempt running requests of worse effective priority. Under the ``slo`` policy the
        step is also sized to its ITL target (``scheduler.slo``).

        ``now_s``: the time on the clock of ``Request.arrival_time_s``; the ``slo`` policy
        moves requests already past their TTFT deadline back (once) when it is given.
        """
        self._step_id += 1
        self._now_s = now_s
        step = _Step(self._step_id, TokenBudget(self.config.max_num_batched_tokens))
        policy = self._policy
        took_decodes = False
        for kind in policy.order(self._has_decoding):
            if kind is BatchKind.DECODE:
                took_decodes = True
                num_scheduled = self._take_decodes(step)
                if self._cost is not None:
                    self._size_to_target(step, self._cost)
            else:
                num_scheduled = self._take_prefills(step)
            if num_scheduled and policy.exclusive:
                break
        policy.observe(took_decodes, self._has_decoding)
        if not step.prefill and not step.decode and self._has_decoding():
            # Samples forked at admission (n > 1 with nothing left to prefill) turned
            # DECODING after the decodes were taken: run them now, not after an idle wait.
            self._take_decodes(step)
        plan = step.build(self._finished_ids, self.kv.null_block_id)
        self._finished_ids = []
        counters = self._counters
        counters.num_prefill_tokens = plan.num_prefill_tokens
        counters.num_prefill_reqs = len(plan.prefill)
        counters.num_decode_reqs = len(plan.decode)
        counters.num_steps_prefill += bool(plan.prefill)
        counters.num_steps_decode += bool(plan.decode)
        return plan

    def update(self, plan: SchedulerOutput, result: ModelOutput) -> list[RequestOutput]:
        """Apply a step's result: advance progress, append sampled tokens, finish requests
        on EOS (not before min_tokens, unless ignore_eos) / a stop token / max_tokens
        (admission made sure it ends within max_model_len), and free finished requests'
        blocks.

        Returns one output per request that got a token or finished since the last update.
        """
        outputs = self._pending_outputs
        self._pending_outputs = []
        self._apply(plan.prefill, result, outputs, prefill=True)
        self._apply(plan.decode, result, outputs, prefill=False)
        return outputs

    def _apply(
        self,
        batch: list[ScheduledSeq],
        result: ModelOutput,
        outputs: list[RequestOutput],
        *,
        prefill: bool,
    ) -> None:
        """Apply one batch's result. The per-token hot path: 1,024 decodes a step must cost
        well under a millisecond here, so what a plain decode never needs is branched off
        under ``slow``: prefill chunks (a middle one samples nothing, the one that reaches
        the fork forks; a sampling one turns the request DECODING), failures, a sliding
        window, logprobs. The end of a request branches off at its token."""
        running = self._running
        block_size = self._block_size
        kv = self.kv
        window = self._sliding_window is not None
        drop = not kv.strategy.always_retains  # the strategy may drop KV after a token
        sampled = result.sampled_token_ids
        failed = result.failed
        logprobs = result.logprobs
        slow = prefill or window or bool(failed) or bool(logprobs) or drop
        append = outputs.append
        num_outputs_before = len(outputs)
        num_uncounted = 0  # outputs not of one generated token: failures, verified drafts
        for seq in batch:
            rid = seq.request_id
            try:  # dict lookups in try: no method call per token
                entry = running[rid]
            except KeyError:  # ended (aborted, failed) after it was planned
                continue
            req = entry.request
            if seq.num_draft_tokens:
                append(self._apply_verified(entry, seq, result))
                num_uncounted += 1
                continue
            # The chunk's end; a decode is one token.
            num_computed = seq.start_pos + (len(seq.token_ids) if prefill else 1)
            req.num_computed_tokens = num_computed
            if slow and rid in failed:
                append(self._finish(entry, _FINISHED_ERROR, error=failed[rid]))
                num_uncounted += 1
                continue
            if num_computed // block_size > entry.num_full_blocks:
                kv.cache_full_blocks(req)
                entry.num_full_blocks = num_computed // block_size
            new_logprobs: list[TokenLogprobs] = []
            if slow:
                if window:
                    kv.release_out_of_window(req)
                if not seq.do_sample:
                    if entry.group is not None and num_computed == entry.prefill_target:
                        self._fork_children(entry)
                    continue
                req.status = _DECODING
                if rid in logprobs:
                    new_logprobs.append(logprobs[rid])
            try:
                token = sampled[rid]
            except KeyError:
                msg = f"runner returned no token for {rid!r}, which was to sample"
                raise RuntimeError(msg) from None
            req.append_output_token(token)
            # The guard keeps the full check off the usual token (num_computed is one short
            # of the tokens now: this chunk ended at the last one).
            if token in entry.stop_ids or num_computed >= entry.max_num_tokens - 1:
                status = self._stop_status(entry, token)
                if status is not None:
                    append(self._finish(entry, status, [token], new_logprobs))
                    continue
            append(_output(entry, [token], new_logprobs, None))
            if drop and not kv.keeps_kv(req):
                self._recompute_next_step(entry)
        # Every output since the batch began carries one new token, but those uncounted.
        self._counters.num_generation_tokens += len(outputs) - num_outputs_before - num_uncounted

    def _apply_verified(
        self, entry: _Entry, seq: ScheduledSeq, result: ModelOutput
    ) -> RequestOutput:
        """A decode with drafts: append the accepted drafts and the token sampled after them
        (each checked for a stop like any token), advance to the tokens whose KV is now
        computed, and roll back the KV slots of the rejected drafts."""
        req = entry.request
        rid = req.request_id
        if rid in result.failed:
            return self._finish(entry, _FINISHED_ERROR, error=result.failed[rid])
        num_drafts = seq.num_draft_tokens
        num_accepted = result.num_accepted_drafts.get(rid, 0)
        if not 0 <= num_accepted <= num_drafts:
            msg = f"runner accepted {num_accepted} of {num_drafts} drafts for {rid!r}"
            raise RuntimeError(msg)
        try:
            sampled = result.sampled_token_ids[rid]
        except KeyError:
            msg = f"runner returned no token for {rid!r}, which was to sample"
            raise RuntimeError(msg) from None
        counters = self._counters
        counters.num_spec_draft_tokens += num_drafts
        counters.num_spec_accepted_tokens += num_accepted
        new_token_ids: list[int] = []
        status: RequestStatus | None = None
        for token in [*seq.token_ids[1 : 1 + num_accepted], sampled]:
            req.append_output_token(token)
            new_token_ids.append(token)
            if token in entry.stop_ids or req.num_tokens >= entry.max_num_tokens:
                status = self._stop_status(entry, token)
                if status is not None:
                    break
        counters.num_generation_tokens += len(new_token_ids)
        # KV is computed for the scheduled token and the accepted drafts: every new token
        # but the last.
        req.num_computed_tokens = seq.start_pos + len(new_token_ids)
        if status is not None:
            return self._finish(entry, status, new_token_ids)
        kv = self.kv
        num_full = req.num_computed_tokens // self._block_size
        if num_full > entry.num_full_blocks:
            kv.cache_full_blocks(req)
            entry.num_full_blocks = num_full
        kv.rollback_slots(req)
        if self._sliding_window is not None:
            kv.release_out_of_window(req)
        if not kv.strategy.always_retains and not kv.keeps_kv(req):
            self._recompute_next_step(entry)
        return _output(entry, new_token_ids, [], None)

    def _recompute_next_step(self, entry: _Entry) -> None:
        """The KV strategy keeps no KV for this request between steps: free its blocks now,
        and the next step prefills its whole sequence again (the full-recompute baseline)."""
        req = entry.request
        self.kv.drop_kv(req.request_id)
        req.num_computed_tokens = 0
        req.status = _PREFILLING
        entry.num_full_blocks = 0

    @staticmethod
    def _stop_status(entry: _Entry, token: int) -> RequestStatus | None:
        """The finished status ``token`` (just appended) gives the request, or None; a stop
        token is kept as its ``stop_reason``.

        A stop (EOS unless ignore_eos, or a stop token id) only counts once min_tokens are
        out; it wins over the length limit when both hold.
        """
        req = entry.request
        sampling = req.sampling
        if len(req.output_token_ids) >= sampling.min_tokens:
            if token in sampling.stop_token_ids:
                req.stop_reason = token
                return _FINISHED_STOPPED
            if not sampling.ignore_eos and token in req.eos_token_ids:
                return _FINISHED_STOPPED
        return _FINISHED_LENGTH if req.num_tokens >= entry.max_num_tokens else None

    # -- batch formation (the kinds the policy orders) -----------------------------------

    def _has_decoding(self) -> bool:
        return any(e.request.status is _DECODING for e in self._running.values())

    def _take_decodes(self, step: _Step) -> int:
        """One token for every decoding request, in admission order."""
        budget = step.budget
        allocate_slots = self.kv.allocate_slots
        make_seq = self._make_seq
        decode = step.decode
        num_before = len(decode)
        decoding = _DECODING
        parked = self._parked
        remaining = budget.remaining  # a local on the hot path; synced around the slow one
        for entry in list(self._running.values()):
            req = entry.request
            if req.status is not decoding:  # prefilling, or preempted meanwhile
                continue
            if parked and req.request_id in parked:
                continue
            if remaining == 0:
                break
            if self._drafter is not None:
                budget.remaining = remaining
                self._take_speculative_decode(step, entry)
                remaining = budget.remaining
                continue
            remaining -= 1
            allocation = allocate_slots(req, 1)
            if allocation is None or allocation.block_copies:  # preempt, or copy on write
                budget.remaining = remaining
                self._schedule_running(step, entry, 1, decode=True, allocation=allocation)
                remaining = budget.remaining
            else:
                decode[req.request_id] = make_seq(req, 1)
        budget.remaining = remaining
        return len(decode) - num_before

    def _take_speculative_decode(self, step: _Step, entry: _Entry) -> None:
        """One decode with up to k drafts, within the budget (at least 1 token is left),
        ``max_tokens`` and the chunk limit. Drafts never preempt: without room for them the
        decode runs alone. No drafts for a request that wants logprobs (one per token)."""
        req = entry.request
        budget = step.budget
        budget.remaining -= 1
        drafts: list[int] = []
        room = min(budget.remaining, entry.max_num_tokens - req.num_tokens - 1, self._max_chunk - 1)
        if room > 0 and req.sampling.logprobs is None:
            assert self._drafter is not None
            drafts = self._drafter.propose(req.all_token_ids, room)
        allocation = self.kv.allocate_slots(req, 1 + len(drafts)) if drafts else None
        if allocation is None:
            drafts = []
            allocation = self.kv.allocate_slots(req, 1)
            if allocation is None:
                self._schedule_running(step, entry, 1, decode=True)
                return
        budget.remaining -= len(drafts)
        step.add(self._make_seq(req, 1, drafts), True, allocation)

    def _take_prefills(self, step: _Step) -> int:
        """Prefill chunks: running prefills first (admission order), then admissions."""
        num_scheduled = 0
        slo = step.slo
        for entry in list(self._running.values()):
            req = entry.request
            if req.status is not _PREFILLING or req.request_id in step.prefill:
                continue
            if req.request_id in self._parked:
                continue
            start = req.num_computed_tokens
            num_new = min(entry.prefill_target - start, self._max_chunk)
            if slo is not None:
                # The first running prefill always moves by a block at least: its TTFT is
                # bounded even when the decodes fill the target.
                floor = min(num_new, self._block_size) if num_scheduled == 0 else 0
                num_new = max(slo.chunk_limit(num_new, start), floor)
            chunk = step.budget.take_up_to(num_new)
            if chunk == 0:
                return num_scheduled
            if self._schedule_running(step, entry, chunk, decode=False):
                num_scheduled += 1
                if slo is not None:
                    slo.add_chunk(chunk, start)
        while step.budget.remaining > 0:
            head = self._waiting.peek()
            if head is None:
                break
            if self._move_if_late(head):
                continue
            if slo is not None and not slo.admits(head.request):
                break  # its decodes would break the ITL target: defer admission
            if not self._try_admit(step, head):
                break
            num_scheduled += 1
        return num_scheduled

    # -- the slo policy (scheduler.slo) -------------------------------------------------

    def _size_to_target(self, step: _Step, cost: CostPredictor) -> None:
        """The decodes are taken: start sizing the step to its ITL target, and preempt
        decodes (victim rule) while the decodes alone are predicted well over it for a
        second step in a row (one odd prediction preempts nobody)."""
        running = self._running
        margin = self.config.slo_preempt_margin
        while True:
            slo = SloStep.begin(
                cost,
                self.config.itl_slo_s,
                (
                    (running[seq.request_id].request, seq.start_pos, len(seq.token_ids))
                    for seq in step.decode.values()
                ),
                (e.request for e in running.values() if e.request.status is _PREFILLING),
            )
            decodes = StepShape(  # without their drafts: those go before any decode does
                decode_seqs=slo.shape.decode_seqs, decode_context=slo.shape.decode_context
            )
            over = len(step.decode) > 1 and cost.predict(decodes) > slo.target_s * margin
            if not over:
                self._slo_over_steps = 0
                break
            self._slo_over_steps += 1
            if self._slo_over_steps < 2:
                break
            self._preempt(
                step,
                self._victim.choose(e for e in running.values() if e.request_id in step.decode),
            )
        step.slo = slo

    def _move_if_late(self, head: _Entry) -> bool:
        """slo: move the head of the queue back once if it is already past its TTFT
        deadline and others wait behind it (see scheduler.slo); return whether it moved."""
        order = self._deadline
        now_s = self._now_s
        if order is None or now_s is None or head.moved_late or len(self._waiting) < 2:
            return False
        req = head.request
        if not order.is_late(req, now_s):
            return False
        head.moved_late = True
        key = order.late_key(head.rank, head.arrival_seq, req)
        if key <= head.sort_key:  # a forked sample: its key came from a moved parent
            return False
        head.sort_key = key
        self._waiting.requeue(head)
        return True

    def _schedule_running(
        self,
        step: _Step,
        entry: _Entry,
        num_new: int,
        decode: bool,
        allocation: Allocation | None = None,
    ) -> bool:
        """Allocate ``num_new`` slots for a running request (its budget already taken),
        preempting victims while memory is short (the adaptive KV strategy first windows
        the longest requests). False if it was itself the victim.
        ``allocation``: the result of a first ``allocate_slots`` the caller already made."""
        req = entry.request
        if allocation is None:
            allocation = self.kv.allocate_slots(req, num_new)
        while allocation is None:
            if self._reserve:
                raise RuntimeError(
                    f"reserve mode: {req.request_id!r} ran out of its reserved blocks at "
                    f"{req.num_computed_tokens} + {num_new} tokens"
                )
            windowed = self.kv.shrink_retention([e.request for e in self._running.values()])
            if windowed is not None:
                step.refresh_block_ids(windowed, self._block_ids(windowed))
                allocation = self.kv.allocate_slots(req, num_new)
                continue
            victim = self._victim.choose(self._running.values())
            if victim is entry:
                step.budget.give_back(num_new)
                self._preempt(step, entry)
                return False
            self._preempt(step, victim)
            allocation = self.kv.allocate_slots(req, num_new)
        step.add(self._make_seq(req, num_new), decode, allocation)
        return True

    def _try_admit(self, step: _Step, entry: _Entry) -> bool:
        """Admit the head of the waiting queue with a first chunk; False if it must wait."""
        req = entry.request
        max_num_seqs = self.config.max_num_seqs
        while len(self._running) + self._forks.num_held_seats + entry.num_seats > max_num_seqs:
            if not self._preempt_for(step, entry):
                return False
        if not self._may_fit(entry):
            return False
        hit = self.kv.get_computed_blocks(req, self._max_hit_tokens(entry, step.budget.remaining))
        num_hit = hit.num_tokens
        # 0 only for a parent of samples whose prompt, but the last token, is cached.
        chunk = min(entry.prefill_target - num_hit, self._max_chunk, step.budget.remaining)
        slo = step.slo
        if slo is not None:
            chunk = slo.chunk_limit(chunk, num_hit)
            if chunk == 0 and entry.prefill_target > num_hit:
                return False  # no time left in this step
        while (allocation := self._allocate_admission(entry, chunk, hit)) is None:
            if not self._preempt_for(step, entry):
                entry.blocked_at_num_free = self.kv.num_free_blocks
                return False
        entry.blocked_at_num_free = None
        step.budget.take_up_to(chunk)
        self._waiting.pop(entry)
        if req.status is _WAITING:  # first admission (not a resumption after preemption)
            req.num_cached_tokens = num_hit
        req.num_computed_tokens = num_hit
        req.status = _PREFILLING
        entry.num_full_blocks = num_hit // self._block_size
        if self._sliding_window is not None:
            self.kv.release_out_of_window(req)  # hit blocks the first chunk cannot see
        self._running[req.request_id] = entry
        if entry.group is not None:
            self._forks.hold_seats(entry.group)
        if chunk:
            step.add(self._make_seq(req, chunk), False, allocation)
        else:
            self._fork_children(entry)
        if slo is not None:
            slo.add_chunk(chunk, num_hit)
            slo.admit(req)
        return True

    def _max_hit_tokens(self, entry: _Entry, budget: int) -> int | None:
        """The longest prefix hit to use under a sliding window (None: no limit). Hit blocks
        are taken whole, even those the window has left behind (released right after
        admission), so a long hit plus the first chunk could need more blocks than the pool
        has: the hit must leave the hit + first chunk within the per-request window bound."""
        if self._sliding_window is None:
            return None
        bound = self.kv.max_resident_blocks(entry.prefill_target, self._max_chunk)
        if self.kv.num_blocks_for(entry.prefill_target) <= bound:
            return None
        return max(0, bound * self._block_size - min(self._max_chunk, budget))

    def _may_fit(self, entry: _Entry) -> bool:
        """Whether an admission attempt is worth a prefix lookup (hashing the prompt). Every
        admission needs at least one fresh block, and one that failed for memory cannot
        succeed before the free list grows: skip the lookup until then. Under priority order
        an attempt may preempt, so it is always made."""
        if self._order.preempts_for_admission and not self._reserve:
            return True
        num_free = self.kv.num_free_blocks
        blocked_at = entry.blocked_at_num_free
        return num_free > 0 and (blocked_at is None or num_free > blocked_at)

    def _allocate_admission(self, entry: _Entry, chunk: int, hit: PrefixHit) -> Allocation | None:
        """Blocks for the prefix hit and the first chunk; in reserve mode for the whole
        length (prompt + max_tokens) at once. None (nothing changed) if there is no room."""
        if self._reserve:
            return self.kv.reserve_slots(entry.request, entry.max_num_tokens, hit, chunk)
        return self.kv.allocate_slots(entry.request, chunk, hit)

    def _make_seq(
        self, req: Request, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledSeq:
        """The next ``num_new`` tokens of ``req`` to compute (then its speculative
        ``drafts``, if any), with its current block table. The one ``ScheduledSeq``
        constructor: positional, as it runs for every decode."""
        start = req.num_computed_tokens
        end = start + num_new
        all_token_ids = req.all_token_ids
        rid = req.request_id
        return ScheduledSeq(
            rid,
            all_token_ids[start:end] + drafts if drafts else all_token_ids[start:end],
            start,
            self._block_ids(rid),  # a copy
            req.sampling,
            end == len(all_token_ids),
            all_token_ids,
            len(req.prompt_token_ids),
            len(req.output_token_ids),
            req.eos_token_ids,
            len(drafts) if drafts else 0,
        )

    # -- preemption ---------------------------------------------------------------------

    def _preempt_for(self, step: _Step, entry: _Entry) -> bool:
        """Under priority order (and not in reserve mode), preempt the victim if it ranks
        strictly worse than the waiting ``entry``; return whether it did."""
        if self._reserve or not self._order.preempts_for_admission or not self._running:
            return False
        victim = self._victim.choose(self._running.values())
        if victim.rank <= entry.rank:
            return False
        self._preempt(step, victim)
        return True

    def _preempt(self, step: _Step, entry: _Entry) -> None:
        """Free the request's blocks, keep its output tokens, and put it back in the waiting
        queue at its old place (its key is fixed at arrival); it is prefilled again later."""
        req = entry.request
        rid = req.request_id
        step.unschedule(rid)
        del self._running[rid]
        if entry.group is not None:
            self._forks.release_seats(entry.group)
        self.kv.free(rid)
        self._counters.num_preemptions += 1
        self._counters.num_recomputed_tokens += req.num_computed_tokens
        req.num_preemptions += 1
        req.num_computed_tokens = 0
        req.status = _PREEMPTED
        entry.num_full_blocks = 0
        self._waiting.push(entry)
        if entry.forked_ids and not req.output_token_ids:
            # Its samples run on and report: name them now, not at its first token.
            self._pending_outputs.append(_output(entry, [], [], None))

    # -- n > 1 --------------------------------------------------------------------------

    def _fork_children(self, parent_entry: _Entry) -> None:
        """The parent has computed all of its prompt but the last token: fork its n - 1
        samples, sharing its blocks. The parent and every sample are then decoding: each
        computes the last prompt token and samples its own first token."""
        parent = parent_entry.request
        group = parent_entry.group
        assert group is not None and not group.forked, "fork of a request without samples"
        parent.status = _DECODING
        for index, cid in enumerate(group.child_ids, start=1):
            child = make_sample(parent, index, cid)
            self.kv.fork(parent.request_id, cid)
            entry = _Entry(
                request=child,
                rank=parent_entry.rank,
                sort_key=parent_entry.sort_key,
                arrival_seq=parent_entry.arrival_seq,
                index=index,
                moved_late=parent_entry.moved_late,
                num_full_blocks=child.num_computed_tokens // self._block_size,
            )
            self._entries[cid] = entry
            self._running[cid] = entry
        self._forks.fork(group)

    # -- ending -------------------------------------------------------------------------

    def _finish(
        self,
        entry: _Entry,
        status: RequestStatus,
        new_token_ids: list[int] | None = None,
        new_logprobs: list[TokenLogprobs] | None = None,
        error: str | None = None,
    ) -> RequestOutput:
        """Move a request to a finished ``status`` and free its blocks (exactly once: only a
        running request holds blocks, and it leaves the running set here). Returns its final
        output, with the tokens of this step if it ended in ``update``."""
        req = entry.request
        rid = req.request_id
        if self._running.get(rid) is entry:
            del self._running[rid]
            self.kv.free(rid)
        else:
            self._waiting.discard(entry)
        req.status = status
        del self._entries[rid]
        self._parked.discard(rid)
        if entry.group is not None:
            self._forks.close(entry.group)
        self._finished_ids.append(rid)
        reason = req.finish_reason
        assert reason is not None, f"{status} is not a finished status"
        self._counters.num_finished[reason.value] += 1
        return _output(entry, new_token_ids or [], new_logprobs or [], reason, error)

    # -- stats --------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        """A snapshot after the last step (batch composition of the last plan)."""
        c = self._counters
        waiting = self._waiting
        return SchedulerStats(
            step_id=self._step_id,
            num_running=len(self._running),
            num_waiting=waiting.num_requests,
            num_preempted=waiting.num_preempted,
            num_prefill_tokens=c.num_prefill_tokens,
            num_prefill_reqs=c.num_prefill_reqs,
            num_decode_reqs=c.num_decode_reqs,
            num_steps_prefill_total=c.num_steps_prefill,
            num_steps_decode_total=c.num_steps_decode,
            num_preemptions_total=c.num_preemptions,
            num_recomputed_tokens_total=c.num_recomputed_tokens,
            num_prompt_tokens_total=c.num_prompt_tokens,
            num_generation_tokens_total=c.num_generation_tokens,
            num_finished_total=dict(c.num_finished),
            waiting_tokens=waiting.num_tokens,
            kv=self.kv.make_stats(),
            num_parked=len(self._parked),
            num_spec_draft_tokens_total=c.num_spec_draft_tokens,
            num_spec_accepted_tokens_total=c.num_spec_accepted_tokens,
        )
