"""The scheduler's small strategies, each with one job, chosen by ``SchedulerConfig``.

- ``TokenBudget``: the token budget of one step.
- Batch formation (``StallFree``, ``PrefillFirst``): the order of the batch kinds a step
  forms (``BatchKind``).
- Queue order (``FcfsOrder``, ``PriorityOrder``; the ``slo`` policy's ``DeadlineOrder``):
  the order of the waiting queue, and the effective priority (``rank``) that preemption
  decisions compare.
- Victim rule (``LowestPriorityVictim``, ``NewestVictim``): whom to preempt.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from scheduler.config import SchedulerConfig
from scheduler.request import Request
from scheduler.slo import DeadlineOrder


class TokenBudget:
    """Tokens one step may still schedule (prefill chunk tokens + one per decode)."""

    __slots__ = ("remaining",)

    def __init__(self, num_tokens: int) -> None:
        self.remaining = num_tokens

    def take_up_to(self, num_tokens: int) -> int:
        """Take as many of ``num_tokens`` as fit and return how many."""
        taken = min(num_tokens, self.remaining)
        self.remaining -= taken
        return taken

    def give_back(self, num_tokens: int) -> None:
        self.remaining += num_tokens


# -- batch formation ------------------------------------------------------------------------


class BatchKind(enum.Enum):
    """The two batches of a step: one token per decoding request, or prefill chunks
    (running prefills first, then admissions from the waiting queue)."""

    DECODE = "decode"
    PREFILL = "prefill"


# Whether some running request has finished its prefill and waits for its next token.
PendingDecodes = Callable[[], bool]


class BatchPolicy(Protocol):
    """Which batches a step forms, in what order. ``schedule()`` takes the kinds ``order``
    returns in turn, each within the budget the earlier ones left; with ``exclusive`` it
    stops after the first kind that scheduled something. Then it calls ``observe``."""

    exclusive: bool

    def order(self, has_pending_decodes: PendingDecodes) -> tuple[BatchKind, ...]: ...

    def observe(self, took_decodes: bool, has_pending_decodes: PendingDecodes) -> None:
        """The step is formed; ``took_decodes``: the decode batch was taken."""
        ...


class StallFree:
    """Every step runs the whole decode batch; the leftover budget takes prefill chunks.

    A long prompt is then prefilled a chunk at a time alongside the running streams, which
    each still get a token every step (Sarathi-Serve's stall-free batching).
    """

    exclusive = False

    def order(self, has_pending_decodes: PendingDecodes) -> tuple[BatchKind, ...]:
        return (BatchKind.DECODE, BatchKind.PREFILL)

    def observe(self, took_decodes: bool, has_pending_decodes: PendingDecodes) -> None:
        pass


class PrefillFirst:
    """A prefill batch whenever one fits, otherwise the decode batch.

    Starvation guard: after ``max_starvation_steps`` consecutive steps in which decodes were
    pending but not run, the next step runs the decode batch only.
    """

    exclusive = True

    def __init__(self, max_starvation_steps: int) -> None:
        self.max_starvation_steps = max_starvation_steps
        self.starved_steps = 0

    def order(self, has_pending_decodes: PendingDecodes) -> tuple[BatchKind, ...]:
        if self.starved_steps >= self.max_starvation_steps and has_pending_decodes():
            return (BatchKind.DECODE,)
        return (BatchKind.PREFILL, BatchKind.DECODE)

    def observe(self, took_decodes: bool, has_pending_decodes: PendingDecodes) -> None:
        if took_decodes or not has_pending_decodes():
            self.starved_steps = 0
        else:
            self.starved_steps += 1


def make_batch_policy(config: SchedulerConfig) -> BatchPolicy:
    if config.policy in ("stall-free", "slo"):  # slo: stall-free, sized by scheduler.slo
        return StallFree()
    return PrefillFirst(config.max_decode_starvation_steps)


# -- queue order ----------------------------------------------------------------------------


class QueueOrder(Protocol):
    """Orders the waiting queue. Keys are fixed at arrival, so the queue is a plain heap."""

    preempts_for_admission: bool  # may a waiting request preempt a running one of worse rank

    def rank(self, priority: int, arrival_step: int) -> int:
        """Effective priority (lower = more important); compared by preemption decisions."""
        ...

    def sort_key(self, rank: int, arrival_seq: int, request: Request) -> int:
        """Waiting-queue key (ties broken by arrival); the smallest runs first."""
        ...


class FcfsOrder:
    """Arrival order. Waiting requests never preempt running ones."""

    preempts_for_admission = False

    def rank(self, priority: int, arrival_step: int) -> int:
        return priority

    def sort_key(self, rank: int, arrival_seq: int, request: Request) -> int:
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

    def sort_key(self, rank: int, arrival_seq: int, request: Request) -> int:
        return rank


def make_queue_order(config: SchedulerConfig) -> QueueOrder:
    if config.policy == "slo":
        return DeadlineOrder(config)
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
