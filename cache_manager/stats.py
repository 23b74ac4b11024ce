"""KVCacheStats: a plain snapshot of the cache manager, read by metrics and the gRPC edge."""

from __future__ import annotations

from dataclasses import dataclass, field

# Why a tier-2 operation failed (each degrades to a miss or a dropped spill, never an error).
TIER_ERROR_KINDS = (
    "open",
    "write",
    "disk_full",
    "read",
    "checksum",
    "truncated",
    "stale_lock",
    "backlog",
)


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """The store side of tier 2 (``server.kv_tier``): what it holds and what moved.

    ``num_blocks`` / ``num_bytes`` are the whole store (shared by the replicas on a host);
    the ``*_total`` counters are this process's since start-up.
    """

    backend: str  # "lmdb" | "file" | "off" (the store could not be opened)
    capacity_bytes: int
    num_blocks: int = 0
    num_bytes: int = 0
    spill_blocks_total: int = 0  # written to the store (duplicates skipped)
    spill_bytes_total: int = 0
    spill_seconds_total: float = 0.0  # background writer time
    restore_blocks_total: int = 0  # read back into the pool
    restore_bytes_total: int = 0
    restore_seconds_total: float = 0.0  # store reads (background) + copies into the pool
    lookups_blocks_total: int = 0  # blocks looked up in the store
    errors_total: dict[str, int] = field(default_factory=dict)  # kind -> count


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """One point-in-time snapshot of the paged KV cache.

    Counters named ``*_total`` are cumulative since start-up, so rates (hit rate over a
    window) can be computed downstream from two snapshots.
    """

    block_size: int
    num_blocks_total: int
    num_blocks_used: int  # referenced by at least one block table
    num_blocks_cached_free: int  # free, but still holding a prefix-cache key (evictable)
    num_blocks_free: int  # free and holding nothing
    total_sequences: int  # requests that hold blocks now
    total_tokens: int  # tokens held by those requests (token slots in use)
    block_bytes: int  # bytes of KV one block occupies across all layers
    total_memory_bytes: int  # KV pool size in bytes (num_blocks_total * block_bytes)
    used_memory_bytes: int  # num_blocks_used * block_bytes
    average_sequence_length: float  # total_tokens / total_sequences (0.0 when empty)
    cache_efficiency: float  # token slots in use / token slots allocated (0.0 when empty)
    usage: float  # num_blocks_used / num_blocks_total
    prefix_queries_tokens_total: int  # prompt tokens looked up in the prefix cache
    prefix_hits_tokens_total: int  # of those, tokens found cached
    cache_hit_rate: float  # prefix_hits_tokens_total / prefix_queries_tokens_total (0.0 if none)
    evictions_total: int  # cached-free blocks whose key was dropped to hand the block out
    cow_copies_total: int  # copy-on-write block copies
    # Blocks never handed out (the sliding-window null block); used + cached_free + free +
    # reserved == num_blocks_total.
    num_blocks_reserved: int = 0
    # The KV strategy (``cache_manager.strategy``) and what it took away: KV dropped after a
    # step to be recomputed (disabled, long-sequence-only), and old tokens released from the
    # longest requests under memory pressure (adaptive; cached prefixes it evicted first are
    # in ``evictions_total``).
    kv_strategy: str = "always"
    strategy_dropped_tokens_total: int = 0
    strategy_windowed_tokens_total: int = 0
    # The sliding layers' own blocks (Gemma 3; ``cache_manager.hybrid``), 0 without them:
    # their pool, the blocks its tables reference, and the blocks released out of the window.
    sliding_blocks_total: int = 0
    sliding_blocks_used: int = 0
    sliding_blocks_released_total: int = 0
    # Tier 2 (``cache_manager.tier``): prefix-hit blocks restored from it, and their tokens
    # (also counted in ``prefix_hits_tokens_total``; tier 1 = all hits - tier 2), and keyed
    # blocks spilled to it when evicted. ``tier2`` is the store's side, filled in by the
    # engine; None when the tier is off.
    tier2_hit_blocks_total: int = 0
    tier2_hit_tokens_total: int = 0
    tier2_spill_blocks_total: int = 0
    tier2: KVTierStats | None = None

    @classmethod
    def make_empty(
        cls, num_blocks: int = 0, block_size: int = 16, block_bytes: int = 0
    ) -> KVCacheStats:
        return cls(
            block_size=block_size,
            num_blocks_total=num_blocks,
            num_blocks_used=0,
            num_blocks_cached_free=0,
            num_blocks_free=num_blocks,
            total_sequences=0,
            total_tokens=0,
            block_bytes=block_bytes,
            total_memory_bytes=num_blocks * block_bytes,
            used_memory_bytes=0,
            average_sequence_length=0.0,
            cache_efficiency=0.0,
            usage=0.0,
            prefix_queries_tokens_total=0,
            prefix_hits_tokens_total=0,
            cache_hit_rate=0.0,
            evictions_total=0,
            cow_copies_total=0,
        )
