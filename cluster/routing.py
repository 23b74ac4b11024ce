"""Which replica serves a request: round robin, power of two choices, or longest held prefix.

Pure Python (ints, lists, dataclasses), like ``scheduler/``: the Ray Serve request router
(``cluster/ray_router.py``) and the multi-replica simulation (``loadtest/simulate.py``) run
the same code.

A prefix is a chain of block keys (``cache_manager.prefix_block_keys``): key i stands for
the first ``(i + 1) * block_size`` tokens and their cache salt, exactly as each replica's
prefix cache keys its blocks. The router keeps, per replica, a bounded LRU of the keys that
replica received recently (what the router sent it, refreshed by what the replica reports)::

    request keys   k0 k1 k2 k3 k4
    replica A      k0 k1 k2          -> 3 blocks held: prefix hit of 3 * block_size tokens
    replica B      k0                -> 1

``PrefixRouter`` picks the longest hit. Its load guard: when the busiest and the idlest
replica differ by more than ``imbalance_abs`` requests *and* by more than
``imbalance_rel`` times, it routes by power of two choices instead, as SGLang's
cache-aware router does, so one hot prefix cannot pile every request onto one replica.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from cache_manager.hashing import prefix_block_keys

ROUTERS = ("round-robin", "power-of-two", "prefix")
RouterName = Literal["round-robin", "power-of-two", "prefix"]

# Why a replica was chosen; the router's decisions are counted by these.
Reason = Literal["round_robin", "power_of_two", "prefix_hit", "prefix_miss", "load_guard"]
REASONS: tuple[Reason, ...] = (
    "round_robin",
    "power_of_two",
    "prefix_hit",
    "prefix_miss",
    "load_guard",
)


def routing_keys(token_ids: Sequence[int], block_size: int, cache_salt: str | None) -> list[int]:
    """A prompt's chained block keys, shortened to 64-bit ints (cheap to report and store).

    The last prompt token is never a prefix-cache hit, so only the blocks before it count.
    """
    keys = prefix_block_keys(token_ids[:-1], block_size, cache_salt)
    return [int.from_bytes(key[:8], "little") for key in keys]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One live replica as the router sees it."""

    replica_id: str
    num_ongoing: int  # requests in flight on it (queued + running)
    draining: bool = False  # shutting down: gets no new requests


@dataclass(frozen=True, slots=True)
class Decision:
    replica_id: str
    reason: Reason
    num_prefix_blocks: int  # blocks of the request's prefix the chosen replica holds


class PrefixIndex:
    """Per replica, a bounded LRU of the block keys it received recently.

    ``capacity_blocks`` should be about a replica's KV pool: older keys have likely been
    evicted there. Not thread-safe; one router owns one index.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: dict[str, OrderedDict[int, None]] = {}

    def num_keys(self, replica_id: str) -> int:
        held = self._keys.get(replica_id)
        return 0 if held is None else len(held)

    def num_prefix_blocks(self, replica_id: str, keys: Sequence[int]) -> int:
        """How many leading ``keys`` the replica holds (a chain: stop at the first miss)."""
        held = self._keys.get(replica_id)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def add(self, replica_id: str, keys: Iterable[int]) -> None:
        """Record that ``replica_id`` now holds ``keys`` (most recent last)."""
        held = self._keys.setdefault(replica_id, OrderedDict())
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def drop(self, replica_id: str) -> None:
        """Forget a replica (a restarted one starts with an empty cache)."""
        self._keys.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone (a restarted replica starts with an empty cache)."""
        live = set(replica_ids)
        for gone in [r for r in self._keys if r not in live]:
            del self._keys[gone]


class Router(Protocol):
    def choose(self, replicas: Sequence[ReplicaLoad], keys: Sequence[int]) -> Decision:
        """Pick one of ``replicas`` (not empty, none draining) for a request with ``keys``."""
        ...


class RoundRobinRouter:
    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[ReplicaLoad], keys: Sequence[int]) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(chosen.replica_id, "round_robin", 0)


class PowerOfTwoRouter:
    """The less loaded of two replicas drawn at random (ties: the first drawn)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, replicas: Sequence[ReplicaLoad], keys: Sequence[int]) -> Decision:
        return Decision(self.pick(replicas).replica_id, "power_of_two", 0)

    def pick(self, replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
        if len(replicas) == 1:
            return replicas[0]
        a, b = self.rng.sample(list(replicas), 2)
        return b if b.num_ongoing < a.num_ongoing else a


class PrefixRouter:
    """Longest held prefix, ties to the less loaded; power of two choices when imbalanced.

    A request that hits nowhere goes to the least loaded replica, ties to the one holding
    the fewest keys, so new prefixes spread over the replicas. The chosen replica is
    credited with the request's keys at once, so the next request of the same prefix
    follows it before the replica's next report arrives.
    """

    def __init__(
        self,
        index: PrefixIndex,
        *,
        imbalance_abs: int = 8,
        imbalance_rel: float = 1.5,
        rng: random.Random | None = None,
    ) -> None:
        if imbalance_abs < 0 or imbalance_rel < 1.0:
            raise ValueError(
                f"imbalance_abs must be >= 0 and imbalance_rel >= 1.0, "
                f"got {imbalance_abs} and {imbalance_rel}"
            )
        self.index = index
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self._fallback = PowerOfTwoRouter(rng)

    def is_imbalanced(self, replicas: Sequence[ReplicaLoad]) -> bool:
        loads = [r.num_ongoing for r in replicas]
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.imbalance_abs and busiest > self.imbalance_rel * idlest

    def choose(self, replicas: Sequence[ReplicaLoad], keys: Sequence[int]) -> Decision:
        index = self.index
        if self.is_imbalanced(replicas):
            chosen = self._fallback.pick(replicas)
            reason: Reason = "load_guard"
            hit = index.num_prefix_blocks(chosen.replica_id, keys)
        else:
            hits = {r.replica_id: index.num_prefix_blocks(r.replica_id, keys) for r in replicas}
            chosen = min(
                replicas,
                key=lambda r: (
                    -hits[r.replica_id],
                    r.num_ongoing,
                    index.num_keys(r.replica_id),
                    r.replica_id,
                ),
            )
            hit = hits[chosen.replica_id]
            reason = "prefix_hit" if hit else "prefix_miss"
        index.add(chosen.replica_id, keys)
        return Decision(chosen.replica_id, reason, hit)


def make_router(
    name: str,
    *,
    capacity_blocks: int = 4096,
    imbalance_abs: int = 8,
    imbalance_rel: float = 1.5,
    seed: int | None = None,
) -> Router:
    """``--router`` name -> router; ValueError names the choices."""
    rng = random.Random(seed)
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "power-of-two":
        return PowerOfTwoRouter(rng)
    if name == "prefix":
        return PrefixRouter(
            PrefixIndex(capacity_blocks),
            imbalance_abs=imbalance_abs,
            imbalance_rel=imbalance_rel,
            rng=rng,
        )
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
