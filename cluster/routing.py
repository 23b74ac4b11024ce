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

A ``GuardedRouter`` ranks the replicas by a score and keeps a ``LoadGuard``: when the
busiest and the idlest replica differ by more than ``imbalance_abs`` requests *and* by more
than ``imbalance_rel`` times, it routes by power of two choices instead, as SGLang's
cache-aware router does, so one hot prefix cannot pile every request onto one replica.
``PrefixScore`` ranks by the longest hit (``--router prefix``).

``CostScore`` (``--router cost``) counts every tier. Replicas that share a KV tier 2 (one
store on disk) can each restore a prefix that any of them spilled, so a prefix is in a
replica's RAM, in the shared tier, or nowhere, and each has a price::

    request keys   k0 k1 k2 k3 k4 k5          (the chain continues from RAM into the tier)
    replica A      k0 k1                      RAM 2 blocks
    shared tier    k0 k1 k2 k3                -> A: 2 from RAM, 2 restored, 2 recomputed
    replica B      -                          -> B: 0 from RAM, 4 restored, 2 recomputed

    estimate(r) = backlog(r) + restore_s_per_block * restored(r) + prefill_s(new(r), cached(r))

with ``prefill_s`` from the step-cost model (``scheduler.cost_model``) and ``backlog(r)`` the
prefill work already routed to r and not yet done: each routed request adds its estimate to
r's virtual clock, which runs down with real time (Mooncake's conductor estimates a
request's time to first token the same way). The lowest estimate wins; the load guard stays.

Every router offers the same hooks (SGLang's ``LoadBalancingPolicy``), whose defaults do
nothing, so a caller never asks which router it holds: ``choose``, and ``on_finished``,
``learn``, ``retain``, ``resize``, ``forget``, ``reprice`` for what the replicas report.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from cache_manager.hashing import prefix_block_keys
from scheduler.cost_model import FEATURES, CostPredictor, StepCostModel, StepShape

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
        self._trim()

    def resize(self, capacity_blocks: int) -> None:
        """Hold at most ``capacity_blocks`` from now on (the oldest go first)."""
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._trim()

    def _trim(self) -> None:
        held = self._keys
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

    A replica's LRU holds about its KV pool: older keys have likely been evicted there.
    ``capacity_blocks`` is the size until the replica reports its own (``resize``): a
    replica of 40 blocks that was sent every prefix holds the latest 40 blocks' worth, so
    the older prefixes go to another replica instead of thrashing it. Not thread-safe; one
    router owns one index.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: dict[str, KeyLRU] = {}
        self._sizes: dict[str, int] = {}  # replica id -> its reported KV pool, in blocks

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
            size = self._sizes.get(replica_id, self.capacity_blocks)
            held = self._keys[replica_id] = KeyLRU(size)
        held.add(keys)

    def resize(self, replica_id: str, capacity_blocks: int) -> None:
        """``replica_id``'s KV pool holds ``capacity_blocks``: its LRU holds as many."""
        self._sizes[replica_id] = capacity_blocks
        held = self._keys.get(replica_id)
        if held is not None and held.capacity_blocks != capacity_blocks:
            held.resize(capacity_blocks)

    def drop(self, replica_id: str) -> None:
        """Forget a replica (a restarted one starts with an empty cache)."""
        self._keys.pop(replica_id, None)
        self._sizes.pop(replica_id, None)

    def replica_ids(self) -> list[str]:
        """The replicas it holds keys of."""
        return list(self._keys)


@dataclass(frozen=True, slots=True)
class LoadGuard:
    """When load beats prefix: the busiest replica has more than ``imbalance_abs`` requests
    over the idlest *and* more than ``imbalance_rel`` times as many (SGLang's cache-aware
    balance thresholds). ``LoadGuard()`` holds the defaults every caller reads."""

    imbalance_abs: int = 8
    imbalance_rel: float = 1.5

    def __post_init__(self) -> None:
        if self.imbalance_abs < 0 or self.imbalance_rel < 1.0:
            raise ValueError(
                f"imbalance_abs must be >= 0 and imbalance_rel >= 1.0, "
                f"got {self.imbalance_abs} and {self.imbalance_rel}"
            )

    def tripped(self, replicas: Sequence[ReplicaLoad]) -> bool:
        loads = [r.num_ongoing for r in replicas]
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.imbalance_abs and busiest > self.imbalance_rel * idlest


DEFAULT_GUARD = LoadGuard()


class Router(ABC):
    """Picks a replica per request; learns from what happens to requests and what replicas
    report. Every hook but ``choose`` does nothing unless a router needs it."""

    @abstractmethod
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

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        """A request with ``keys`` ended on ``replica_id`` (its blocks were freed there)."""
        return None

    def learn(self, replica_id: str | None, keys: Iterable[int]) -> None:
        """``keys`` are in ``replica_id``'s RAM (its report), or with None in the tier the
        replicas share (a replica spilled them)."""
        return None

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Only ``replica_ids`` are live: forget the others."""
        return None

    def resize(self, replica_id: str, capacity_blocks: int) -> None:
        """``replica_id`` reported a KV pool of ``capacity_blocks`` (its prefix cache holds
        at most as many)."""
        return None

    def forget(self, replica_id: str) -> None:
        """``replica_id`` is gone (a restarted replica starts with an empty cache)."""
        return None

    def reprice(self, reports: Sequence[Mapping[str, Any]]) -> None:
        """The replicas' latest reports (``KVServeReplica.record_routing_stats``): prices."""
        return None


class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self._next = 0

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        keys: Sequence[int],
        *,
        num_prompt_tokens: int = 0,
        now_s: float = 0.0,
    ) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        chosen = ordered[self._next % len(ordered)]
        self._next += 1
        return Decision(chosen.replica_id, "round_robin", 0)


