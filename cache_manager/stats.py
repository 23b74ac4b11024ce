"""KVCacheStats: a plain snapshot of the cache manager, read by metrics and the gRPC edge."""

from __future__ import annotations

from dataclasses import dataclass


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
