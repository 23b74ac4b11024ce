"""Checking a ``KVCacheManager`` without changing it: the statistics snapshot, the invariant check
the tests run after every step, and the validation of a prefix hit before it is taken. Reads
the manager's state; pure Python."""

from __future__ import annotations

import weakref
from typing import Protocol

from cache_manager.allocation import CacheSequence, PrefixHit, RequestBlocks
from cache_manager.block import KVBlock
from cache_manager.block_pool import BlockPool
from cache_manager.config import KVCacheConfig
from cache_manager.stats import KVCacheStats
from cache_manager.strategy import KVStrategy
from cache_manager.tier import TierLedger


class KVCacheManager(Protocol):
    """The state of ``cache_manager.manager.KVCacheManager`` these checks read (a Protocol,
    so this module does not import the manager that calls it)."""

    config: KVCacheConfig
    block_size: int
    num_blocks: int
    num_sink_blocks: int
    enable_prefix_caching: bool
    strategy: KVStrategy
    _pool: BlockPool
    _blocks: list[KVBlock]
    _null_block: KVBlock | None
    _requests: dict[str, RequestBlocks]
    _tier: TierLedger | None
    _consumed_hits: weakref.WeakSet[PrefixHit]
    _num_used_slots: int
    _num_held_tokens: int
    _num_prefix_queries_tokens: int
    _num_prefix_hits_tokens: int
    _num_cow_copies: int
    _num_dropped_tokens: int
    _num_windowed_tokens: int

    @property
    def num_usable_blocks(self) -> int: ...

    def _held_tokens(self, state: RequestBlocks) -> int: ...


def make_stats(manager: KVCacheManager) -> KVCacheStats:
    """A snapshot. Definitions:

    - ``total_tokens``: per request, the slots it has written or is writing (its
      ``num_computed_tokens`` plus the new tokens of its last ``allocate_slots``, or its
      hit tokens) minus the slots released out of its window; summed over requests, so a
      prefix shared by two requests counts twice.
    - ``cache_efficiency``: slots holding KV in referenced blocks (each block once) over
      the slots of those blocks, ``num_blocks_used * block_size``. Reserved but unwritten
      slots and half-filled tails lower it.
    - ``usage``: referenced blocks over allocatable blocks (the null block excluded).
    - prefix queries/hits: cumulative tokens, counted once per ``PrefixHit`` consumed by
      an allocation (a lookup whose admission failed for room counts nothing).
    """
    pool = manager._pool
    bs = manager.block_size
    num_free = len(pool.empty)
    num_cached_free = len(pool.policy)
    num_reserved = pool.num_reserved
    num_used = manager.num_blocks - num_reserved - num_free - num_cached_free
    num_seqs = len(manager._requests)
    total_tokens = manager._num_held_tokens
    block_bytes = manager.config.block_bytes
    queries = manager._num_prefix_queries_tokens
    hits = manager._num_prefix_hits_tokens
    tier = manager._tier
    return KVCacheStats(
        block_size=bs,
        num_blocks_total=manager.num_blocks,
        num_blocks_used=num_used,
        num_blocks_cached_free=num_cached_free,
        num_blocks_free=num_free,
        total_sequences=num_seqs,
        total_tokens=total_tokens,
        block_bytes=block_bytes,
        total_memory_bytes=manager.num_blocks * block_bytes,
        used_memory_bytes=num_used * block_bytes,
        average_sequence_length=total_tokens / num_seqs if num_seqs else 0.0,
        cache_efficiency=manager._num_used_slots / (num_used * bs) if num_used else 0.0,
        usage=num_used / manager.num_usable_blocks,
        prefix_queries_tokens_total=queries,
        prefix_hits_tokens_total=hits,
        cache_hit_rate=hits / queries if queries else 0.0,
        evictions_total=pool.num_evictions,
        cow_copies_total=manager._num_cow_copies,
        num_blocks_reserved=num_reserved,
        kv_strategy=manager.strategy.name,
        strategy_dropped_tokens_total=manager._num_dropped_tokens,
        strategy_windowed_tokens_total=manager._num_windowed_tokens,
        tier2_hit_blocks_total=0 if tier is None else tier.num_hit_blocks,
        tier2_hit_tokens_total=0 if tier is None else tier.num_hit_blocks * bs,
        tier2_spill_blocks_total=0 if tier is None else tier.num_spilled_blocks,
    )


