"""HybridKVCacheManager: one model, two kinds of layers, two block tables a request.

Gemma 3 interleaves sliding-window layers (five of six attend to the last ``sliding_window``
positions) with global ones (every position). One table for both would keep every block of
every layer for the whole request, although five layers in six never read a block again
once it falls out of their window. So the layers are held as two *groups*, each with its
own pool of blocks and its own table per request (vLLM's hybrid allocator keeps one pool of
equal-size groups; two pools of their own sizes are what two groups need)::

    global layers   | 7 | 2 | 9 | 4 | 5 |     every block kept (KVCacheManager, no window)
    sliding layers  | - | - | 3 | 8 | 1 |     "-" = released to the window group's null block
                              ^ num_computed - sliding_window

The global group *is* this manager (the base class, its ids ``0 .. num_blocks - 1``); the
sliding group is a second ``KVCacheManager`` with the window (``window``), whose block ids
the step sees past the global ones: ``block_offset + id``. So one id names one block of one
group everywhere: in ``window_block_ids``, in copy-on-write pairs, in ``block_ids_of``. The
runner's pool holds the global layers' KV for the first ``num_blocks`` ids and the sliding
layers' for the rest.

Every call that grows, forks, shrinks or frees a table does it to both groups, atomically:
room is checked in both (``num_blocks_to_take``) before either grows. A prefix hit is the
longest prefix cached in *both* groups (the sliding group's chain must be whole: blocks it
released stay cached-free with their keys until evicted, and a hit needs them again).
``release_out_of_window`` releases the sliding group's dead blocks (counted in
``KVCacheStats.sliding_blocks_released_total``). Not with the disk tier, attention sinks or
the adaptive strategy (refused at construction).
"""

from __future__ import annotations

from dataclasses import replace

from cache_manager.allocation import Allocation, CacheSequence, PrefixHit
from cache_manager.config import KVCacheConfig
from cache_manager.manager import KVCacheManager
from cache_manager.stats import KVCacheStats