class PowerOfTwoRouter(Router):
    """The less loaded of two replicas drawn at random (ties: the first drawn)."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        keys: Sequence[int],
        *,
        num_prompt_tokens: int = 0,
        now_s: float = 0.0,
    ) -> Decision:
        return Decision(self.pick(replicas).replica_id, "power_of_two", 0)

    def pick(self, replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
        if len(replicas) == 1:
            return replicas[0]
        a, b = self.rng.sample(list(replicas), 2)
        return b if b.num_ongoing < a.num_ongoing else a


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
    """One replica's offer for one request: where its prefix is, and (cost score) the
    seconds until its first token, as priced."""

    replica_id: str
    num_ram_blocks: int
    num_shared_blocks: int = 0
    backlog_s: float = 0.0
    work_s: float = 0.0  # restoring the shared blocks + prefilling the rest

    @property
    def total_s(self) -> float:
        return self.backlog_s + self.work_s

    @property
    def reason(self) -> Reason:
        if self.num_ram_blocks:
            return "prefix_hit"
        return "shared_hit" if self.num_shared_blocks else "prefix_miss"


class Score(ABC):
    """What a ``GuardedRouter`` ranks replicas by (the lowest ``rank`` wins), over a
    ``PrefixIndex`` of what each replica's RAM holds. ``took`` is called for the replica
    chosen, whichever way it was chosen."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    @abstractmethod
    def estimate(
        self, replica_id: str, keys: Sequence[int], num_prompt_tokens: int, now_s: float
    ) -> Estimate: ...

    @abstractmethod
    def rank(self, offer: Estimate) -> float: ...

    def took(self, offer: Estimate, keys: Sequence[int], now_s: float) -> None:
        """The chosen replica holds ``keys`` now: the next request of this prefix follows it
        before the replica's next report arrives."""
        self.index.add(offer.replica_id, keys)

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        """What RAM holds is learned from what was sent and what replicas report."""
        return None

    def learn(self, replica_id: str | None, keys: Iterable[int]) -> None:
        if replica_id is not None:
            self.index.add(replica_id, keys)

    def forget(self, replica_id: str) -> None:
        self.index.drop(replica_id)

    def reprice(self, reports: Sequence[Mapping[str, Any]]) -> None:
        """Prices from the replicas' reports (a score that charges none ignores them)."""
        return None


