"""KVCacheConfig: the one frozen configuration of the cache manager."""

from __future__ import annotations

from dataclasses import dataclass

EVICTION_POLICIES = ("lru", "lfu", "shared-prefix")


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Shape and behaviour of the paged KV cache.

    ``block_size`` is tokens per block. ``sliding_window`` (tokens) lets blocks that fall
    wholly out of the attention window be released; it also reserves block 0 as the null
    block that released table positions point at (see ``KVCacheManager.release_out_of_window``).
    ``block_bytes`` only feeds the memory figures of ``KVCacheStats``.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"  # "lru" | "lfu" | "shared-prefix"
    sliding_window: int | None = None
    block_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        min_blocks = 2 if self.sliding_window is not None else 1
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"num_blocks must be >= {min_blocks} (sliding_window={self.sliding_window} "
                f"reserves one null block), got {self.num_blocks}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {list(EVICTION_POLICIES)}, "
                f"got {self.eviction_policy!r}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 tokens, got {self.sliding_window}")
        if self.block_bytes < 0:
            raise ValueError(f"block_bytes must be >= 0, got {self.block_bytes}")