class HybridKVCacheManager(KVCacheManager):
    """The global layers' tables (this manager) and the sliding layers' (``window``)."""

    def __init__(self, config: KVCacheConfig, window: KVCacheConfig, max_chunk_tokens: int) -> None:
        """``config``: the global group (no window); ``window``: the sliding group's (its
        ``sliding_window`` set, its ``num_blocks`` its own pool's, the rest as ``config``).
        ``max_chunk_tokens`` bounds a prefix hit in the sliding group (see
        ``get_computed_blocks``)."""
        for what, bad in (
            ("the disk KV tier", config.kv_tier or window.kv_tier),
            ("attention sinks", config.attention_sinks or window.attention_sinks),
            ("the adaptive KV strategy", "adaptive" in (config.kv_strategy, window.kv_strategy)),
            ("a window over every layer (--sliding-window)", config.sliding_window is not None),
        ):
            if bad:
                raise ValueError(
                    f"{what} does not run with the sliding layers' own blocks (Gemma 3); "
                    "pass --sliding-layer-blocks off to keep one table for every layer"
                )
        if window.sliding_window is None:
            raise ValueError("the sliding group needs its window (KVCacheConfig.sliding_window)")
        super().__init__(config)
        self.window = KVCacheManager(
            replace(window, block_size=config.block_size, kv_strategy=config.kv_strategy)
        )
        self.block_offset = config.num_blocks
        self.max_chunk_tokens = max_chunk_tokens
        # The last lookup's sliding-group hit, by request: the scheduler allocates right
        # after it looks up, and one slot cannot grow with lookups never allocated.
        self._window_hit: tuple[str, PrefixHit] | None = None
        self._num_sliding_released = 0

    # ------------------------------------------------------------------ queries

    @property
    def releases_out_of_window(self) -> bool:
        return True

    @property
    def has_window_tables(self) -> bool:
        return True

    @property
    def num_free_blocks(self) -> int:
        """The tighter group's free blocks: an admission needs room in both."""
        return min(self._pool.num_free, self.window.num_free_blocks)

    def window_block_ids(self, request_id: str) -> list[int]:
        """The sliding layers' table, in the step's ids (``block_offset`` + the group's)."""
        off = self.block_offset
        return [off + b for b in self.window.block_ids(request_id)]

    # ------------------------------------------------------------------ prefix cache

    def get_computed_blocks(
        self, seq: CacheSequence, max_num_tokens: int | None = None
    ) -> PrefixHit:
        """The longest prefix cached in both groups (the global group's hit is returned;
        the sliding group's waits for the same request's allocation). The sliding group's
        hit is bounded so that it and a first chunk fit the blocks one request may hold
        there (``KVCacheManager.max_resident_blocks``): its blocks out of the window are
        taken too and released right after admission."""
        win = self.window
        num_tokens = len(seq.all_token_ids)
        bound = win.max_resident_blocks(num_tokens, self.max_chunk_tokens)
        limit = max_num_tokens
        if win.num_blocks_for(num_tokens) > bound:
            cap = max(0, bound * self.block_size - self.max_chunk_tokens)
            limit = cap if limit is None else min(limit, cap)
        hit = super().get_computed_blocks(seq, limit)
        window_hit = win.get_computed_blocks(seq, hit.num_tokens)
        if window_hit.num_tokens < hit.num_tokens:
            hit = super().get_computed_blocks(seq, window_hit.num_tokens)
        self._window_hit = (seq.request_id, window_hit)
        return hit

    def cache_full_blocks(self, seq: CacheSequence) -> None:
        super().cache_full_blocks(seq)
        self.window.cache_full_blocks(seq)

    def reset_prefix_cache(self) -> bool:
        if self._requests:
            return False
        return super().reset_prefix_cache() and self.window.reset_prefix_cache()

    # ------------------------------------------------------------------ allocation

    def _grow(
        self, seq: CacheSequence, num_new: int, num_total: int, hit: PrefixHit | None
    ) -> Allocation | None:
        """Both groups grow, or neither: room is measured in each first."""
        window_hit = None
        if hit is not None:
            last = self._window_hit
            if last is None or last[0] != seq.request_id or last[1].num_tokens != hit.num_tokens:
                raise ValueError(
                    f"request {seq.request_id!r}: a prefix hit not from this manager's "
                    "get_computed_blocks (or looked up again since)"
                )
            window_hit = last[1]
        win = self.window
        need = win.num_blocks_to_take(seq, num_new, num_total, window_hit)
        if need and need > win.num_free_blocks:
            return None
        allocation = super()._grow(seq, num_new, num_total, hit)
        if allocation is None:
            return None
        window_allocation = win.reserve_slots(seq, num_total, window_hit, num_new)
        assert window_allocation is not None, "the sliding group had room a moment ago"
        if hit is not None:
            self._window_hit = None
        if not window_allocation.block_copies:
            return allocation
        off = self.block_offset
        copies = [(src + off, dst + off) for src, dst in window_allocation.block_copies]
        return Allocation(allocation.new_block_ids, allocation.block_copies + copies)

    # ------------------------------------------------------------------ release

    def fork(self, parent_id: str, child_id: str) -> None:
        super().fork(parent_id, child_id)
        self.window.fork(parent_id, child_id)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.window.free(request_id)
        if self._window_hit is not None and self._window_hit[0] == request_id:
            self._window_hit = None

    def rollback_slots(self, seq: CacheSequence) -> int:
        return super().rollback_slots(seq) + self.window.rollback_slots(seq)

    def release_out_of_window(self, seq: CacheSequence) -> int:
        """Release the sliding group's blocks no future query of ``seq`` can attend to."""
        num = self.window.release_out_of_window(seq)
        self._num_sliding_released += num
        return num

    # ------------------------------------------------------------------ stats + checks

    def make_stats(self) -> KVCacheStats:
        """The global group's figures, and the sliding group's pool in ``sliding_*``."""
        win = self.window
        return replace(
            super().make_stats(),
            sliding_blocks_total=win.num_usable_blocks,
            sliding_blocks_used=win.num_usable_blocks - win.num_free_blocks,
            sliding_blocks_released_total=self._num_sliding_released,
        )

    def check_invariants(self) -> None:
        super().check_invariants()
        self.window.check_invariants()
        if set(self._requests) != set(self.window._requests):
            raise RuntimeError(
                "the groups hold tables for different requests: "
                f"{sorted(set(self._requests) ^ set(self.window._requests))}"
            )


def window_blocks_for(
    num_requests: int, max_model_len: int, sliding_window: int, block_size: int, max_chunk: int
) -> int:
    """Blocks the sliding group's pool needs so that ``num_requests`` requests each hold a
    whole window (the window, a chunk being written and a partial block), plus the null
    block: the most it can be short of, so its tables never make a request wait while the
    global pool has room."""
    bs = block_size
    per_request = min(-(-max_model_len // bs), -(-(sliding_window + max_chunk) // bs) + 1)
    return num_requests * per_request + 1