class PrefixScore(Score):
    """The longest prefix held in RAM."""

    def estimate(
        self, replica_id: str, keys: Sequence[int], num_prompt_tokens: int, now_s: float
    ) -> Estimate:
        return Estimate(replica_id, self.index.num_prefix_blocks(replica_id, keys))

    def rank(self, offer: Estimate) -> float:
        return -offer.num_ram_blocks


class CostScore(Score):
    """The lowest estimated time to first token over RAM, the shared tier and recomputation
    (module docstring). ``shared`` None: the replicas share no tier, so a prefix is in a
    replica's RAM or nowhere.

    What the shared tier holds is learned as the tier fills: a request's blocks are spilled
    when it ends (``on_finished``), and replicas report what they spilled (``learn``).
    ``restore_s_per_block`` is one block's read and copy; ``block_size`` tokens per block;
    ``chunk_tokens`` the prefill chunk a reported step-cost model is priced by.
    """

    def __init__(
        self,
        index: PrefixIndex,
        price: PrefillPrice,
        *,
        block_size: int,
        shared: KeyLRU | None = None,
        restore_s_per_block: float = 0.0,
        chunk_tokens: int = 512,
    ) -> None:
        if block_size < 1 or restore_s_per_block < 0:
            raise ValueError(
                f"block_size must be >= 1 and restore_s_per_block >= 0, got {block_size} "
                f"and {restore_s_per_block}"
            )
        super().__init__(index)
        self.price = price
        self.block_size = block_size
        self.shared = shared
        self.restore_s_per_block = restore_s_per_block
        self.chunk_tokens = chunk_tokens
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

    def rank(self, offer: Estimate) -> float:
        return offer.total_s

    def took(self, offer: Estimate, keys: Sequence[int], now_s: float) -> None:
        super().took(offer, keys, now_s)
        rid = offer.replica_id
        self._busy_until_s[rid] = max(now_s, self._busy_until_s.get(rid, now_s)) + offer.work_s

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        """Its blocks were freed on ``replica_id``: the shared tier has them now (spilled)."""
        self.learn(None, keys)

    def learn(self, replica_id: str | None, keys: Iterable[int]) -> None:
        if replica_id is not None:
            super().learn(replica_id, keys)
        elif self.shared is not None:
            self.shared.add(keys)

    def forget(self, replica_id: str) -> None:
        """A replica left (its RAM and its backlog with it; the shared tier stays)."""
        super().forget(replica_id)
        self._busy_until_s.pop(replica_id, None)

    def reprice(self, reports: Sequence[Mapping[str, Any]]) -> None:
        """The mean of the reported step-cost models and restore times; the shared tier as
        large as the largest reported."""
        price, restore_s = prices_from_reports(reports, self.chunk_tokens)
        if price is not None:
            self.price = price
        if restore_s is not None:
            self.restore_s_per_block = restore_s
        sizes = [r.get("tier2_capacity_blocks") for r in reports]
        known = [n for n in sizes if isinstance(n, int) and n > 0]
        if self.shared is not None and known:
            self.shared.capacity_blocks = max(known)