def check_invariants(manager: KVCacheManager) -> None:
    """Raise RuntimeError on any inconsistency between tables, ref counts, free list and
    prefix map. O(num_blocks + table sizes): for tests and debugging, not the hot path."""
    pool = manager._pool
    free_ids, _ = pool.check()
    null = manager._null_block
    bs = manager.block_size
    sinks = manager.num_sink_blocks
    holders = [0] * manager.num_blocks
    held_tokens = 0
    for request_id, state in manager._requests.items():
        blocks = state.blocks
        if len(blocks) != len(state.block_ids):
            raise RuntimeError(f"request {request_id!r}: blocks and block_ids differ in length")
        if len(state.block_keys) > len(blocks):
            raise RuntimeError(f"request {request_id!r}: more keys than blocks")
        for p, block in enumerate(blocks):
            if state.block_ids[p] != block.block_id:
                raise RuntimeError(
                    f"request {request_id!r}: block_ids[{p}]={state.block_ids[p]} but the "
                    f"table holds block {block.block_id}"
                )
            released = sinks <= p < sinks + state.num_released
            if (block is null) != released:
                raise RuntimeError(
                    f"request {request_id!r}: position {p} null={block is null} but "
                    f"{state.num_released} positions after {sinks} sink blocks are released"
                )
            if block is null:
                continue
            holders[block.block_id] += 1
            if (
                p < len(state.block_keys)
                and block.block_hash is not None
                and block.block_hash != state.block_keys[p]
            ):
                raise RuntimeError(
                    f"request {request_id!r}: block {block.block_id} at position {p} holds "
                    "another prefix's key"
                )
        if state.num_slots > len(blocks) * bs:
            raise RuntimeError(
                f"request {request_id!r}: {state.num_slots} slots in {len(blocks)} blocks"
            )
        held_tokens += manager._held_tokens(state)
    used_slots = 0
    for block in pool.blocks:
        if block is null:
            continue
        if block.ref_count != holders[block.block_id]:
            raise RuntimeError(
                f"block {block.block_id}: ref_count={block.ref_count} but "
                f"{holders[block.block_id]} block tables hold it"
            )
        if block.ref_count == 0 and block.block_id not in free_ids:
            raise RuntimeError(f"block {block.block_id} leaked: neither free nor referenced")
        if not 0 <= block.num_filled <= bs:
            raise RuntimeError(f"block {block.block_id}: num_filled={block.num_filled}")
        if block.ref_count and block.block_hash is not None and block.num_filled != bs:
            raise RuntimeError(f"keyed block {block.block_id} is not full")
        used_slots += block.num_filled
    if used_slots != manager._num_used_slots:
        raise RuntimeError(f"used slots: counter {manager._num_used_slots}, blocks {used_slots}")
    if held_tokens != manager._num_held_tokens:
        raise RuntimeError(f"held tokens: counter {manager._num_held_tokens}, tables {held_tokens}")
    if not manager.enable_prefix_caching and pool.cached:
        raise RuntimeError("prefix caching is off but blocks have keys")
    if manager._tier is not None:
        for block_id in manager._tier.pending_restore_ids():
            block = pool.blocks[block_id]
            if block.ref_count == 0 or block.block_hash is None:
                raise RuntimeError(f"restore into block {block_id}, which is free or keyless")


def check_hit(
    manager: KVCacheManager, seq: CacheSequence, state: RequestBlocks | None, hit: PrefixHit
) -> None:
    """ValueError unless ``hit`` can be taken by ``seq`` now (see ``allocate_slots``).

    The blocks were verified against the tokens when the hit was looked up; here only
    their keys are compared, which a block loses when it is handed out in between.
    """
    request_id = seq.request_id
    if hit in manager._consumed_hits:
        raise ValueError(f"request {request_id!r}: this prefix hit was already consumed")
    if hit.request_id != request_id:
        raise ValueError(
            f"request {request_id!r}: the prefix hit was looked up for {hit.request_id!r}"
        )
    if hit.blocks and not manager.enable_prefix_caching:
        raise ValueError("a prefix hit was passed but prefix caching is disabled")
    if (state is not None and state.blocks) or seq.num_computed_tokens != 0:
        raise ValueError(
            f"request {request_id!r}: prefix hits are only taken by a request without "
            f"blocks and with num_computed_tokens == 0 (has "
            f"{0 if state is None else len(state.blocks)} blocks, "
            f"num_computed_tokens={seq.num_computed_tokens})"
        )
    num_tokens = len(seq.all_token_ids)
    if hit.num_tokens >= num_tokens:
        raise ValueError(
            f"request {request_id!r}: {len(hit.blocks)} hit blocks cover {hit.num_tokens} "
            f"tokens of {num_tokens}; a hit never covers the last token"
        )
    bs = manager.block_size
    pool_blocks = manager._blocks
    num_memory = len(hit.blocks)
    if hit.restore and manager._tier is None:
        raise ValueError("a prefix hit restores from tier 2 but the tier is off")
    for entry in hit.restore:
        if entry.key in manager._pool.cached:
            raise ValueError(
                f"request {request_id!r}: a staged block's key is cached again; call "
                "get_computed_blocks right before allocating"
            )
    for i, (block, key) in enumerate(zip(hit.blocks, hit.keys[:num_memory], strict=True)):
        if block.block_hash != key or pool_blocks[block.block_id] is not block:
            raise ValueError(
                f"request {request_id!r}: block {block.block_id} does not hold its tokens "
                f"{i * bs}..{(i + 1) * bs - 1}; call get_computed_blocks right before "
                "allocating (a block handed out in between loses its key)"
            )
