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
computed block its prefix-cache key.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cache_manager.block import KVBlock
from cache_manager.block_pool import BlockPool
from cache_manager.config import KVCacheConfig
from cache_manager.eviction import make_eviction_policy
from cache_manager.hashing import hash_block_tokens
from cache_manager.stats import KVCacheStats


class CacheSequence(Protocol):
    """What the cache manager reads from a request; ``scheduler.request.Request`` fits."""

    request_id: str
    num_computed_tokens: int
    cache_salt: str | None

    @property
    def all_token_ids(self) -> list[int]: ...  # prompt + output so far

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(slots=True)
class Allocation:
    """What one ``allocate_slots``/``reserve_slots`` call changed in a block table.

    ``new_block_ids`` were appended to the table (prefix hits first, then fresh blocks).
    ``block_copies`` are copy-on-write pairs ``(src, dst)``: the runner copies the KV of block
    ``src`` into block ``dst`` before the step, and the table now holds ``dst`` where it held
    ``src``. Always re-read ``block_ids(request_id)`` for the current table.
    """

    new_block_ids: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)


class _RequestBlocks:
    """One request's block table and prefix-cache progress."""

    __slots__ = ("block_ids", "block_keys", "blocks", "num_released", "num_slots")

    def __init__(self) -> None:
        self.blocks: list[KVBlock] = []
        self.block_ids: list[int] = []
        # Keys of the request's first len(block_keys) blocks (the computed, full ones); kept
        # even for released positions, because later keys chain on them.
        self.block_keys: list[bytes] = []
        self.num_released = 0  # leading positions released to the null block (sliding window)
        self.num_slots = 0  # slots written or being written: num_computed + new of the last step


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
        self.enable_prefix_caching = config.enable_prefix_caching
        self.sliding_window = config.sliding_window
        self._pool = BlockPool(
            config.num_blocks,
            make_eviction_policy(config.eviction_policy),
            reserve_null=config.sliding_window is not None,
        )
        self._blocks = self._pool.blocks
        self._null_block = self._pool.null_block
        self._requests: dict[str, _RequestBlocks] = {}
        self._num_prefix_queries_tokens = 0
        self._num_prefix_hits_tokens = 0
        self._num_cow_copies = 0
        self._num_used_slots = 0  # sum of num_filled over referenced blocks
        self._num_held_tokens = 0  # sum over requests of their slots minus released ones

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
    def usage(self) -> float:
        """Fraction of allocatable blocks referenced by some request."""
        usable = self.num_blocks - self._pool.num_reserved
        return (usable - self._pool.num_free) / usable

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (KeyError if it holds no table)."""
        return list(self._requests[request_id].block_ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def free_block_ids(self) -> list[int]:
        """The free list, front (handed out next) to back: empty blocks, then the evictable
        cached blocks in the eviction policy's order."""
        return self._pool.free_block_ids()

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(
        self, seq: CacheSequence, *, record: bool = True
    ) -> tuple[list[int], int]:
        """Longest cached prefix of ``seq.all_token_ids`` in full blocks: (block ids, tokens).

        Never covers the last token (its logits must be computed), so at most
        ``(len(tokens) - 1) // block_size`` blocks. Takes no references: pass the ids to
        ``allocate_slots`` (or ``reserve_slots``) before anything else allocates, which
        verifies them again. With ``record`` it counts one prefix query of
        ``len(all_token_ids)`` tokens and the hit tokens; a caller that may not use the
        result (an admission that can still fail for room) passes ``record=False`` and calls
        ``record_prefix_query`` once the lookup was used. Counts nothing when prefix caching
        is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = seq.all_token_ids
        if record:
            self._num_prefix_queries_tokens += len(tokens)
        pool = self._pool
        if not pool.cached:
            return [], 0
        bs = self.block_size
        salt = seq.cache_salt
        hit_ids: list[int] = []
        parent: bytes | None = None
        for start in range(0, (len(tokens) - 1) // bs * bs, bs):
            chunk = tokens[start : start + bs]
            key = hash_block_tokens(parent, chunk, salt)
            block = pool.lookup(key, parent, chunk, salt)
            if block is None:
                break
            hit_ids.append(block.block_id)
            parent = key
        num_hit_tokens = len(hit_ids) * bs
        if record:
            self._num_prefix_hits_tokens += num_hit_tokens
        return hit_ids, num_hit_tokens

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix lookup made with ``get_computed_blocks(..., record=False)`` once its
        result was used: ``num_query_tokens`` looked up, ``num_hit_tokens`` of them cached.
        No-op when prefix caching is off."""
        if not 0 <= num_hit_tokens <= num_query_tokens:
            raise ValueError(
                f"need 0 <= num_hit_tokens ({num_hit_tokens}) <= num_query_tokens "
                f"({num_query_tokens})"
            )
        if self.enable_prefix_caching:
            self._num_prefix_queries_tokens += num_query_tokens
            self._num_prefix_hits_tokens += num_hit_tokens

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
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        keys = state.block_keys
        first = len(keys)
        if num_full <= first:
            return
        blocks = state.blocks
        if num_full > len(blocks):
            raise ValueError(
                f"request {seq.request_id!r}: num_computed_tokens={seq.num_computed_tokens} "
                f"exceeds its {len(blocks)} blocks of {bs} slots"
            )
        tokens = seq.all_token_ids
        salt = seq.cache_salt
        pool = self._pool
        null = self._null_block
        parent = keys[-1] if keys else None
        for i in range(first, num_full):
            chunk = tokens[i * bs : (i + 1) * bs]
            key = hash_block_tokens(parent, chunk, salt)
            block = blocks[i]
            # A released position still gets its key: later blocks chain on it.
            if block is not null and block.block_hash is None:
                pool.register(block, key, parent, chunk, salt)
            keys.append(key)
            parent = key

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
        self, seq: CacheSequence, num_new_tokens: int, new_computed_block_ids: Sequence[int] = ()
    ) -> Allocation | None:
        """Make the table cover ``num_computed + hits * block_size + num_new_tokens`` slots.

        ``new_computed_block_ids`` (from ``get_computed_blocks``) are only accepted for a
        request without blocks and with ``num_computed_tokens == 0``; they are verified
        against the request's tokens and salt (ValueError if stale), referenced (a free one
        leaves the free list) and appended first. Blocks about to be written that another
        request also holds are copied on write: the table gets a fresh block, and if it
        already held computed tokens of this request the pair lands in ``block_copies``.
        Returns None, changing nothing, when the free list cannot supply every block.
        The caller then advances ``num_computed_tokens``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if new_computed_block_ids:
            return self._allocate_with_hits(seq, num_new_tokens, new_computed_block_ids, 0)
        request_id = seq.request_id
        state = self._requests.get(request_id)
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        bs = self.block_size
        if state is None:
            self._check_new(seq)
            blocks: list[KVBlock] = []
        else:
            blocks = state.blocks
        num_have = len(blocks)
        num_need = -(-end // bs)
        num_fresh = num_need - num_have if num_need > num_have else 0
        # Blocks this step writes into that already exist: [first_write, last_write).
        first_write = start // bs
        last_write = (num_need if num_need < num_have else num_have) if num_new_tokens else 0
        num_cow = 0
        for p in range(first_write, last_write):
            if blocks[p].ref_count > 1:
                num_cow += 1
        pool = self._pool
        # The usual decode step takes no block: skip the free-list arithmetic then.
        if (num_fresh or num_cow) and num_fresh + num_cow > pool.num_free:
            return None
        if state is None:
            state = self._requests[request_id] = _RequestBlocks()
            blocks = state.blocks
        copies: list[tuple[int, int]] = (
            self._copy_on_write(state, first_write, last_write, start) if num_cow else []
        )
        if num_fresh:
            fresh = pool.take(num_fresh)
            new_ids = [b.block_id for b in fresh]
            blocks.extend(fresh)
            state.block_ids.extend(new_ids)
        else:
            new_ids = []
        used_slots = self._num_used_slots
        for p in range(first_write, num_need):
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
        return Allocation(new_ids, copies)

    def reserve_slots(
        self,
        seq: CacheSequence,
        num_total_tokens: int,
        new_computed_block_ids: Sequence[int] = (),
    ) -> Allocation | None:
        """Reserve mode: make the table cover ``num_total_tokens`` slots, all private, up front.

        For a scheduler that admits a request at its maximum length and never preempts:
        afterwards no ``allocate_slots`` call within ``num_total_tokens`` takes a block.
        Besides appending blocks, every block from ``num_computed_tokens`` on that another
        request also holds (after ``fork``) is copied on write now: a copy if it holds
        computed slots of this request (``block_copies``), a plain replacement if not. So
        after a fork in reserve mode, call ``reserve_slots`` for the parent and each child.
        Prefix hits are accepted as in ``allocate_slots``, atomically with the reservation.
        None (nothing changed) when there is no room.
        """
        if num_total_tokens < 0:
            raise ValueError(f"num_total_tokens must be >= 0, got {num_total_tokens}")
        if new_computed_block_ids:
            return self._allocate_with_hits(seq, 0, new_computed_block_ids, num_total_tokens)
        state = self._requests.get(seq.request_id)
        if state is None:
            self._check_new(seq)
            blocks: list[KVBlock] = []
        else:
            blocks = state.blocks
        num_have = len(blocks)
        num_need = self.num_blocks_for(num_total_tokens)
        num_fresh = max(0, num_need - num_have)
        start = seq.num_computed_tokens
        first = start // self.block_size
        last = min(num_have, num_need)
        num_cow = sum(1 for p in range(first, last) if blocks[p].ref_count > 1)
        if num_fresh + num_cow > self._pool.num_free:
            return None
        if state is None:
            state = self._requests[seq.request_id] = _RequestBlocks()
        copies = self._copy_on_write(state, first, last, start) if num_cow else []
        new_ids: list[int] = []
        if num_fresh:
            fresh = self._pool.take(num_fresh)
            new_ids = [b.block_id for b in fresh]
            state.blocks.extend(fresh)
            state.block_ids.extend(new_ids)
        return Allocation(new_ids, copies)

    def _check_new(self, seq: CacheSequence) -> None:
        if seq.num_computed_tokens != 0:
            raise ValueError(
                f"request {seq.request_id!r} holds no blocks but has "
                f"num_computed_tokens={seq.num_computed_tokens}; KV without blocks cannot exist"
            )

    def _allocate_with_hits(
        self,
        seq: CacheSequence,
        num_new_tokens: int,
        hit_ids: Sequence[int],
        num_reserve_tokens: int,
    ) -> Allocation | None:
        request_id = seq.request_id
        state = self._requests.get(request_id)
        if not self.enable_prefix_caching:
            raise ValueError("prefix hits passed but prefix caching is disabled")
        if (state is not None and state.blocks) or seq.num_computed_tokens != 0:
            raise ValueError(
                f"request {request_id!r}: prefix hits are only taken by a request without "
                f"blocks and with num_computed_tokens == 0 (has "
                f"{0 if state is None else len(state.blocks)} blocks, "
                f"num_computed_tokens={seq.num_computed_tokens})"
            )
        bs = self.block_size
        tokens = seq.all_token_ids
        num_hit_tokens = len(hit_ids) * bs
        if num_hit_tokens >= len(tokens):
            raise ValueError(
                f"request {request_id!r}: {len(hit_ids)} hit blocks cover {num_hit_tokens} "
                f"tokens of {len(tokens)}; a hit never covers the last token"
            )
        salt = seq.cache_salt
        hits: list[KVBlock] = []
        parent: bytes | None = None
        for i, block_id in enumerate(hit_ids):
            block = self._blocks[block_id] if 0 <= block_id < self.num_blocks else None
            chunk = tokens[i * bs : (i + 1) * bs]
            if (
                block is None
                or block.block_hash is None
                or block.parent_hash != parent
                or block.cache_salt != salt
                or block.token_ids != tuple(chunk)
            ):
                raise ValueError(
                    f"request {request_id!r}: block {block_id} does not hold its tokens "
                    f"{i * bs}..{(i + 1) * bs - 1}; call get_computed_blocks right before "
                    "allocating (a block handed out in between loses its key)"
                )
            hits.append(block)
            parent = block.block_hash
        end = num_hit_tokens + num_new_tokens
        num_need = self.num_blocks_for(max(end, num_reserve_tokens))
        num_fresh = max(0, num_need - len(hits))
        num_hits_free = sum(1 for b in hits if b.ref_count == 0)
        pool = self._pool
        if num_fresh + num_hits_free > pool.num_free:
            return None
        if state is None:
            state = self._requests[request_id] = _RequestBlocks()
        # Take the hits off the free list before anything is handed out, so the fresh blocks
        # below can never evict them.
        for block in hits:
            if block.ref_count == 0:
                block.num_filled = bs
                self._num_used_slots += bs
            pool.touch(block)
            block.hit_count += 1
            block.is_shared = True
            assert block.block_hash is not None
            state.block_keys.append(block.block_hash)
        fresh = pool.take(num_fresh) if num_fresh else []
        state.blocks.extend(hits)
        state.blocks.extend(fresh)
        new_ids = [b.block_id for b in state.blocks]
        state.block_ids.extend(new_ids)
        blocks = state.blocks
        for p in range(len(hits), self.num_blocks_for(end)):
            filled = min(bs, end - p * bs)
            self._num_used_slots += filled
            blocks[p].num_filled = filled
        state.num_slots = end
        self._num_held_tokens += end
        return Allocation(new_ids, [])

    def _copy_on_write(
        self, state: _RequestBlocks, first: int, last: int, start: int
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
        child = _RequestBlocks()
        child.blocks = list(parent.blocks)
        child.block_ids = list(parent.block_ids)
        child.block_keys = list(parent.block_keys)
        child.num_released = parent.num_released
        child.num_slots = parent.num_slots
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
        live = blocks[num_released:] if num_released else blocks
        self._release(live[::-1])

    def release_out_of_window(self, seq: CacheSequence) -> int:
        """Sliding window: release the blocks no future query can attend to; return how many.

        The next query is at position ``num_computed_tokens`` and attends at most
        ``sliding_window`` positions back, so a block whose slots all lie below
        ``num_computed_tokens - sliding_window`` is dead. Released positions keep their place
        in the table but point at the null block (``null_block_id``, block 0, never handed
        out), so ``block_ids[p // block_size]`` stays valid for every position p: the runner
        may gather from it, and must mask it out as it masks everything beyond the window.
        Returns 0 without a window. KeyError if the request holds no table.
        """
        null = self._null_block
        if null is None:
            return 0
        assert self.sliding_window is not None
        state = self._requests[seq.request_id]
        limit = seq.num_computed_tokens - self.sliding_window
        num_dead = min(limit // self.block_size if limit > 0 else 0, len(state.blocks))
        first = state.num_released
        if num_dead <= first:
            return 0
        blocks = state.blocks
        released = blocks[first:num_dead]
        for p in range(first, num_dead):
            blocks[p] = null
            state.block_ids[p] = null.block_id
        state.num_released = num_dead
        self._num_held_tokens -= (num_dead - first) * self.block_size
        self._release(released[::-1])
        return num_dead - first

    def _release(self, blocks: Sequence[KVBlock]) -> None:
        for block in blocks:
            if block.ref_count == 1:
                self._num_used_slots -= block.num_filled
        self._pool.free(blocks)

    def _held_tokens(self, state: _RequestBlocks) -> int:
        return state.num_slots - state.num_released * self.block_size

    # ------------------------------------------------------------------ stats + checks

    def make_stats(self) -> KVCacheStats:
        """A snapshot. Definitions:

        - ``total_tokens``: per request, the slots it has written or is writing (its
          ``num_computed_tokens`` plus the new tokens of its last ``allocate_slots``, or its
          hit tokens) minus the slots released out of its window; summed over requests, so a
          prefix shared by two requests counts twice.
        - ``cache_efficiency``: slots holding KV in referenced blocks (each block once) over
          the slots of those blocks, ``num_blocks_used * block_size``. Reserved but unwritten
          slots and half-filled tails lower it.
        - ``usage``: referenced blocks over allocatable blocks (the null block excluded).
        - prefix queries/hits: cumulative tokens, counted per recorded
          ``get_computed_blocks`` call (or ``record_prefix_query``).
        """
        pool = self._pool
        bs = self.block_size
        num_free = len(pool.empty)
        num_cached_free = len(pool.policy)
        num_reserved = pool.num_reserved
        num_used = self.num_blocks - num_reserved - num_free - num_cached_free
        num_seqs = len(self._requests)
        total_tokens = self._num_held_tokens
        block_bytes = self.config.block_bytes
        queries = self._num_prefix_queries_tokens
        hits = self._num_prefix_hits_tokens
        return KVCacheStats(
            block_size=bs,
            num_blocks_total=self.num_blocks,
            num_blocks_used=num_used,
            num_blocks_cached_free=num_cached_free,
            num_blocks_free=num_free,
            total_sequences=num_seqs,
            total_tokens=total_tokens,
            block_bytes=block_bytes,
            total_memory_bytes=self.num_blocks * block_bytes,
            used_memory_bytes=num_used * block_bytes,
            average_sequence_length=total_tokens / num_seqs if num_seqs else 0.0,
            cache_efficiency=self._num_used_slots / (num_used * bs) if num_used else 0.0,
            usage=num_used / (self.num_blocks - num_reserved),
            prefix_queries_tokens_total=queries,
            prefix_hits_tokens_total=hits,
            cache_hit_rate=hits / queries if queries else 0.0,
            evictions_total=pool.num_evictions,
            cow_copies_total=self._num_cow_copies,
            num_blocks_reserved=num_reserved,
        )

    def check_invariants(self) -> None:
        """Raise RuntimeError on any inconsistency between tables, ref counts, free list and
        prefix map. O(num_blocks + table sizes): for tests and debugging, not the hot path."""
        pool = self._pool
        free_ids, _ = pool.check()
        null = self._null_block
        bs = self.block_size
        holders = [0] * self.num_blocks
        held_tokens = 0
        for request_id, state in self._requests.items():
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
                if (block is null) != (p < state.num_released):
                    raise RuntimeError(
                        f"request {request_id!r}: position {p} null={block is null} but "
                        f"{state.num_released} positions are released"
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
            held_tokens += self._held_tokens(state)
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
        if used_slots != self._num_used_slots:
            raise RuntimeError(f"used slots: counter {self._num_used_slots}, blocks {used_slots}")
        if held_tokens != self._num_held_tokens:
            raise RuntimeError(
                f"held tokens: counter {self._num_held_tokens}, tables {held_tokens}"
            )
        if not self.enable_prefix_caching and pool.cached:
            raise RuntimeError("prefix caching is off but blocks have keys")
