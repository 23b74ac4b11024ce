"""KVCacheManager: block tables, prefix hits, copy-on-write, sliding windows, statistics.

The scheduler sees only this class. Per request it keeps a block table: position ``p`` of the
request's token sequence lives in ``block_ids[p // block_size]`` at offset ``p % block_size``::

    block_ids    [   7   |   2   |    9    |    4    ]      block_size = 4
    positions     0 .. 3  4 .. 7  8 .. 11   12 .. 15
                 | keyed: full + computed | partial | reserved, not yet written |
                                              ^ num_computed_tokens = 10

Progress is the request's ``num_computed_tokens`` (owned by the scheduler). A step of
``allocate_slots(seq, n)`` makes the table cover ``num_computed_tokens + n`` slots; after the
step advanced ``num_computed_tokens``, ``cache_full_blocks(seq)`` gives every newly full,
computed block its prefix-cache key. At admission ``get_computed_blocks(seq)`` returns a
``PrefixHit`` (verified blocks and their keys) that ``allocate_slots(seq, n, hit)`` consumes.
The keys' chain and the lookup live in ``cache_manager.prefix``.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from cache_manager import audit, prefix
from cache_manager.allocation import (
    NOTHING_NEW,
    Allocation,
    CacheSequence,
    Growth,
    PrefixHit,
    RequestBlocks,
)
from cache_manager.block import KVBlock
from cache_manager.block_pool import BlockPool
from cache_manager.config import KVCacheConfig
from cache_manager.eviction import make_eviction_policy
from cache_manager.stats import KVCacheStats
from cache_manager.strategy import make_kv_strategy
from cache_manager.tier import TierBlock, TierLedger, TierPlan


class KVCacheManager:
    """The paged KV cache as the scheduler sees it. Pure bookkeeping: no tensors, no I/O.

    Semantics shared by every method: ``None`` means "not now" (no room), an exception means
    a caller bug (unknown request, double free, stale prefix hit). A method that returns
    ``None`` has changed nothing.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.strategy = make_kv_strategy(config.kv_strategy, config.kv_strategy_threshold)
        # Disabled keeps nothing, not even prefixes for later requests.
        self.enable_prefix_caching = (
            config.enable_prefix_caching and config.kv_strategy != "disabled"
        )
        self.sliding_window = config.sliding_window
        self.attention_sinks = config.attention_sinks
        # Sinks are kept as whole blocks: the first ceil(sinks / block_size) of a table.
        self.num_sink_blocks = -(-config.attention_sinks // config.block_size)
        self._tier = TierLedger() if config.kv_tier and self.enable_prefix_caching else None
        self._pool = BlockPool(
            config.num_blocks,
            make_eviction_policy(config.eviction_policy),
            reserve_null=config.reserves_null_block,
            tier=self._tier,
        )
        self._blocks = self._pool.blocks
        self._null_block = self._pool.null_block
        self._requests: dict[str, RequestBlocks] = {}
        self._num_prefix_queries_tokens = 0
        self._num_prefix_hits_tokens = 0
        self._consumed_hits: weakref.WeakSet[PrefixHit] = weakref.WeakSet()
        self._num_cow_copies = 0
        self._num_used_slots = 0  # sum of num_filled over referenced blocks
        self._num_held_tokens = 0  # sum over requests of their slots minus released ones
        self._num_dropped_tokens = 0  # KV dropped after a step by the strategy (recomputed)
        self._num_windowed_tokens = 0  # KV released by the adaptive strategy under pressure

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: empty ones plus cached-free ones (evictable)."""
        return self._pool.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a prefix-cache key."""
        return len(self._pool.policy)

    @property
    def null_block_id(self) -> int | None:
        """Block id that released sliding-window positions point at (None without a window)."""
        return None if self._null_block is None else self._null_block.block_id

    @property
    def num_usable_blocks(self) -> int:
        """Every block a request could ever get: the pool minus the reserved null block."""
        return self.num_blocks - self._pool.num_reserved

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks referenced by some request."""
        usable = self.num_usable_blocks
        return (usable - self._pool.num_free) / usable

    @property
    def releases_out_of_window(self) -> bool:
        """Whether ``release_out_of_window`` may release blocks (a window, here or hybrid's)."""
        return self.sliding_window is not None

    @property
    def streams_past_context(self) -> bool:
        """Whether a request may run past the model's context: with attention sinks, its
        cache holds the sinks and the window, with positions within the cache."""
        return self.attention_sinks > 0

    def max_resident_blocks(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks one request of ``num_tokens`` tokens holds at a time when its
        chunks are at most ``max_chunk_tokens``: all of them, or under a sliding window the
        sink blocks, the window plus one chunk, and one partial block."""
        num_all = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return num_all
        window = self.num_blocks_for(self.sliding_window + max_chunk_tokens) + 1
        return min(num_all, self.num_sink_blocks + window)

    def keeps_kv(self, seq: CacheSequence) -> bool:
        """Whether the strategy lets ``seq`` keep its KV for its next step (else call
        ``drop_kv`` after the step and recompute it from position 0)."""
        return self.strategy.retains(len(seq.all_token_ids))

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (KeyError if it holds no table)."""
        return list(self._requests[request_id].block_ids)

    @property
    def has_window_tables(self) -> bool:
        """Whether the sliding layers hold tables of their own (``cache_manager.hybrid``)."""
        return False

    def window_block_ids(self, request_id: str) -> list[int] | None:
        """The sliding layers' own table when they hold one (``cache_manager.hybrid``)."""
        return None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def free_block_ids(self) -> list[int]:
        """The free list, front (handed out next) to back: empty blocks, then the evictable
        cached blocks in the eviction policy's order."""
        return self._pool.free_block_ids()

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(
        self, seq: CacheSequence, max_num_tokens: int | None = None
    ) -> PrefixHit:
        """Longest cached prefix of ``seq.all_token_ids`` in full blocks, at most
        ``max_num_tokens`` tokens.

        Never covers the last token (its logits must be computed), so at most
        ``(len(tokens) - 1) // block_size`` blocks. Each hit is verified against parent key,
        salt and tokens (``BlockPool.lookup``). Takes no references and counts nothing: hand
        the hit to ``allocate_slots`` (or ``reserve_slots``) before anything else allocates;
        it is counted in the prefix statistics when an allocation consumes it. Empty when
        prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return PrefixHit(seq.request_id, (), (), 0, 0)
        return prefix.longest_hit(seq, self._pool, self._tier, self.block_size, max_num_tokens)

    def cache_full_blocks(self, seq: CacheSequence) -> None:
        """Give each newly full, computed block of ``seq`` its prefix-cache key.

        Call after a step advanced ``seq.num_computed_tokens``. Key of block i =
        hash(key of block i-1, its token ids, cache_salt). A block whose key another block
        already holds stays keyless (the first one keeps serving hits). No-op when prefix
        caching is off. KeyError if the request holds no table.
        """
        if not self.enable_prefix_caching:
            return
        state = self._requests[seq.request_id]
        prefix.key_full_blocks(seq, state, self._pool, self._null_block, self.block_size)

    # ------------------------------------------------------------------ tier 2

    @property
    def has_tier(self) -> bool:
        """Whether evicted keyed blocks spill to tier 2 (``KVCacheConfig.kv_tier``)."""
        return self._tier is not None

    def has_cached_key(self, key: bytes) -> bool:
        """Whether a block of the pool holds the prefix-cache key ``key`` now."""
        return key in self._pool.cached

    def take_tier_plan(self) -> TierPlan:
        """The spills and restores planned since the last call (see ``cache_manager.tier``):
        the engine moves their bytes before the step's forward pass. Empty without the tier."""
        return TierPlan() if self._tier is None else self._tier.take_plan()

    def stage_tier_blocks(self, request_id: str, blocks: Sequence[TierBlock]) -> None:
        """``blocks``, read from tier 2 for ``request_id``, are in host memory: its next
        ``get_computed_blocks`` may continue into them past its tier-1 hit. Consumed by its
        admission; ``unstage_tier_blocks`` drops them otherwise. No-op without the tier."""
        if self._tier is not None:
            self._tier.stage(request_id, blocks)

    def unstage_tier_blocks(self, request_id: str) -> None:
        if self._tier is not None:
            self._tier.unstage(request_id)

    def staged_tier_request_ids(self) -> list[str]:
        return [] if self._tier is None else self._tier.staged_request_ids()

    def reset_prefix_cache(self) -> bool:
        """Drop every prefix-cache key. Refused (False, nothing changed) while any request
        holds a block table; True once done."""
        if self._requests:
            return False
        done = self._pool.reset_prefix_cache()
        assert done, "no request holds blocks, yet some block is referenced"
        return True

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self, seq: CacheSequence, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> Allocation | None:
        """Make the table cover ``start + num_new_tokens`` slots, where ``start`` is
        ``num_computed_tokens``, or ``hit.num_tokens`` when a prefix hit is handed over.

        A ``hit`` (from ``get_computed_blocks``) is only taken by the request it was looked
        up for, while it holds no blocks and ``num_computed_tokens == 0``; its blocks are
        referenced (a free one leaves the free list) and come first in the table, and the hit
        is counted in the prefix statistics. A hit is consumed once (ValueError when reused,
        or stale: one of its blocks lost its key). Blocks about to be written that another
        request also holds are copied on write: the table gets a fresh block, and if it
        already held computed tokens of this request the pair lands in ``block_copies``.
        Returns None, changing nothing, when the free list cannot supply every block.
        The caller then sets ``num_computed_tokens`` (to the hit's tokens at admission) and
        advances it after the step.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        return self._grow(seq, num_new_tokens, 0, hit)

    def reserve_slots(
        self,
        seq: CacheSequence,
        num_total_tokens: int,
        hit: PrefixHit | None = None,
        num_new_tokens: int = 0,
    ) -> Allocation | None:
        """Reserve mode: make the table cover ``num_total_tokens`` slots, all private, up front.

        For a scheduler that admits a request at its maximum length and never preempts:
        afterwards no ``allocate_slots`` call within ``num_total_tokens`` takes a block.
        Besides appending blocks, every block from ``num_computed_tokens`` on that another
        request also holds (after ``fork``) is copied on write now: a copy if it holds
        computed slots of this request (``block_copies``), a plain replacement if not. So
        after a fork in reserve mode, call ``reserve_slots`` for the parent and each child.
        A ``hit`` and the first ``num_new_tokens`` to write are taken as in
        ``allocate_slots``, atomically with the reservation. None (nothing changed) when
        there is no room.
        """
        if min(num_total_tokens, num_new_tokens) < 0:
            raise ValueError(f"need token counts >= 0, got {num_total_tokens}, {num_new_tokens}")
        return self._grow(seq, num_new_tokens, num_total_tokens, hit)

    def num_blocks_to_take(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        num_total_tokens: int = 0,
        hit: PrefixHit | None = None,
    ) -> int:
        """Free-list blocks ``reserve_slots(seq, num_total_tokens, hit, num_new_tokens)``
        (or ``allocate_slots`` with ``num_total_tokens`` 0) would take now; changes nothing.
        A caller growing several managers together checks each before growing any."""
        return self._measure(seq, num_new_tokens, num_total_tokens, hit).num_take

    def _measure(
        self, seq: CacheSequence, num_new: int, num_total: int, hit: PrefixHit | None
    ) -> Growth:
        """What ``_grow`` would do, before it does anything (a bad hit raises here)."""
        request_id = seq.request_id
        state = self._requests.get(request_id)
        if hit is not None:
            audit.check_hit(self, seq, state, hit)
            blocks: Sequence[KVBlock] = hit.blocks
            start = hit.num_tokens
        elif state is None:
            if seq.num_computed_tokens != 0:
                raise ValueError(
                    f"request {request_id!r} holds no blocks but has num_computed_tokens="
                    f"{seq.num_computed_tokens}; KV without blocks cannot exist"
                )
            blocks = ()
            start = 0
        else:
            blocks = state.blocks
            start = seq.num_computed_tokens
        bs = self.block_size
        end = start + num_new
        target = end if end > num_total else num_total
        num_have = len(blocks) + (len(hit.restore) if hit is not None else 0)
        num_written = -(-end // bs)  # blocks holding the slots written up to end
        num_need = num_written if target == end else -(-target // bs)
        num_fresh = num_need - num_have if num_need > num_have else 0
        # Existing blocks the range [start, target) will write: [first, last).
        first = start // bs
        last = (num_need if num_need < num_have else num_have) if target > start else 0
        num_cow = 0
        for p in range(first, last):
            if blocks[p].ref_count > 1:
                num_cow += 1
        num_take = num_fresh + num_cow
        if hit is not None:  # hit blocks on the free list leave it; restores take fresh ones
            num_take += sum(1 for b in blocks if b.ref_count == 0) + len(hit.restore)
        return Growth(state, start, end, first, last, num_written, num_fresh, num_cow, num_take)

    def _grow(
        self, seq: CacheSequence, num_new: int, num_total: int, hit: PrefixHit | None
    ) -> Allocation | None:
        """The one allocation core behind ``allocate_slots`` and ``reserve_slots``::

            | hit blocks | computed | new: written this step | reserved, not yet written |
                         ^ start    ^                        ^ end      num_total ^

        The table grows to ``max(end, num_total)`` slots; the blocks holding slots
        ``start ..`` of that range are made private (copy on write); the slots up to ``end``
        are counted as written. Checks room for everything first, so None changes nothing.
        """
        state, start, end, first, last, num_written, num_fresh, num_cow, num_take = self._measure(
            seq, num_new, num_total, hit
        )
        request_id = seq.request_id
        bs = self.block_size
        # The usual decode step takes no block: skip the free-list arithmetic then.
        if num_take and num_take > self._pool.num_free:
            return None
        if state is None:
            state = self._requests[request_id] = RequestBlocks()
        allocation = NOTHING_NEW
        if num_take or hit is not None:
            if hit is not None:
                self._take_hit(state, hit)
            copies = self._copy_on_write(state, first, last, start) if num_cow else []
            fresh = self._pool.take(num_fresh) if num_fresh else []
            new_ids = [b.block_id for b in fresh]
            state.blocks.extend(fresh)
            state.block_ids.extend(new_ids)
            # After a hit the table was empty: all of it is new.
            allocation = Allocation(new_ids if hit is None else list(state.block_ids), copies)
        blocks = state.blocks
        used_slots = self._num_used_slots
        for p in range(first, num_written):
            block = blocks[p]
            filled = end - p * bs
            if filled > bs:
                filled = bs
            if filled > block.num_filled:
                used_slots += filled - block.num_filled
                block.num_filled = filled
        self._num_used_slots = used_slots
        if end > state.num_slots:
            self._num_held_tokens += end - state.num_slots
            state.num_slots = end
        return allocation

    def _take_hit(self, state: RequestBlocks, hit: PrefixHit) -> None:
        """Reference the hit blocks (off the free list first, so the fresh blocks taken next
        can never evict them), seed the table and its keys, and count the hit once."""
        bs = self.block_size
        pool = self._pool
        for block in hit.blocks:
            if block.ref_count == 0:
                block.num_filled = bs
                self._num_used_slots += bs
            pool.touch(block)
            block.hit_count += 1
            block.is_shared = True
        state.blocks.extend(hit.blocks)
        if hit.restore:
            state.blocks.extend(self._take_restores(hit.restore))
        state.block_ids.extend([b.block_id for b in state.blocks])
        state.block_keys.extend(hit.keys)
        if self._tier is not None:
            self._tier.unstage(hit.request_id)
        self._num_prefix_queries_tokens += hit.num_query_tokens
        self._num_prefix_hits_tokens += hit.num_tokens
        self._consumed_hits.add(hit)

    def _take_restores(self, entries: Sequence[TierBlock]) -> list[KVBlock]:
        """Fresh blocks for staged tier-2 blocks: keyed now (they count as computed) and
        planned as restores, so the engine copies their bytes in before the step reads them."""
        tier = self._tier
        assert tier is not None
        pool = self._pool
        bs = self.block_size
        taken = pool.take(len(entries))
        for block, entry in zip(taken, entries, strict=True):
            registered = pool.register(
                block, entry.key, entry.parent_hash, entry.token_ids, entry.cache_salt
            )
            assert registered, "a staged key was cached between lookup and allocation"
            block.num_filled = bs
            block.is_shared = True  # a hit, as a tier-1 hit would be
            self._num_used_slots += bs
            tier.on_restore(block, entry.key)
        return taken

    def _copy_on_write(
        self, state: RequestBlocks, first: int, last: int, start: int
    ) -> list[tuple[int, int]]:
        """Give this request private copies of the shared blocks in table[first:last].

        A block holding slots this request already computed (below ``start``) is copied;
        one holding none of them is just replaced (the step writes it from scratch).
        """
        bs = self.block_size
        copies: list[tuple[int, int]] = []
        blocks = state.blocks
        for p in range(first, last):
            old = blocks[p]
            if old.ref_count <= 1:
                continue
            assert old.block_hash is None, f"block {old.block_id} is keyed yet being written"
            (new,) = self._pool.take(1)
            num_valid = min(bs, start - p * bs)
            if num_valid > 0:
                copies.append((old.block_id, new.block_id))
                new.num_filled = num_valid
                self._num_used_slots += num_valid
                self._num_cow_copies += 1
            old.ref_count -= 1
            blocks[p] = new
            state.block_ids[p] = new.block_id
        return copies

    # ------------------------------------------------------------------ release

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (ref_count + 1 each), and its prefix-cache
        progress; the caller gives the child the parent's tokens and ``num_computed_tokens``.
        Whichever side writes a shared block first copies it on write (``allocate_slots``),
        or ahead of time with ``reserve_slots`` in reserve mode. KeyError if the parent is
        unknown, ValueError if the child already holds blocks."""
        parent = self._requests[parent_id]
        if child_id in self._requests:
            raise ValueError(f"fork: child {child_id!r} already holds a block table")
        child = RequestBlocks(
            list(parent.blocks),
            list(parent.block_ids),
            list(parent.block_keys),
            parent.num_released,
            parent.num_slots,
        )
        null = self._null_block
        for block in parent.blocks:
            if block is not null:
                block.ref_count += 1
                block.is_shared = True
        self._requests[child_id] = child
        self._num_held_tokens += self._held_tokens(child)

    def free(self, request_id: str) -> None:
        """Release the request's whole table, exactly once (KeyError when unknown or already
        freed). Blocks are released tail first, so the tail is evicted before the head."""
        state = self._requests.pop(request_id, None)
        if state is None:
            raise KeyError(f"free: request {request_id!r} holds no blocks (unknown or freed)")
        self._num_held_tokens -= self._held_tokens(state)
        blocks = state.blocks
        num_released = state.num_released
        if num_released:
            sinks = self.num_sink_blocks
            blocks = blocks[:sinks] + blocks[sinks + num_released :]
        self._release(blocks[::-1])

    def drop_kv(self, request_id: str) -> None:
        """Free the request's table because the strategy keeps no KV for it between steps
        (``keeps_kv`` said no); the caller recomputes it from position 0. Counted in
        ``strategy_dropped_tokens_total``. KeyError as ``free``."""
        state = self._requests.get(request_id)
        if state is not None:
            self._num_dropped_tokens += self._held_tokens(state)
        self.free(request_id)

    def rollback_slots(self, seq: CacheSequence) -> int:
        """Speculative decoding: shrink the request's written slots back to
        ``seq.num_computed_tokens``, dropping the KV of rejected draft tokens; return how
        many blocks were freed::

            | computed (accepted) | rejected drafts: slots dropped | whole blocks freed |
                                  ^ num_computed_tokens

        The partial block keeps its computed slots (the next step writes the rest again);
        whole blocks past it go back to the free list, tail first, unless blocks reserved
        beyond them (``reserve_slots``) must keep their place in the table: then they stay,
        empty, as reserved blocks. Every block past the computed tokens was written this
        step, so it is private and keyless: a prefix-cached block is never touched (keys
        cover full, computed blocks only). No-op when nothing was written past
        ``num_computed_tokens``. KeyError if the request holds no table; ValueError if the
        shrink would cut a keyed block or a position released out of the window.
        """
        state = self._requests[seq.request_id]
        num_keep = seq.num_computed_tokens
        num_slots = state.num_slots
        if num_keep >= num_slots:
            return 0
        bs = self.block_size
        if num_keep < max(len(state.block_keys), state.num_released) * bs:
            raise ValueError(
                f"request {seq.request_id!r}: rollback to {num_keep} slots would cut its "
                f"{len(state.block_keys)} keyed / {state.num_released} released blocks of {bs}"
            )
        blocks = state.blocks
        num_blocks = -(-num_keep // bs)  # blocks still holding computed slots
        num_written = -(-num_slots // bs)
        used_slots = self._num_used_slots
        for p in range(num_keep // bs, num_written):
            block = blocks[p]
            assert block.ref_count == 1 and block.block_hash is None, (
                f"block {block.block_id} holds rejected slots yet is shared or keyed"
            )
            filled = min(bs, max(0, num_keep - p * bs))
            if block.num_filled > filled:
                used_slots -= block.num_filled - filled
                block.num_filled = filled
        self._num_used_slots = used_slots
        self._num_held_tokens -= num_slots - num_keep
        state.num_slots = num_keep
        if len(blocks) > num_written:  # reserved blocks follow: the table keeps its length
            return 0
        tail = blocks[num_blocks:]
        del blocks[num_blocks:]
        del state.block_ids[num_blocks:]
        self._release(tail[::-1])
        return len(tail)

    def release_out_of_window(self, seq: CacheSequence) -> int:
        """Sliding window: release the blocks no future query can attend to; return how many.

        The next query is at position ``num_computed_tokens`` and attends at most
        ``sliding_window`` positions back (and to the attention sinks), so a block after the
        sink blocks whose slots all lie below ``num_computed_tokens - sliding_window`` is
        dead. Released positions keep their place in the table but point at the null block
        (``null_block_id``, block 0, never handed out), so ``block_ids[p // block_size]``
        stays valid for every position p::

            | sink blocks | null ... null | window blocks ........ | being written |
              kept          released        p > computed - window

        The runner never reads a null block: it gathers the sinks, then from the first
        block that holds a visible key. Returns 0 without a window. KeyError if the request
        holds no table.
        """
        window = self.sliding_window
        if window is None:
            return 0
        state = self._requests[seq.request_id]
        limit = seq.num_computed_tokens - window
        return self._release_up_to(state, limit // self.block_size if limit > 0 else 0)

    def shrink_retention(self, seqs: Sequence[CacheSequence]) -> str | None:
        """Adaptive strategy under memory pressure (the free list, cached prefixes included,
        is empty): window the longest request of ``seqs`` that has something to give.

        It keeps its sink blocks and the blocks holding its last ``kv_strategy_threshold``
        computed tokens; the older ones are released to the null block (see
        ``release_out_of_window``) and counted in ``strategy_windowed_tokens_total``. The
        longest is the one with the most computed tokens, ties by the order given. Returns
        its id (the caller re-reads its block table), or None when no request can give
        anything (or the strategy is not adaptive): then the caller preempts.
        """
        if not self.strategy.windows_under_pressure:
            return None
        bs = self.block_size
        keep = self.strategy.threshold
        best: CacheSequence | None = None
        best_dead = 0
        for seq in seqs:
            state = self._requests.get(seq.request_id)
            if state is None:
                continue
            limit = seq.num_computed_tokens - keep
            num_dead = min(limit // bs if limit > 0 else 0, len(state.blocks))
            if num_dead <= self.num_sink_blocks + state.num_released:
                continue
            if best is None or seq.num_computed_tokens > best.num_computed_tokens:
                best, best_dead = seq, num_dead
        if best is None:
            return None
        state = self._requests[best.request_id]
        held_before = self._held_tokens(state)
        self._release_up_to(state, best_dead)
        self._num_windowed_tokens += held_before - self._held_tokens(state)
        return best.request_id

    def _release_up_to(self, state: RequestBlocks, num_dead: int) -> int:
        """Release table positions from the first live one after the sinks up to
        ``num_dead`` (exclusive) to the null block; return how many were released."""
        null = self._null_block
        assert null is not None, "releasing positions needs the null block"
        sinks = self.num_sink_blocks
        first = sinks + state.num_released
        num_dead = min(num_dead, len(state.blocks))
        if num_dead <= first:
            return 0
        blocks = state.blocks
        released = blocks[first:num_dead]
        for p in range(first, num_dead):
            blocks[p] = null
            state.block_ids[p] = null.block_id
        state.num_released = num_dead - sinks
        self._num_held_tokens -= (num_dead - first) * self.block_size
        self._release(released[::-1])
        return num_dead - first

    def _release(self, blocks: Sequence[KVBlock]) -> None:
        for block in blocks:
            if block.ref_count == 1:
                self._num_used_slots -= block.num_filled
        self._pool.free(blocks)

    def _held_tokens(self, state: RequestBlocks) -> int:
        return state.num_slots - state.num_released * self.block_size

    # ------------------------------------------------------------------ stats + checks

    def make_stats(self) -> KVCacheStats:
        """A snapshot (``audit.make_stats`` defines every figure)."""
        return audit.make_stats(self)

    def check_invariants(self) -> None:
        """Raise RuntimeError on any inconsistency between tables, ref counts, free list and
        prefix map (``audit.check_invariants``). For tests and debugging, not the hot path."""
        audit.check_invariants(self)
