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

``CostRouter`` counts every tier. Replicas that share a KV tier 2 (one store on disk) can
each restore a prefix that any of them spilled, so a prefix is in a replica's RAM, in the
shared tier, or nowhere, and each has a price::

    request keys   k0 k1 k2 k3 k4 k5          (the chain continues from RAM into the tier)
    replica A      k0 k1                      RAM 2 blocks
    shared tier    k0 k1 k2 k3                -> A: 2 from RAM, 2 restored, 2 recomputed
    replica B      -                          -> B: 0 from RAM, 4 restored, 2 recomputed

    estimate(r) = backlog(r) + restore_s_per_block * restored(r) + prefill_s(new(r), cached(r))

with ``prefill_s`` from the step-cost model (``scheduler.cost_model``) and ``backlog(r)`` the
prefill work already routed to r and not yet done: each routed request adds its estimate to
r's virtual clock, which runs down with real time (Mooncake's conductor estimates a
request's time to first token the same way). The lowest estimate wins; the load guard stays.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from cache_manager.hashing import prefix_block_keys
from scheduler.cost_model import CostPredictor, StepShape

ROUTERS = ("round-robin", "power-of-two", "prefix", "cost")
RouterName = Literal["round-robin", "power-of-two", "prefix", "cost"]

# Why a replica was chosen; the router's decisions are counted by these. ``shared_hit``: the
# chosen replica restores the prefix from the shared tier (its RAM holds none of it).
Reason = Literal[
    "round_robin", "power_of_two", "prefix_hit", "shared_hit", "prefix_miss", "load_guard"
]
REASONS: tuple[Reason, ...] = (
    "round_robin",
    "power_of_two",
    "prefix_hit",
    "shared_hit",
    "prefix_miss",
    "load_guard",
)
# Where the chosen replica finds each block of a request's prefix.
Tier = Literal["ram", "shared", "none"]
TIERS: tuple[Tier, ...] = ("ram", "shared", "none")


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
    num_prefix_blocks: int  # blocks of the request's prefix the chosen replica holds (RAM)
    num_shared_blocks: int = 0  # blocks after those that it restores from the shared tier


class KeyLRU:
    """A bounded LRU set of block keys (most recent last)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def add(self, keys: Iterable[int]) -> None:
        held = self._keys
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def chain_length(self, keys: Sequence[int], start: int = 0) -> int:
        """How many of ``keys[start:]`` are held in a row (a chain stops at its first miss)."""
        n = start
        while n < len(keys) and keys[n] in self._keys:
            n += 1
        return n - start


class PrefixIndex:
    """Per replica, a bounded LRU of the block keys it received recently.

    ``capacity_blocks`` should be about a replica's KV pool: older keys have likely been
    evicted there. Not thread-safe; one router owns one index.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: dict[str, KeyLRU] = {}

    def num_keys(self, replica_id: str) -> int:
        held = self._keys.get(replica_id)
        return 0 if held is None else len(held)

    def num_prefix_blocks(self, replica_id: str, keys: Sequence[int]) -> int:
        """How many leading ``keys`` the replica holds (a chain: stop at the first miss)."""
        held = self._keys.get(replica_id)
        return 0 if held is None else held.chain_length(keys)

    def add(self, replica_id: str, keys: Iterable[int]) -> None:
        """Record that ``replica_id`` now holds ``keys`` (most recent last)."""
        held = self._keys.get(replica_id)
        if held is None:
            held = self._keys[replica_id] = KeyLRU(self.capacity_blocks)
        held.add(keys)

    def drop(self, replica_id: str) -> None:
        """Forget a replica (a restarted one starts with an empty cache)."""
        self._keys.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone (a restarted replica starts with an empty cache)."""
        live = set(replica_ids)
        for gone in [r for r in self._keys if r not in live]:
            del self._keys[gone]


class Router(Protocol):
    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        keys: Sequence[int],
        *,
        num_prompt_tokens: int = 0,
        now_s: float = 0.0,
    ) -> Decision:
        """Pick one of ``replicas`` (not empty, none draining) for a request with ``keys``
        (its prompt of ``num_prompt_tokens``; ``now_s`` on the router's clock)."""
        ...

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        """A request with ``keys`` ended on ``replica_id`` (its blocks were freed there)."""
        ...


class _LoadOnly(ABC):
    """A router that looks at load alone: no prefix, no feedback."""

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        keys: Sequence[int],
        *,
        num_prompt_tokens: int = 0,
        now_s: float = 0.0,
    ) -> Decision:
        return self.decide(replicas)

    @abstractmethod
    def decide(self, replicas: Sequence[ReplicaLoad]) -> Decision:
        """Pick one of ``replicas`` by load alone."""

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        return None


