"""Eviction order of free blocks that still hold a prefix-cache key: small strategy objects.

Every policy keeps its blocks in intrusive ``BlockQueue`` s, so ``push`` (a cached block was
freed), ``remove`` (a prefix hit takes a free block back) and ``pop`` (evict the next victim)
are O(1), or O(log t) for LFU with t distinct hit counts. A block's ordering attributes
(``hit_count``, ``is_shared``) only change while it is referenced, never while it is queued.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Iterator

from cache_manager.block import BlockQueue, KVBlock


class EvictionPolicy(ABC):
    """Orders the evictable (free, cached) blocks; ``pop`` returns the next victim."""

    name: str = ""

    @abstractmethod
    def push(self, block: KVBlock) -> None:
        """A cached block became free: queue it as the most recently used of its class."""

    @abstractmethod
    def pop(self) -> KVBlock:
        """Take the next victim. The caller checks ``len`` first."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def queues(self) -> list[BlockQueue]:
        """The queues in eviction order (first queue is emptied first)."""

    def remove(self, block: KVBlock) -> None:
        """A prefix hit takes ``block`` off the free list."""
        queue = block.queue
        assert queue is not None, f"block {block.block_id} is not free"
        queue.remove(block)

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks in the order they would be evicted."""
        for queue in self.queues():
            yield from queue


class LRUEviction(EvictionPolicy):
    """Least recently freed first. One queue: freed blocks go to the back."""

    name = "lru"

    def __init__(self) -> None:
        self._queue = BlockQueue("lru")

    def push(self, block: KVBlock) -> None:
        self._queue.append(block)

    def pop(self) -> KVBlock:
        return self._queue.popleft()

    def __len__(self) -> int:
        return len(self._queue)

    def queues(self) -> list[BlockQueue]:
        return [self._queue]


class SharedPrefixEviction(EvictionPolicy):
    """Unshared blocks first (LRU among them), then blocks that were shared or hit (LRU).

    A block counts as shared once two requests held it at the same time (fork, or a prefix
    hit while another request holds it) or once a prefix hit took it: system prompts and
    few-shot preambles, which are worth keeping longer than one request's private tail.
    """

    name = "shared-prefix"

    def __init__(self) -> None:
        self._unshared = BlockQueue("shared-prefix/unshared")
        self._shared = BlockQueue("shared-prefix/shared")

    def push(self, block: KVBlock) -> None:
        (self._shared if block.is_shared else self._unshared).append(block)

    def pop(self) -> KVBlock:
        if len(self._unshared):
            return self._unshared.popleft()
        return self._shared.popleft()

    def __len__(self) -> int:
        return len(self._unshared) + len(self._shared)

    def queues(self) -> list[BlockQueue]:
        return [self._unshared, self._shared]


class LFUEviction(EvictionPolicy):
    """Fewest prefix hits first; ties broken least recently freed first.

    One LRU queue per hit count and a min-heap of the counts that have a queue, so ``pop`` is
    O(log t) in the number t of distinct counts and ``push``/``remove`` are O(1) (plus a heap
    push when a count gets its first queue).
    """

    name = "lfu"

    def __init__(self) -> None:
        self._buckets: dict[int, BlockQueue] = {}
        self._counts: list[int] = []  # heap of the keys of _buckets
        self._len = 0

    def push(self, block: KVBlock) -> None:
        queue = self._buckets.get(block.hit_count)
        if queue is None:
            queue = self._buckets[block.hit_count] = BlockQueue(f"lfu/{block.hit_count}")
            heapq.heappush(self._counts, block.hit_count)
        queue.append(block)
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        super().remove(block)
        self._len -= 1

    def pop(self) -> KVBlock:
        while True:
            count = self._counts[0]
            queue = self._buckets[count]
            if len(queue):
                self._len -= 1
                return queue.popleft()
            # Drop empty buckets lazily so the heap only grows with distinct counts.
            heapq.heappop(self._counts)
            del self._buckets[count]

    def __len__(self) -> int:
        return self._len

    def queues(self) -> list[BlockQueue]:
        return [self._buckets[count] for count in sorted(self._buckets)]


def make_eviction_policy(name: str) -> EvictionPolicy:
    """The policy named by ``KVCacheConfig.eviction_policy``."""
    if name == "lru":
        return LRUEviction()
    if name == "lfu":
        return LFUEviction()
    if name == "shared-prefix":
        return SharedPrefixEviction()
    raise ValueError(f"unknown eviction policy {name!r}; use 'lru', 'lfu' or 'shared-prefix'")
