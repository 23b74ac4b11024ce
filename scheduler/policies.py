"""The scheduler's small strategies, each with one job, chosen by ``SchedulerConfig``.

- ``TokenBudget``: the token budget of one step.
- Batch formation (``StallFree``, ``PrefillFirst``): which batches run this step, in what order.
- Queue order (``FcfsOrder``, ``PriorityOrder``): the order of the waiting queue, and the
  effective priority (``rank``) that preemption decisions compare.
- Victim rule (``LowestPriorityVictim``, ``NewestVictim``): whom to preempt.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from scheduler.config import SchedulerConfig


class TokenBudget:
    """Tokens one step may still schedule (prefill chunk tokens + one per decode)."""

    __slots__ = ("remaining",)

    def __init__(self, num_tokens: int) -> None:
        self.remaining = num_tokens

    def try_take(self, num_tokens: int) -> bool:
        """Take ``num_tokens`` if they all fit; return whether they did."""
        if num_tokens > self.remaining:
            return False
        self.remaining -= num_tokens
        return True

    def take_up_to(self, num_tokens: int) -> int:
        """Take as many of ``num_tokens`` as fit and return how many."""
        taken = min(num_tokens, self.remaining)
        self.remaining -= taken
        return taken

    def give_back(self, num_tokens: int) -> None:
        self.remaining += num_tokens


# -- batch formation ------------------------------------------------------------------------


class StepBuilder(Protocol):
    """What a batch-formation policy may do while one step's plan is being built."""

    @property
    def has_pending_decodes(self) -> bool:
        """Some running request has finished its prefill and waits for its next token."""
        ...

    def take_decodes(self) -> int:
        """Schedule one token for every decoding request; return how many were scheduled."""
        ...

    def take_prefills(self) -> int:
        """Schedule prefill chunks (running prefills first, then admissions from the waiting
        queue) within the leftover budget; return how many requests got a chunk."""
        ...


class BatchPolicy(Protocol):
    def form(self, step: StepBuilder) -> None: ...


class StallFree:
    """Every step runs the whole decode batch; the leftover budget takes prefill chunks.

    A long prompt is then prefilled a chunk at a time alongside the running streams, which
    each still get a token every step (Sarathi-Serve's stall-free batching).
    """

    def form(self, step: StepBuilder) -> None:
        step.take_decodes()
        step.take_prefills()


class PrefillFirst:
    """A prefill batch whenever one fits, otherwise the decode batch.

    Starvation guard: after ``max_starvation_steps`` consecutive steps in which decodes were
    pending but not run, the next step runs the decode batch only.
    """

    def __init__(self, max_starvation_steps: int) -> None:
        self.max_starvation_steps = max_starvation_steps
        self.starved_steps = 0

    def form(self, step: StepBuilder) -> None:
        if self.starved_steps >= self.max_starvation_steps and step.has_pending_decodes:
            step.take_decodes()
            self.starved_steps = 0
            return
        if step.take_prefills() == 0:
            step.take_decodes()
            self.starved_steps = 0
        elif step.has_pending_decodes:
            self.starved_steps += 1
        else:
            self.starved_steps = 0


def make_batch_policy(config: SchedulerConfig) -> BatchPolicy:
    if config.policy == "stall-free":
        return StallFree()
    return PrefillFirst(config.max_decode_starvation_steps)


# -- queue order ----------------------------------------------------------------------------


class QueueOrder(Protocol):
    """Orders the waiting queue. Keys are fixed at arrival, so the queue is a plain heap."""

    preempts_for_admission: bool  # may a waiting request preempt a running one of worse rank

    def rank(self, priority: int, arrival_step: int) -> int:
        """Effective priority (lower = more important); compared by preemption decisions."""
        ...

    def sort_key(self, rank: int, arrival_seq: int) -> int:
        """Waiting-queue key (ties broken by arrival); the smallest runs first."""
        ...


class FcfsOrder:
    """Arrival order. Waiting requests never preempt running ones."""

    preempts_for_admission = False

    def rank(self, priority: int, arrival_step: int) -> int:
        return priority

    def sort_key(self, rank: int, arrival_seq: int) -> int:
        return arrival_seq


class PriorityOrder:
    """Lower priority value first, ties by arrival, with aging.

    The effective priority improves by 1 for every ``aging_steps`` steps a request has been
    in the system. Comparing ``priority - (now - arrival_step) / aging_steps`` between two
    requests does not depend on ``now``, so the rank is fixed at arrival as
    ``priority + arrival_step // aging_steps`` (aging counted in whole epochs of
    ``aging_steps`` steps). A request that arrived ``k * aging_steps`` steps earlier than
    another ranks like one of priority ``k`` lower. Preempted requests keep their rank and so
    their place in line.
    """

    preempts_for_admission = True

    def __init__(self, aging_steps: int) -> None:
        self.aging_steps = aging_steps

    def rank(self, priority: int, arrival_step: int) -> int:
        if self.aging_steps == 0:
            return priority
        return priority + arrival_step // self.aging_steps

    def sort_key(self, rank: int, arrival_seq: int) -> int:
        return rank


def make_queue_order(config: SchedulerConfig) -> QueueOrder:
    if config.queue_order == "fcfs":
        return FcfsOrder()
    return PriorityOrder(config.aging_steps)


# -- preemption victim ----------------------------------------------------------------------


class Candidate(Protocol):
    """What a victim rule sees of a running request."""

    @property
    def rank(self) -> int: ...
    @property
    def arrival(self) -> tuple[int, int]: ...  # (arrival sequence number, sample index)
    @property
    def num_computed_tokens(self) -> int: ...


C = TypeVar("C", bound=Candidate)


class VictimRule(Protocol):
    def choose(self, running: Iterable[C]) -> C:
        """The running request to preempt next (``running`` is not empty)."""
        ...


class LowestPriorityVictim:
    """The worst effective priority, then the fewest computed tokens (least work lost),
    then the latest arrival."""

    def choose(self, running: Iterable[C]) -> C:
        return max(running, key=lambda c: (c.rank, -c.num_computed_tokens, c.arrival))


class NewestVictim:
    """The worst effective priority, then the latest arrival (vLLM's rule; with equal
    priorities, the last admitted in FCFS terms).

    Rank comes first in every rule: a running request must never preempt one of better
    effective priority, or a waiting request of better rank would preempt it straight back
    and the two would preempt each other forever.
    """

    def choose(self, running: Iterable[C]) -> C:
        return max(running, key=lambda c: (c.rank, c.arrival))


def make_victim_rule(config: SchedulerConfig) -> VictimRule:
    if config.preemption == "priority":
        return LowestPriorityVictim()
    return NewestVictim()
