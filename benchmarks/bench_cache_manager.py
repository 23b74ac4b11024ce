"""Micro-benchmarks of the KV cache manager's hot paths. A program, not a test.

    python -m benchmarks.bench_cache_manager [--repeats N]

(a) decode step: 256 running requests of about 1,000 tokens each get one new token:
    ``allocate_slots(seq, 1)`` for all, then ``cache_full_blocks`` for all (a block fills
    for about 1 in 16 of them). Target: median <= 0.5 ms per step.
(b) a 4,000-token request: ``allocate_slots`` of its whole prompt, then ``free``.
    Target: median <= 0.2 ms. Measured twice: from empty blocks (the usual case), and with
    a pool whose free blocks all hold prefix-cache keys, so every block is an eviction.
Each is reported as median / p90 / min over repeats, plus the per-request cost. The machine
may be shared: min shows the uncontended cost, median the typical one.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cache_manager import KVCacheConfig, KVCacheManager


@dataclass(slots=True)
class _Seq:
    """The minimum a CacheSequence needs (scheduler.request.Request has the same shape)."""

    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    num_prompt: int = field(default=0)

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_prompt


def _percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _time(
    fn: Callable[[], None], repeats: int, setup: Callable[[], None] | None = None
) -> list[float]:
    samples: list[float] = []
    gc.disable()
    try:
        for _ in range(repeats):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return samples


def bench_decode_step(repeats: int, policy: str) -> list[float]:
    """(a) 256 requests of ~1,000 tokens, one decode step's worth of allocations."""
    block_size = 16
    num_requests = 256
    rng = random.Random(0)
    # Room for every request to grow by one token per repeat.
    num_blocks = num_requests * -(-(1050 + repeats + 1) // block_size)
    kv = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks, block_size=block_size, eviction_policy=policy)
    )
    seqs: list[_Seq] = []
    for i in range(num_requests):
        n = rng.randint(950, 1050)
        seq = _Seq(f"r{i}", [rng.randrange(32_000) for _ in range(n)], num_prompt=n)
        assert kv.allocate_slots(seq, n) is not None
        seq.num_computed_tokens = n
        kv.cache_full_blocks(seq)
        seq.tokens.append(rng.randrange(32_000))  # the token sampled from the prefill
        seqs.append(seq)

    def step() -> None:
        allocate = kv.allocate_slots
        cache = kv.cache_full_blocks
        for seq in seqs:
            if allocate(seq, 1) is None:
                raise RuntimeError("out of blocks")
        for seq in seqs:
            seq.num_computed_tokens += 1
            cache(seq)

    def advance() -> None:
        # Outside the timed region: the runner samples one token per request.
        for seq in seqs:
            if len(seq.tokens) == seq.num_computed_tokens:
                seq.tokens.append(rng.randrange(32_000))

    samples = _time(step, repeats, setup=advance)
    kv.check_invariants()
    return samples


def bench_alloc_free(repeats: int, policy: str) -> list[float]:
    """(b) allocate_slots of a 4,000-token request, then free it."""
    rng = random.Random(1)
    kv = KVCacheManager(KVCacheConfig(num_blocks=20_000, block_size=16, eviction_policy=policy))
    seq = _Seq("long", [rng.randrange(32_000) for _ in range(4_000)], num_prompt=4_000)

    def alloc_free() -> None:
        if kv.allocate_slots(seq, 4_000) is None:
            raise RuntimeError("out of blocks")
        kv.free("long")

    samples = _time(alloc_free, repeats)
    kv.check_invariants()
    return samples


def bench_alloc_free_evicting(repeats: int, policy: str) -> list[float]:
    """(b') as (b), but every block handed out is evicted from the cached-free list."""
    rng = random.Random(2)
    num_blocks = 250  # exactly the 4,000-token request at 16 tokens per block
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=16, eviction_policy=policy))
    seq = _Seq("long", [], num_prompt=4_000)

    def fill_with_cached_blocks() -> None:
        # Outside the timed region: a different 4,000-token prompt computed, keyed and freed.
        seq.tokens = [rng.randrange(32_000) for _ in range(4_000)]
        seq.num_computed_tokens = 0
        if kv.allocate_slots(seq, 4_000) is None:
            raise RuntimeError("out of blocks")
        seq.num_computed_tokens = 4_000
        kv.cache_full_blocks(seq)
        kv.free("long")
        seq.num_computed_tokens = 0
        assert kv.num_cached_free_blocks == num_blocks

    def alloc_free() -> None:
        if kv.allocate_slots(seq, 4_000) is None:
            raise RuntimeError("out of blocks")
        kv.free("long")

    samples = _time(alloc_free, repeats, setup=fill_with_cached_blocks)
    kv.check_invariants()
    assert kv.make_stats().evictions_total == repeats * num_blocks
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=400)
    args = parser.parse_args()
    cases: list[tuple[str, Callable[[int, str], list[float]], float, int]] = [
        ("(a) decode step, 256 x ~1k tok", bench_decode_step, 0.5, 256),
        ("(b) alloc+free 4k tok", bench_alloc_free, 0.2, 1),
        ("(b') alloc+free 4k tok, evicting", bench_alloc_free_evicting, 0.2, 1),
    ]
    rows: list[tuple[str, str, list[float], float, int]] = []
    for name, bench, target_ms, per in cases:
        for policy in ("lru", "lfu", "shared-prefix"):
            rows.append((name, policy, bench(args.repeats, policy), target_ms, per))
    header = (
        f"{'benchmark':<34} {'policy':<14} {'median ms':>10} {'p90 ms':>8} {'min ms':>8} "
        f"{'target ms':>10} {'us/req':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, policy, samples, target_ms, per in rows:
        median = statistics.median(samples) * 1e3
        print(
            f"{name:<34} {policy:<14} {median:>10.3f} {_percentile(samples, 0.9) * 1e3:>8.3f} "
            f"{min(samples) * 1e3:>8.3f} {target_ms:>10.2f} {median * 1e3 / per:>7.2f}"
        )


if __name__ == "__main__":
    main()
