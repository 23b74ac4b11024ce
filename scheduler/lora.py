"""The ``max_loras`` admission rule: at most that many distinct LoRA adapters among the
running requests, so no step holds more (vLLM's ``--max-loras``; SGLang's
``--max-loras-per-batch``).

A waiting request whose adapter would be one too many waits; requests behind it whose adapter
is already running, or that run the base model, are admitted past it. Aging, so that no
adapter starves: once a request has waited ``aging_steps`` steps for an adapter slot, only
base-model requests may pass it. The running adapters then drain (their requests end; no new
ones join them), a slot frees, and it goes first, being first in line::

    waiting  [ r1 (adapter C) | r2 (A) | r3 (base) | r4 (B) ]     running adapters {A, B},
                                                                  max_loras = 2
    step t   r1 waits (C would be a third); r2, r3, r4 are admitted past it
    t + aging_steps: r1 has waited long enough; only base requests pass it now; when A's or
             B's last request ends, r1 is admitted
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from scheduler.queue import Waiter, WaitingQueue
from scheduler.request import Request

# The adapter label of requests that run the base model, in the metrics and the fronts' lists
# (the scheduler's snapshot counts them under ""); no adapter may take the name.
BASE_ADAPTER_LABEL = "base"
# Waiting requests looked at for one admission: far more than one step admits.
SCAN_LIMIT = 256


class LoraWaiter(Waiter, Protocol):
    lora_blocked_since: int | None  # the step it first waited for an adapter slot


E = TypeVar("E", bound=LoraWaiter)


def running_adapters(requests: Iterable[Request]) -> set[str]:
    return {r.lora.name for r in requests if r.lora is not None}


class LoraAdmission:
    """Picks the next waiting request to admit under ``max_loras`` (see the module doc)."""

    def __init__(self, max_loras: int, aging_steps: int) -> None:
        self.max_loras = max_loras
        self.aging_steps = aging_steps

    def choose(self, waiting: WaitingQueue[E], running: set[str], step_id: int) -> E | None:
        """The first waiting request, in queue order, whose adapter fits beside ``running``
        (the adapters of the running requests); None when none may be admitted now."""
        free = self.max_loras - len(running)
        base_only = False
        for entry in waiting.head(SCAN_LIMIT):
            ref = entry.request.lora
            if ref is None:
                return entry
            if base_only:
                continue
            if ref.name in running or free > 0:
                entry.lora_blocked_since = None
                return entry
            if entry.lora_blocked_since is None:
                entry.lora_blocked_since = step_id
            if step_id - entry.lora_blocked_since >= self.aging_steps:
                base_only = True  # it has waited long enough: no other adapter passes it
        return None