def prices_from_reports(
    reports: Sequence[Mapping[str, Any]], chunk_tokens: int
) -> tuple[CostModelPrice | None, float | None]:
    """The mean of the replicas' reported step-cost models (None unless it prices more tokens
    higher), and the mean reported restore seconds per block (None when none restored yet)."""
    models = [
        r["cost_model_s"]
        for r in reports
        if isinstance(r.get("cost_model_s"), list | tuple)
        and len(r["cost_model_s"]) == len(FEATURES)
        and all(isinstance(c, int | float) and math.isfinite(c) for c in r["cost_model_s"])
    ]
    price = None
    if models:
        mean = [sum(column) / len(models) for column in zip(*models, strict=True)]
        model = StepCostModel(mean)
        short = model.predict(StepShape.of([(chunk_tokens // 2, 0)], []))
        if model.predict(StepShape.of([(chunk_tokens, 0)], [])) > short > 0:
            price = CostModelPrice(model, chunk_tokens)
    restores = [
        float(r["restore_s_per_block"])
        for r in reports
        if isinstance(r.get("restore_s_per_block"), int | float) and r["restore_s_per_block"] > 0
    ]
    return price, (sum(restores) / len(restores) if restores else None)


class GuardedRouter(Router):
    """The replica ``score`` ranks lowest, ties to the less loaded, then to the one holding
    the fewest keys (so new prefixes spread); power of two choices while ``guard`` trips.
    The chosen replica is credited with the request's keys at once."""

    def __init__(
        self, score: Score, guard: LoadGuard = DEFAULT_GUARD, rng: random.Random | None = None
    ) -> None:
        self.score = score
        self.guard = guard
        self._fallback = PowerOfTwoRouter(rng)

    def choose(
        self,
        replicas: Sequence[ReplicaLoad],
        keys: Sequence[int],
        *,
        num_prompt_tokens: int = 0,
        now_s: float = 0.0,
    ) -> Decision:
        score, index = self.score, self.score.index
        if self.guard.tripped(replicas):
            chosen = self._fallback.pick(replicas)
            offer = score.estimate(chosen.replica_id, keys, num_prompt_tokens, now_s)
            reason: Reason = "load_guard"
        else:
            offers = {
                r.replica_id: score.estimate(r.replica_id, keys, num_prompt_tokens, now_s)
                for r in replicas
            }
            chosen = min(
                replicas,
                key=lambda r: (
                    score.rank(offers[r.replica_id]),
                    r.num_ongoing,
                    index.num_keys(r.replica_id),
                    r.replica_id,
                ),
            )
            offer = offers[chosen.replica_id]
            reason = offer.reason
        score.took(offer, keys, now_s)
        return Decision(chosen.replica_id, reason, offer.num_ram_blocks, offer.num_shared_blocks)

    def on_finished(self, replica_id: str, keys: Sequence[int]) -> None:
        self.score.on_finished(replica_id, keys)

    def learn(self, replica_id: str | None, keys: Iterable[int]) -> None:
        self.score.learn(replica_id, keys)

    def retain(self, replica_ids: Iterable[str]) -> None:
        live = set(replica_ids)
        for gone in [r for r in self.score.index.replica_ids() if r not in live]:
            self.score.forget(gone)

    def forget(self, replica_id: str) -> None:
        self.score.forget(replica_id)

    def resize(self, replica_id: str, capacity_blocks: int) -> None:
        self.score.index.resize(replica_id, capacity_blocks)

    def reprice(self, reports: Sequence[Mapping[str, Any]]) -> None:
        self.score.reprice(reports)


def make_router(
    name: str,
    *,
    capacity_blocks: int = 4096,
    guard: LoadGuard = DEFAULT_GUARD,
    seed: int | None = None,
    block_size: int = 16,
    price: PrefillPrice | None = None,
    shared_capacity_blocks: int | None = None,
    restore_s_per_block: float = 0.0,
    chunk_tokens: int = 512,
) -> Router:
    """``--router`` name -> router; ValueError names the choices. The cost router prices
    prefills with ``price`` (default: a flat price per token; reported step-cost models of
    ``chunk_tokens`` chunks replace it) and, when the replicas share a tier of
    ``shared_capacity_blocks``, restores at ``restore_s_per_block``."""
    rng = random.Random(seed)
    if name == "round-robin":
        return RoundRobinRouter()
    if name == "power-of-two":
        return PowerOfTwoRouter(rng)
    index = PrefixIndex(capacity_blocks)
    if name == "prefix":
        return GuardedRouter(PrefixScore(index), guard, rng)
    if name == "cost":
        score = CostScore(
            index,
            price if price is not None else TokenPrice(),
            block_size=block_size,
            shared=None if shared_capacity_blocks is None else KeyLRU(shared_capacity_blocks),
            restore_s_per_block=restore_s_per_block,
            chunk_tokens=chunk_tokens,
        )
        return GuardedRouter(score, guard, rng)
    raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