class RoundRobinRouter(_LoadOnly):
    def __init__(self) -> None:
        self._next = 0

    def decide(self, replicas: Sequence[ReplicaLoad]) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(chosen.replica_id, "round_robin", 0)


class PowerOfTwoRouter(_LoadOnly):
    """The less loaded of two replicas drawn at random (ties: the first drawn)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def decide(self, replicas: Sequence[ReplicaLoad]) -> Decision:
        return Decision(self.pick(replicas).replica_id, "power_of_two", 0)

    def pick(self, replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
        if len(replicas) == 1:
            return replicas[0]
        a, b = self.rng.sample(list(replicas), 2)
        return b if b.num_ongoing < a.num_ongoing else a


def _check_guard(imbalance_abs: int, imbalance_rel: float) -> None:
    if imbalance_abs < 0 or imbalance_rel < 1.0:
        raise ValueError(
            f"imbalance_abs must be >= 0 and imbalance_rel >= 1.0, "
            f"got {imbalance_abs} and {imbalance_rel}"
        )


def is_imbalanced(replicas: Sequence[ReplicaLoad], imbalance_abs: int, rel: float) -> bool:
    """The load guard: busiest - idlest > ``imbalance_abs`` and busiest > ``rel`` x idlest."""
    loads = [r.num_ongoing for r in replicas]
    busiest, idlest = max(loads), min(loads)
    return busiest - idlest > imbalance_abs and busiest > rel * idlest


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
        _check_guard(imbalance_abs, imbalance_rel)
        self.index = index
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self._fallback = PowerOfTwoRouter(rng)

    def is_imbalanced(self, replicas: Sequence[ReplicaLoad]) -> bool:
        return is_imbalanced(replicas, self.imbalance_abs, self.imbalance_rel)

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        keys: Sequence[int],
        *,
        num_prompt_tokens: int = 0,
        now_s: float = 0.0,
    ) -> Decision:
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

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        return None  # what RAM holds is learned from what was sent and what replicas report


class PrefillPrice(Protocol):
    def prefill_s(self, num_new: int, num_cached: int) -> float:
        """Seconds to prefill ``num_new`` prompt tokens after ``num_cached`` cached ones."""
        ...


@dataclass(frozen=True, slots=True)
class TokenPrice:
    """A flat price per prefilled token (no cost model at hand)."""

    s_per_token: float = 1e-3

    def prefill_s(self, num_new: int, num_cached: int) -> float:
        return self.s_per_token * num_new


@dataclass(frozen=True, slots=True)
class CostModelPrice:
    """A prefill's price from the step-cost model: one step per chunk of ``chunk_tokens``."""

    model: CostPredictor
    chunk_tokens: int = 512

    def prefill_s(self, num_new: int, num_cached: int) -> float:
        total = 0.0
        start, end = num_cached, num_cached + num_new
        while start < end:
            n = min(self.chunk_tokens, end - start)
            total += self.model.predict(StepShape.of([(n, start)], []))
            start += n
        return total


@dataclass(frozen=True, slots=True)
class Estimate:
    """One replica's price for one request (seconds until its first token, as priced)."""

    replica_id: str
    num_ram_blocks: int
    num_shared_blocks: int
    backlog_s: float
    work_s: float  # restoring the shared blocks + prefilling the rest

    @property
    def total_s(self) -> float:
        return self.backlog_s + self.work_s


