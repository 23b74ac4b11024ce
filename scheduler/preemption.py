"""Preemption by recompute: who gives up blocks or a seat when a step runs short.

    a running request short of blocks -> Preemption.make_room: the adaptive KV strategy
        windows the longest requests first, then the victim rule's choice is preempted
        (possibly the request itself), until the allocation succeeds
    an admission short of a seat or blocks (priority order) -> Preemption.preempt_for: the
        victim, if it ranks strictly worse than the waiting request

A preempted request's blocks are freed and its output tokens kept; it goes back in the
waiting queue at its old place (its key is fixed at arrival) and is prefilled again later
(cheap with the prefix cache). Reserve mode never preempts: a request holds its whole
length from admission.
"""

from __future__ import annotations

from collections.abc import Callable

from cache_manager import Allocation, KVCacheManager
from scheduler.entry import Counters, Entry, StepPlan, make_output
from scheduler.fork import ForkTable
from scheduler.output import RequestOutput
from scheduler.policies import QueueOrder, VictimRule
from scheduler.queue import WaitingQueue
from scheduler.request import RequestStatus


class Preemption:
    """Preempts into the scheduler's own tables (it shares them; see the module docstring).
    ``report``: takes the output of a preempted parent whose samples run on."""

    def __init__(
        self,
        kv: KVCacheManager,
        running: dict[str, Entry],
        waiting: WaitingQueue[Entry],
        forks: ForkTable,
        counters: Counters,
        victim: VictimRule,
        order: QueueOrder,
        reserve: bool,
        report: Callable[[RequestOutput], None],
    ) -> None:
        self.kv = kv
        self._running = running
        self._waiting = waiting
        self._forks = forks
        self._counters = counters
        self._victim = victim
        self._order = order
        self._reserve = reserve
        self._report = report

    def make_room(
        self, step: StepPlan, entry: Entry, num_slots: int, num_new: int
    ) -> Allocation | None:
        """``num_slots`` slots (past its computed tokens) for a running ``entry`` whose first
        allocation failed, its ``num_new`` tokens' budget already taken: windows, then
        victims, until they fit. None if ``entry`` was itself the victim (its budget given
        back)."""
        kv = self.kv
        req = entry.request
        while True:
            if self._reserve:
                raise RuntimeError(
                    f"reserve mode: {req.request_id!r} ran out of its reserved blocks at "
                    f"{req.num_computed_tokens} + {num_new} tokens"
                )
            windowed = kv.shrink_retention([e.request for e in self._running.values()])
            if windowed is not None:
                step.refresh_block_ids(windowed, kv.block_ids(windowed))
            else:
                victim = self._victim.choose(self._running.values())
                if victim is entry:
                    step.budget.give_back(num_new)
                    self.preempt(step, entry)
                    return None
                self.preempt(step, victim)
            allocation = kv.allocate_slots(req, num_slots)
            if allocation is not None:
                return allocation

    def preempt_for(self, step: StepPlan, entry: Entry) -> bool:
        """Under priority order (and not in reserve mode), preempt the victim if it ranks
        strictly worse than the waiting ``entry``; return whether it did."""
        if self._reserve or not self._order.preempts_for_admission or not self._running:
            return False
        victim = self._victim.choose(self._running.values())
        if victim.rank <= entry.rank:
            return False
        self.preempt(step, victim)
        return True

    def preempt(self, step: StepPlan, entry: Entry) -> None:
        """Free the request's blocks, keep its output tokens, and put it back in the waiting
        queue at its old place; it is prefilled again later."""
        req = entry.request
        rid = req.request_id
        step.unschedule(rid)
        del self._running[rid]
        if entry.group is not None:
            self._forks.release_seats(entry.group)
        self.kv.free(rid)
        self._counters.num_preemptions += 1
        self._counters.num_recomputed_tokens += req.num_computed_tokens
        entry.drop_pending()  # a step in flight computes for it in vain
        req.num_preemptions += 1
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self._waiting.push(entry)
        if entry.forked_ids and not req.output_token_ids:
            # Its samples run on and report: name them now, not at its first token.
            self._report(make_output(entry, [], [], None))
