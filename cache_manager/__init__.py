"""Paged KV-cache manager: block pool, block tables, prefix cache, eviction, statistics.

Pure Python bookkeeping (no torch, no I/O): which block holds which request's tokens.
"""

from cache_manager.allocation import Allocation, CacheSequence, PrefixHit
from cache_manager.block import BlockQueue, KVBlock
from cache_manager.block_pool import BlockPool
from cache_manager.config import EVICTION_POLICIES, KVCacheConfig
from cache_manager.eviction import (
    EvictionPolicy,
    LFUEviction,
    LRUEviction,
    SharedPrefixEviction,
    make_eviction_policy,
)
from cache_manager.hashing import hash_block_tokens, prefix_block_keys
from cache_manager.manager import KVCacheManager
from cache_manager.sizing import (
    ModelShape,
    block_bytes,
    kv_memory_bytes,
    kv_memory_bytes_paged,
    num_blocks_for_budget,
)
from cache_manager.stats import TIER_ERROR_KINDS, KVCacheStats, KVTierStats
from cache_manager.tier import TierBlock, TierPlan

__all__ = [
    "EVICTION_POLICIES",
    "TIER_ERROR_KINDS",
    "Allocation",
    "BlockPool",
    "BlockQueue",
    "CacheSequence",
    "EvictionPolicy",
    "KVBlock",
    "KVCacheConfig",
    "KVCacheManager",
    "KVCacheStats",
    "KVTierStats",
    "LFUEviction",
    "LRUEviction",
    "ModelShape",
    "PrefixHit",
    "SharedPrefixEviction",
    "TierBlock",
    "TierPlan",
    "block_bytes",
    "hash_block_tokens",
    "kv_memory_bytes",
    "kv_memory_bytes_paged",
    "make_eviction_policy",
    "num_blocks_for_budget",
    "prefix_block_keys",
]
