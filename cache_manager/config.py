"""KVCacheConfig: the one frozen configuration of the cache manager."""

from __future__ import annotations

from dataclasses import dataclass

from cache_manager.strategy import KV_STRATEGIES

EVICTION_POLICIES = ("lru", "lfu", "shared-prefix")


@dataclass(frozen=True, slots=True)
class KVCacheConfig:
    """Shape and behaviour of the paged KV cache.

    ``block_size`` is tokens per block. ``sliding_window`` (tokens) lets blocks that fall
    wholly out of the attention window be released; it also reserves block 0 as the null
    block that released table positions point at (see ``KVCacheManager.release_out_of_window``).
    ``block_bytes`` only feeds the memory figures of ``KVCacheStats``.

    ``attention_sinks`` (tokens, StreamingLLM) keeps the blocks of a request's first
    ``attention_sinks`` tokens when the window releases the rest; it needs a window, and a
    request may then run past the model's context (the scheduler allows it).
    ``kv_strategy`` / ``kv_strategy_threshold`` (tokens): see ``cache_manager.strategy``;
    ``adaptive`` reserves the null block too.
    ``kv_tier``: evicted keyed blocks are spilled and staged blocks restored (see
    ``cache_manager.tier``); needs prefix caching to matter.
    """

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"  # "lru" | "lfu" | "shared-prefix"
    sliding_window: int | None = None
    block_bytes: int = 0
    attention_sinks: int = 0
    kv_strategy: str = "always"  # "always" | "long-sequence-only" | "adaptive" | "disabled"
    kv_strategy_threshold: int = 512
    kv_tier: bool = False  # tier 2 below the prefix cache (server.kv_tier moves the bytes)

    @property
    def reserves_null_block(self) -> bool:
        """Whether block 0 is the null block that released table positions point at."""
        return self.sliding_window is not None or self.kv_strategy == "adaptive"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        min_blocks = 2 if self.reserves_null_block else 1
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"num_blocks must be >= {min_blocks} (sliding_window={self.sliding_window}, "
                f"kv_strategy={self.kv_strategy!r}: one null block is reserved), "
                f"got {self.num_blocks}"
            )
        if self.eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {list(EVICTION_POLICIES)}, "
                f"got {self.eviction_policy!r}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 tokens, got {self.sliding_window}")
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0 tokens, got {self.attention_sinks}")
        if self.attention_sinks and self.sliding_window is None:
            raise ValueError(
                f"attention_sinks={self.attention_sinks} needs a sliding window: the sinks are "
                "kept while the window releases the tokens between them and the window "
                "(set --sliding-window)"
            )
        if self.kv_strategy not in KV_STRATEGIES:
            raise ValueError(
                f"kv_strategy must be one of {list(KV_STRATEGIES)}, got {self.kv_strategy!r}"
            )
        if self.kv_strategy_threshold < 1:
            raise ValueError(
                f"kv_strategy_threshold must be >= 1 tokens, got {self.kv_strategy_threshold}"
            )
        if self.block_bytes < 0:
            raise ValueError(f"block_bytes must be >= 0, got {self.block_bytes}")
