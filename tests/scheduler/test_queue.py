"""WaitingQueue: admission order, exact counts, and lazy deletion of requests that end waiting."""

from __future__ import annotations

import random
from dataclasses import dataclass

from scheduler.queue import WaitingQueue
from scheduler.request import Request, RequestStatus


@dataclass(eq=False)
class Entry:
    """A minimal queue entry: a fixed key and a request."""

    request: Request
    sort_key: int
    arrival_seq: int
    index: int = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id


def entry(rid: str, sort_key: int, arrival_seq: int, num_tokens: int = 3, index: int = 0) -> Entry:
    return Entry(Request(rid, list(range(num_tokens))), sort_key, arrival_seq, index)


def ids(queue: WaitingQueue[Entry]) -> list[str]:
    return [e.request_id for e in queue.ordered()]


def test_entries_leave_by_key_then_arrival_then_sample_index() -> None:
    """The smallest (sort_key, arrival_seq, index) is the head; pop takes exactly it."""
    queue: WaitingQueue[Entry] = WaitingQueue()
    b, a1, a0, c = entry("b", 5, 0), entry("a#1", 1, 2, index=1), entry("a", 1, 2), entry("c", 1, 3)
    for e in (b, a1, a0, c):
        queue.push(e)
    assert ids(queue) == ["a", "a#1", "c", "b"]
    assert queue.peek() is a0
    queue.pop(a0)
    assert (queue.peek(), len(queue), queue.num_tokens) == (a1, 3, 9)


def test_discard_uncounts_at_once_and_drops_the_item_when_it_reaches_the_head() -> None:
    """A discarded entry leaves the counts (tokens, preempted) when discarded, is never the
    head again, and its item goes when peek reaches it."""
    queue: WaitingQueue[Entry] = WaitingQueue()
    first, second = entry("p", 0, 0, num_tokens=5), entry("w", 0, 1, num_tokens=2)
    first.request.status = RequestStatus.PREEMPTED
    queue.push(first)
    queue.push(second)
    assert (len(queue), queue.num_tokens, queue.num_preempted) == (2, 7, 1)
    queue.discard(first)
    first.request.status = RequestStatus.FINISHED_ABORTED
    assert (len(queue), queue.num_tokens, queue.num_preempted) == (1, 2, 0)
    assert ids(queue) == ["w"]
    assert queue.peek() is second
    queue.pop(second)
    assert (len(queue), queue.num_tokens, queue.peek()) == (0, 0, None)


def test_discarded_items_are_compacted_once_they_are_the_majority() -> None:
    """100 discarded of 110: the next push rebuilds the heap from the 10 live entries, in
    order, with the counts unchanged."""
    queue: WaitingQueue[Entry] = WaitingQueue()
    entries = [entry(f"r{i}", 0, i) for i in range(110)]
    for e in entries:
        queue.push(e)
    for e in entries[:100]:
        queue.discard(e)
    last = entry("last", 0, 999)
    queue.push(last)
    assert len(queue._heap) == 11  # the 10 live entries and the new one
    assert ids(queue) == [f"r{i}" for i in range(100, 110)] + ["last"]
    assert (len(queue), queue.num_tokens) == (11, 33)


def test_head_is_the_first_n_live_entries_past_stale_and_discarded_items() -> None:
    """head(n) equals the first n of ``ordered()`` after random pushes, requeues (stale
    items) and discards, for every n."""
    rng = random.Random(7)
    queue: WaitingQueue[Entry] = WaitingQueue()
    live: list[Entry] = []
    for i in range(200):
        e = entry(f"r{i}", rng.randrange(50), i)
        queue.push(e)
        live.append(e)
        if rng.random() < 0.3:  # moved back: its old item goes stale
            moved = rng.choice(live)
            moved.sort_key += rng.randrange(1, 30)
            queue.requeue(moved)
        if rng.random() < 0.2:
            gone = live.pop(rng.randrange(len(live)))
            queue.discard(gone)
    order = queue.ordered()
    assert len(order) == len(live)
    for n in (0, 1, 5, 16, len(order), len(order) + 3):
        assert queue.head(n) == order[:n]
