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

``update`` applies the result batch by batch (``scheduler.update.ResultApplier``). The engine
may plan the next step before it applies this one (one step ahead: ``scheduler.entry``).

Speculative decoding (``speculative="ngram"``): a decode carries up to k drafts from
``scheduler.spec.NgramDrafter``, counted in the step's token budget and given KV slots like
any token (drafts never preempt: without room the decode runs alone). ``update`` appends the
accepted drafts and the token sampled after them, and rolls back the KV of the rejected ones.

Request states: ``WAITING -> PREFILLING -> DECODING -> FINISHED_*``, and
``PREFILLING|DECODING -> PREEMPTED`` (back in the waiting queue, at its old place in line)
``-> PREFILLING``. Preemption is by recompute: the blocks are freed, the output tokens kept,
and the whole sequence is prefilled again (cheap with the prefix cache): ``scheduler.preemption``.
"""

from __future__ import annotations

from collections.abc import Iterator

from cache_manager import Allocation, KVCacheManager, PrefixHit
from scheduler.admission import check_can_ever_run, check_not_overloaded, max_hit_tokens, may_fit
from scheduler.config import SchedulerConfig
from scheduler.cost_model import CostPredictor
from scheduler.entry import Counters, Entry, StepPlan, check_in_flight, make_output, make_seq
from scheduler.fork import ForkTable, make_sample
from scheduler.lora import LoraAdmission, running_adapters
from scheduler.output import (
    ModelOutput,
    RequestOutput,
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
from scheduler.preemption import Preemption
from scheduler.queue import WaitingQueue
from scheduler.request import Request, RequestStatus
from scheduler.slo import SloStep, UnsizedStep, make_slo_planner
from scheduler.spec import NgramDrafter
from scheduler.update import ResultApplier

_WAITING = RequestStatus.WAITING
_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING
_FINISHED_STOPPED = RequestStatus.FINISHED_STOPPED
_FINISHED_ABORTED = RequestStatus.FINISHED_ABORTED
_FINISHED_ERROR = RequestStatus.FINISHED_ERROR
_NUM_WEIGHED = 16  # waiting requests the slo policy weighs against a step's decodes


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
        self.config = config
        self.kv = kv
        self._block_size = kv.block_size
        self._releases = kv.releases_out_of_window
        self._window_tables = kv.has_window_tables
        self._reserve = config.memory_mode == "reserve"
        self._max_chunk = config.max_chunk_tokens
        self._num_usable_blocks = kv.num_usable_blocks
        self._block_ids = kv.block_ids
        self._policy = make_batch_policy(config)
        self._order = make_queue_order(config)
        self._victim = make_victim_rule(config)
        self._slo = make_slo_planner(config, cost_model, self._order)
        self._lora = LoraAdmission(config.max_loras, config.aging_steps)
        self._drafter: NgramDrafter | None = None
        if config.speculative == "ngram":
            self._drafter = NgramDrafter(
                config.num_speculative_tokens, config.ngram_max, config.ngram_min
            )

        self._entries: dict[str, Entry] = {}  # every unfinished request
        self._forks = ForkTable()
        self._running: dict[str, Entry] = {}  # admission order
        self._waiting: WaitingQueue[Entry] = WaitingQueue()
        self._finished_ids: list[str] = []
        self._pending_outputs: list[RequestOutput] = []  # finished outside update()
        self._parked: set[str] = set()  # not scheduled until unparked (backpressure)
        self._step_id = 0
        self._arrival_seq = 0
        self._counters = Counters()
        self._results = ResultApplier(
            self._running, kv, self._counters, self._finish, self._fork_children
        )
        self._preemption = Preemption(
            kv, self._running, self._waiting, self._forks, self._counters, self._victim,
            self._order, self._reserve, lambda out: self._pending_outputs.append(out),
        )  # fmt: skip
        self._preempt = self._preemption.preempt
        self._preempt_for = self._preemption.preempt_for

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
        group = check_can_ever_run(request, self.config, self.kv, self._id_in_use)
        check_not_overloaded(self.config, self._waiting, request)
        rank = self._order.rank(request.priority, self._step_id)
        entry = Entry(
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
        self._slo.begin(now_s)
        step = StepPlan(self._step_id, TokenBudget(self.config.max_num_batched_tokens))
        policy = self._policy
        took_decodes = False
        for kind in policy.order(self._has_decoding):
            if kind is BatchKind.DECODE:
                took_decodes = True
                num_scheduled = self._take_decodes(step)
                step.slo = self._size_to_target(step)
            else:
                num_scheduled = self._take_prefills(step)
            if num_scheduled and policy.exclusive:
                break
        policy.observe(took_decodes, self._has_decoding)
        if not step.prefill and not step.decode and self._has_decoding():
            # Samples forked at admission (n > 1 with nothing left to prefill) turned
            # DECODING after the decodes were taken: run them now, not after an idle wait.
            self._take_decodes(step)
        plan = step.build(self._finished_ids, self.kv.null_block_id, self._running)
        if self._window_tables:
            for seq in (*plan.prefill, *plan.decode):  # their tables as this plan left them
                seq.window_block_ids = self.kv.window_block_ids(seq.request_id)
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
        self._results.apply(plan.prefill, result, outputs, prefill=True)
        self._results.apply(plan.decode, result, outputs, prefill=False)
        return outputs

    # -- batch formation (the kinds the policy orders) -----------------------------------

    def _has_decoding(self) -> bool:
        """Whether a running request decodes next (or its sampling chunk is in flight)."""
        return any(
            e.request.status is _DECODING or e.samples_in_flight for e in self._running.values()
        )

    def _take_decodes(self, step: StepPlan) -> int:
        """One token for every decoding request, in admission order."""
        budget = step.budget
        allocate_slots = self.kv.allocate_slots
        block_ids = self._block_ids
        decode = step.decode
        num_before = len(decode)
        decoding = _DECODING
        parked = self._parked
        remaining = budget.remaining  # a local on the hot path; synced around the slow one
        for entry in list(self._running.values()):
            req = entry.request
            ahead = entry.samples_in_flight  # its input token is sampled in flight
            if req.status is not decoding and not ahead:  # prefilling, or preempted meanwhile
                continue
            if parked and req.request_id in parked:
                continue
            if remaining == 0:
                break
            if ahead:
                if entry.num_tokens_ahead >= entry.max_num_tokens:
                    continue  # the token in flight is its last: never planned past max_tokens
            elif self._drafter is not None:
                budget.remaining = remaining
                self._take_speculative_decode(step, entry)
                remaining = budget.remaining
                continue
            remaining -= 1
            allocation = allocate_slots(req, entry.slots_for(1))
            if allocation is None or allocation.block_copies:  # preempt, or copy on write
                budget.remaining = remaining
                self._schedule_running(step, entry, 1, decode=True, allocation=allocation)
                remaining = budget.remaining
            else:
                rid = req.request_id
                decode[rid] = make_seq(entry, 1, block_ids(rid))
        budget.remaining = remaining
        return len(decode) - num_before

    def _take_speculative_decode(self, step: StepPlan, entry: Entry) -> None:
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
        step.add_decode(make_seq(entry, 1, self._block_ids(req.request_id), drafts), allocation)

    def _take_prefills(self, step: StepPlan) -> int:
        """Prefill chunks: running prefills first (admission order), then admissions.

        Under the ``slo`` policy a running prefill that can no longer make its TTFT (its
        rest, prefilled alone from now, is predicted past its deadline) goes last, after the
        admissions: the step's prefill time goes to prompts that can still make theirs. It
        still moves by a block every step, so it cannot starve."""
        num_scheduled = 0
        sized = step.slo
        self._slo.stretch(sized, self._prompts_waiting())
        lost: list[Entry] = []
        for entry in list(self._running.values()):
            req = entry.request
            if req.status is not _PREFILLING or req.request_id in step.prefill:
                continue
            if req.request_id in self._parked or entry.samples_in_flight:
                continue  # parked, or its last chunk samples in flight (a decode next)
            if self._slo.ttft_lost(req):
                lost.append(entry)
                continue
            # The first running prefill always moves by a block at least: its TTFT is bounded
            # even when the decodes fill the slo policy's target.
            scheduled = self._take_chunk(step, entry, first=num_scheduled == 0)
            if scheduled is None:
                return num_scheduled
            num_scheduled += scheduled
        while step.budget.remaining > 0:
            head = self._next_admission()
            if head is None:
                break
            if self._slo.move_if_late(head, len(self._waiting)):
                self._waiting.requeue(head)
                continue
            if not sized.admits(head.request):
                break  # its decodes would break the ITL target: defer admission
            if not self._try_admit(step, head):
                break
            num_scheduled += 1
        first = True
        for entry in lost:
            req = entry.request
            if req.status is not _PREFILLING or req.request_id in step.prefill:
                continue  # preempted by an admission above (and maybe admitted again)
            scheduled = self._take_chunk(step, entry, first=first)
            first = False
            if scheduled is None:
                break
            num_scheduled += scheduled
        return num_scheduled

    def _next_admission(self) -> Entry | None:
        """The waiting request to admit next: the head, unless LoRA requests wait, when the
        ``max_loras`` rule may pick one behind it (``scheduler.lora``)."""
        if not self._waiting.num_with_adapters:
            return self._waiting.peek()
        running = running_adapters(e.request for e in self._running.values())
        return self._lora.choose(self._waiting, running, self._step_id)

    def _take_chunk(self, step: StepPlan, entry: Entry, *, first: bool) -> int | None:
        """A running prefill's next chunk, as long as the step's limit allows (at least a
        block when ``first``); 1 if scheduled, 0 if not, None when the budget is spent."""
        start = entry.next_pos
        num_new = min(entry.prefill_target - start, self._max_chunk)
        if num_new <= 0:
            return 0  # every chunk up to its target is in flight (planned ahead)
        floor = min(num_new, self._block_size) if first else 0
        num_new = max(step.slo.chunk_limit(num_new, start), floor)
        chunk = step.budget.take_up_to(num_new)
        if chunk == 0:
            return None
        if not self._schedule_running(step, entry, chunk, decode=False):
            return 0
        step.slo.add_chunk(chunk, start)
        return 1

    # -- the slo policy (scheduler.slo) -------------------------------------------------

    def _prompts_waiting(self) -> Iterator[Request]:
        """Requests waiting for their first token, lazily: the running prefills, then the
        first ``_NUM_WEIGHED`` of the waiting queue (the step can serve no more than those)."""
        for entry in self._running.values():
            if entry.request.status is _PREFILLING:
                yield entry.request
        for entry in self._waiting.head(_NUM_WEIGHED):
            yield entry.request

    def _size_to_target(self, step: StepPlan) -> SloStep | UnsizedStep:
        """The decodes are taken: start sizing the step to its ITL target, preempting decodes
        (victim rule) while the planner says they alone are over it."""
        running = self._running
        while True:
            sized = self._slo.size(
                (
                    (running[seq.request_id].request, seq.start_pos, len(seq.token_ids))
                    for seq in step.decode.values()
                ),
                (e.request for e in running.values() if e.request.status is _PREFILLING),
            )
            if not self._slo.should_preempt(sized, len(step.decode)):
                return sized
            self._preempt(
                step,
                self._victim.choose(e for e in running.values() if e.request_id in step.decode),
            )

    def _schedule_running(
        self,
        step: StepPlan,
        entry: Entry,
        num_new: int,
        decode: bool,
        allocation: Allocation | None = None,
    ) -> bool:
        """Allocate ``num_new`` slots for a running request (its budget already taken),
        preempting victims while memory is short (the adaptive KV strategy first windows
        the longest requests). False if it was itself the victim, or if it has a step in
        flight and no room: running ahead never preempts (that step's work would be lost
        again and again); it waits for the step to be applied.
        ``allocation``: the result of a first ``allocate_slots`` the caller already made."""
        req = entry.request
        num_slots = entry.slots_for(num_new)  # past the computed tokens
        if allocation is None:
            allocation = self.kv.allocate_slots(req, num_slots)
        if allocation is None and entry.in_flight:
            step.budget.give_back(num_new)
            return False
        if allocation is None:
            allocation = self._preemption.make_room(step, entry, num_slots, num_new)
            if allocation is None:
                return False  # it was the victim
        seq = make_seq(entry, num_new, self._block_ids(req.request_id))
        if decode:
            step.add_decode(seq, allocation)
        else:
            step.add_prefill(seq, allocation)
        return True

    def _try_admit(self, step: StepPlan, entry: Entry) -> bool:
        """Admit the head of the waiting queue with a first chunk; False if it must wait."""
        req = entry.request
        max_num_seqs = self.config.max_num_seqs
        while len(self._running) + self._forks.num_held_seats + entry.num_seats > max_num_seqs:
            if not self._preempt_for(step, entry):
                return False
        if not may_fit(entry, self.kv, self._order.preempts_for_admission and not self._reserve):
            return False
        max_hit = max_hit_tokens(entry, self.kv, self._max_chunk, step.budget.remaining)
        hit = self.kv.get_computed_blocks(req, max_hit)
        num_hit = hit.num_tokens
        # 0 only for a parent of samples whose prompt, but the last token, is cached.
        chunk = min(entry.prefill_target - num_hit, self._max_chunk, step.budget.remaining)
        sized = step.slo
        chunk = sized.chunk_limit(chunk, num_hit)
        if chunk == 0 and entry.prefill_target > num_hit:
            return False  # no time left in this step
        while (allocation := self._allocate_admission(entry, chunk, hit)) is None:
            if not self._preempt_for(step, entry):
                entry.blocked_at_num_free = self.kv.num_free_blocks
                return False
        entry.blocked_at_num_free = None
        step.budget.take_up_to(chunk)
        self._waiting.take(entry)
        if req.status is _WAITING:  # first admission (not a resumption after preemption)
            req.num_cached_tokens = num_hit
        req.num_computed_tokens = num_hit
        req.status = _PREFILLING
        if self._releases:
            self.kv.release_out_of_window(req)  # hit blocks the first chunk cannot see
        self._running[req.request_id] = entry
        if entry.group is not None:
            self._forks.hold_seats(entry.group)
        if chunk:
            step.add_prefill(make_seq(entry, chunk, self._block_ids(req.request_id)), allocation)
        else:
            self._fork_children(entry)
        sized.add_chunk(chunk, num_hit)
        sized.admit(req)
        return True

    def _allocate_admission(self, entry: Entry, chunk: int, hit: PrefixHit) -> Allocation | None:
        """Blocks for the prefix hit and the first chunk; in reserve mode for the whole
        length (prompt + max_tokens) at once. None (nothing changed) if there is no room."""
        if self._reserve:
            return self.kv.reserve_slots(entry.request, entry.max_num_tokens, hit, chunk)
        return self.kv.allocate_slots(entry.request, chunk, hit)

    # -- n > 1 --------------------------------------------------------------------------

    def _fork_children(self, parent_entry: Entry) -> None:
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
            entry = Entry(
                request=child,
                rank=parent_entry.rank,
                sort_key=parent_entry.sort_key,
                arrival_seq=parent_entry.arrival_seq,
                index=index,
                moved_late=parent_entry.moved_late,
            )
            self._entries[cid] = entry
            self._running[cid] = entry
        self._forks.fork(group)

    # -- ending -------------------------------------------------------------------------

    def _finish(
        self,
        entry: Entry,
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
        return make_output(entry, new_token_ids or [], new_logprobs or [], reason, error)

    def check_invariants(self) -> None:
        """For tests: the cache manager's invariants and the requests' in-flight seqs."""
        self.kv.check_invariants()
        check_in_flight(self._entries, self._running, self.kv)

    # -- stats --------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        """A snapshot after the last step (batch composition of the last plan)."""
        lora_running: dict[str, int] = {}  # by adapter; "" the base model
        for entry in self._running.values():
            ref = entry.request.lora
            name = "" if ref is None else ref.name
            lora_running[name] = lora_running.get(name, 0) + 1
        return self._counters.snapshot(
            self._step_id, len(self._running), self._waiting, len(self._parked), self.kv,
            lora_running,
        )  # fmt: skip