class CostRouter:
    """The lowest estimated time to first token over RAM, the shared tier and recomputation
    (module docstring). ``shared`` None: the replicas share no tier, so a prefix is in a
    replica's RAM or nowhere.

    What the shared tier holds is learned as the tier fills: a request's blocks are spilled
    when it ends (``on_finished``), and replicas report what they spilled (``learn_shared``).
    ``restore_s_per_block`` is one block's read and copy; ``block_size`` tokens per block.
    """

    def __init__(
        self,
        index: PrefixIndex,
        price: PrefillPrice,
        *,
        block_size: int,
        shared: KeyLRU | None = None,
        restore_s_per_block: float = 0.0,
        imbalance_abs: int = 8,
        imbalance_rel: float = 1.5,
        rng: random.Random | None = None,
    ) -> None:
        _check_guard(imbalance_abs, imbalance_rel)
        if block_size < 1 or restore_s_per_block < 0:
            raise ValueError(
                f"block_size must be >= 1 and restore_s_per_block >= 0, got {block_size} "
                f"and {restore_s_per_block}"
            )
        self.index = index
        self.price = price
        self.block_size = block_size
        self.shared = shared
        self.restore_s_per_block = restore_s_per_block
        self.imbalance_abs = imbalance_abs
        self.imbalance_rel = imbalance_rel
        self._fallback = PowerOfTwoRouter(rng)
        self._busy_until_s: dict[str, float] = {}

    def backlog_s(self, replica_id: str, now_s: float) -> float:
        """Priced prefill work routed to ``replica_id`` and not yet run down by ``now_s``."""
        return max(0.0, self._busy_until_s.get(replica_id, now_s) - now_s)

    def estimate(
        self, replica_id: str, keys: Sequence[int], num_prompt_tokens: int, now_s: float
    ) -> Estimate:
        ram = self.index.num_prefix_blocks(replica_id, keys)
        shared = 0 if self.shared is None else self.shared.chain_length(keys, ram)
        num_cached = min((ram + shared) * self.block_size, num_prompt_tokens)
        work_s = self.restore_s_per_block * shared + self.price.prefill_s(
            num_prompt_tokens - num_cached, num_cached
        )
        return Estimate(replica_id, ram, shared, self.backlog_s(replica_id, now_s), work_s)

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        keys: Sequence[int],
        *,
        num_prompt_tokens: int = 0,
        now_s: float = 0.0,
    ) -> Decision:
        reason: Reason
        if is_imbalanced(replicas, self.imbalance_abs, self.imbalance_rel):
            chosen = self._fallback.pick(replicas)
            best = self.estimate(chosen.replica_id, keys, num_prompt_tokens, now_s)
            reason = "load_guard"
        else:
            estimates = {
                r.replica_id: self.estimate(r.replica_id, keys, num_prompt_tokens, now_s)
                for r in replicas
            }
            chosen = min(
                replicas,
                key=lambda r: (
                    estimates[r.replica_id].total_s,
                    r.num_ongoing,
                    self.index.num_keys(r.replica_id),
                    r.replica_id,
                ),
            )
            best = estimates[chosen.replica_id]
            reason = (
                "prefix_hit"
                if best.num_ram_blocks
                else "shared_hit"
                if best.num_shared_blocks
                else "prefix_miss"
            )
        rid = chosen.replica_id
        self.index.add(rid, keys)
        self._busy_until_s[rid] = max(now_s, self._busy_until_s.get(rid, now_s)) + best.work_s
        return Decision(rid, reason, best.num_ram_blocks, best.num_shared_blocks)

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        """Its blocks were freed on ``replica_id``: the shared tier has them now (spilled)."""
        self.learn_shared(keys)

    def learn_shared(self, keys: Iterable[int]) -> None:
        if self.shared is not None:
            self.shared.add(keys)

    def forget(self, replica_id: str) -> None:
        """A replica left (its RAM and its backlog with it; the shared tier stays)."""
        self.index.drop(replica_id)
        self._busy_until_s.pop(replica_id, None)


def make_router(
    name: str,
    *,
    capacity_blocks: int = 4096,
    imbalance_abs: int = 8,
    imbalance_rel: float = 1.5,
    seed: int | None = None,
    block_size: int = 16,
    price: PrefillPrice | None = None,
    shared_capacity_blocks: int | None = None,
    restore_s_per_block: float = 0.0,
) -> Router:
    """``--router`` name -> router; ValueError names the choices. The cost router prices
    prefills with ``price`` (default: a flat price per token) and, when the replicas share a
    tier of ``shared_capacity_blocks``, restores at ``restore_s_per_block``."""
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
    if name == "cost":
        return CostRouter(
            PrefixIndex(capacity_blocks),
            price if price is not None else TokenPrice(),
            block_size=block_size,
            shared=None if shared_capacity_blocks is None else KeyLRU(shared_capacity_blocks),
            restore_s_per_block=restore_s_per_block,
            imbalance_abs=imbalance_abs,
            imbalance_rel=imbalance_rel,
            rng=rng,
        )
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
