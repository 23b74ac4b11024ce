"""The waiting queue: requests not running, in the order they are admitted.

A heap keyed at arrival, ``(sort_key, arrival_seq, index)`` (``policies.QueueOrder`` fixes the
key once, so no entry ever moves). A request that ends while it waits is discarded lazily::

    heap   [ live | discarded | live | live | discarded ... ]
    counts   exact at all times: requests, prompt tokens still to compute, preempted ones

Its item stays in the heap and is dropped when it reaches the head, or all at once when such
items are the majority. The ``slo`` policy moves a late request back once (``requeue`` after
its key changed): its old item is then stale (its key is not the entry's) and is dropped the
same way.
"""

from __future__ import annotations

import heapq
from typing import Generic, Protocol, TypeVar

from scheduler.request import Request, RequestStatus

_PREEMPTED = RequestStatus.PREEMPTED
_COMPACT_MIN_DISCARDED = 64


class Waiter(Protocol):
    """What the queue reads of an entry: its fixed key and its request."""

    @property
    def sort_key(self) -> int: ...
    @property
    def arrival_seq(self) -> int: ...
    @property
    def index(self) -> int: ...  # sample index: ties between the samples of one request
    @property
    def request(self) -> Request: ...


W = TypeVar("W", bound=Waiter)


class WaitingQueue(Generic[W]):
    """Waiting entries in admission order, with exact counts; see the module docstring."""

    __slots__ = (
        "_adapters",
        "_discarded",
        "_heap",
        "_num_stale",
        "_tenants",
        "num_preempted",
        "num_requests",
        "num_tokens",
    )

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, int, W]] = []
        self._discarded: set[int] = set()  # id() of discarded entries still in the heap
        self._num_stale = 0  # items left behind by ``requeue``
        self.num_requests = 0
        self.num_tokens = 0  # tokens still to compute (all of them: nothing waiting holds KV)
        self.num_preempted = 0  # waiting again after a preemption
        self._tenants: dict[str, list[int]] = {}  # tenant -> [requests, tokens] (non-zero)
        self._adapters: dict[str, int] = {}  # LoRA adapter -> requests (non-zero)

    def __len__(self) -> int:
        return self.num_requests

    def push(self, entry: W) -> None:
        """Queue ``entry`` at its fixed place (a preempted request keeps its old one)."""
        self._compact()
        heapq.heappush(self._heap, (entry.sort_key, entry.arrival_seq, entry.index, entry))
        self._count(entry.request, 1)

    def requeue(self, entry: W) -> None:
        """``entry``, waiting, has a new, larger ``sort_key``: queue it at its new place (its
        old item, keyed differently, is stale from now on)."""
        self._num_stale += 1
        heapq.heappush(self._heap, (entry.sort_key, entry.arrival_seq, entry.index, entry))

    def peek(self) -> W | None:
        """The entry admitted next, or None."""
        heap = self._heap
        discarded = self._discarded
        while heap:
            key, _, _, entry = heap[0]
            if key != entry.sort_key:  # stale (checked first: its entry has a live item)
                heapq.heappop(heap)
                self._num_stale -= 1
            elif id(entry) in discarded:
                discarded.remove(id(heapq.heappop(heap)[3]))
            else:
                return entry
        return None

    def pop(self, entry: W) -> None:
        """Take ``entry``, the head (``peek``), out of the queue: it is being admitted."""
        item = heapq.heappop(self._heap)
        assert item[3] is entry, "admitted a request that is not the head of the queue"
        self._count(entry.request, -1)

    def take(self, entry: W) -> None:
        """Take ``entry`` out of the queue wherever it stands (the ``max_loras`` rule admits
        past the head): ``pop`` for the head, else its live item is removed (O(n))."""
        if self.peek() is entry:
            self.pop(entry)
            return
        heap = self._heap
        i = next(i for i, item in enumerate(heap) if item[3] is entry and item[0] == entry.sort_key)
        last = heap.pop()
        if i < len(heap):
            heap[i] = last
            heapq.heapify(heap)
        self._count(entry.request, -1)

    def discard(self, entry: W) -> None:
        """``entry`` ends while waiting: it leaves the counts now and the heap lazily. Call
        before its status changes (a preempted request counts as such until then)."""
        self._count(entry.request, -1)
        self._discarded.add(id(entry))

    def head(self, n: int) -> list[W]:
        """Up to ``n`` live waiting entries, the first in admission order: a walk down the
        heap from its root (O(k log k) for the k items passed, not O(heap): the slo policy
        calls it every step)."""
        heap = self._heap
        discarded = self._discarded
        found: list[W] = []
        frontier = [(heap[0], 0)] if heap else []
        while frontier and len(found) < n:
            item, i = heapq.heappop(frontier)
            entry = item[3]
            if id(entry) not in discarded and item[0] == entry.sort_key:
                found.append(entry)
            for child in (2 * i + 1, 2 * i + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))
        return found

    def ordered(self) -> list[W]:
        """Every waiting entry, in admission order (O(n log n): for tests and tooling)."""
        discarded = self._discarded
        return [
            item[3]
            for item in sorted(self._heap)
            if id(item[3]) not in discarded and item[0] == item[3].sort_key
        ]

    @property
    def num_with_adapters(self) -> int:
        """Waiting requests that run with a LoRA adapter."""
        return sum(self._adapters.values())

    def adapter_counts(self) -> dict[str, int]:
        """Waiting requests by LoRA adapter (adapters with none left out)."""
        return dict(self._adapters)

    def tenant_counts(self, tenant: str) -> tuple[int, int]:
        """(requests, tokens) waiting of ``tenant``."""
        counts = self._tenants.get(tenant)
        return (0, 0) if counts is None else (counts[0], counts[1])

    def _count(self, req: Request, sign: int) -> None:
        self.num_requests += sign
        self.num_tokens += sign * req.num_tokens
        if req.status is _PREEMPTED:
            self.num_preempted += sign
        if req.tenant:
            counts = self._tenants.setdefault(req.tenant, [0, 0])
            counts[0] += sign
            counts[1] += sign * req.num_tokens
            if counts[0] == 0:
                del self._tenants[req.tenant]  # a tenant gone leaves nothing behind
        if req.lora is not None:
            name = req.lora.name
            count = self._adapters.get(name, 0) + sign
            if count:
                self._adapters[name] = count
            else:
                del self._adapters[name]

    def _compact(self) -> None:
        """Drop discarded and stale items once they are the majority of the heap."""
        discarded = self._discarded
        num_dead = len(discarded) + self._num_stale
        if num_dead > _COMPACT_MIN_DISCARDED and num_dead * 2 > len(self._heap):
            self._heap = [
                item
                for item in self._heap
                if id(item[3]) not in discarded and item[0] == item[3].sort_key
            ]
            heapq.heapify(self._heap)
            discarded.clear()
            self._num_stale = 0
