"""BlockPool: every block of the KV pool, the free list, and the prefix-cache map.

The free list is one logical list, front = handed out next::

    | empty: never cached, or key dropped | evictable: cached, in the policy's order |
      (BlockQueue, LIFO at the front)        (EvictionPolicy: BlockQueues, LRU/LFU/...)

A freed block without a key holds nothing reusable, so it goes to the very front and is
handed out before any cached block loses its key. A freed block with a key keeps it (lazy
eviction): a prefix hit can take it back in O(1) until the block is handed out, at which point
its key is dropped and an eviction is counted.

With tier 2 (``cache_manager.tier``), a keyed block is spilled when it becomes evictable
(once per key), so the store has it before it is evicted, after a restart, and for the other
replicas on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

from cache_manager.block import BlockQueue, KVBlock
from cache_manager.eviction import EvictionPolicy
from cache_manager.tier import TierLedger


class BlockPool:
    """``num_blocks`` blocks; optionally block 0 is the null block, never handed out."""

    def __init__(
        self,
        num_blocks: int,
        policy: EvictionPolicy,
        *,
        reserve_null: bool,
        tier: TierLedger | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.tier = tier  # tier 2: evicted keyed blocks are spilled through it
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.policy = policy
        self.empty = BlockQueue("empty")
        self.cached: dict[bytes, KVBlock] = {}  # key -> the block registered under it
        self.null_block: KVBlock | None = self.blocks[0] if reserve_null else None
        for block in self.blocks[1 if reserve_null else 0 :]:
            self.empty.append(block)
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (empty + evictable cached)."""
        return len(self.empty) + len(self.policy)

    @property
    def num_reserved(self) -> int:
        return 0 if self.null_block is None else 1

    def take(self, n: int) -> list[KVBlock]:
        """Hand out ``n`` blocks with ref_count 1: empty ones first, then evict cached ones.

        The caller checks ``num_free`` first.
        """
        empty = self.empty
        num_empty = len(empty)
        if n <= num_empty:
            taken = empty.popleft_n(n)
        else:
            taken = empty.popleft_n(num_empty)
            pop = self.policy.pop
            for _ in range(n - num_empty):
                taken.append(self._evict(pop()))
        for block in taken:
            block.ref_count = 1
        return taken

    def _evict(self, block: KVBlock) -> KVBlock:
        """Drop the key of a cached block that is being handed out."""
        key = block.block_hash
        assert key is not None and self.cached.get(key) is block
        if self.tier is not None:
            self.tier.on_evict(block)
        del self.cached[key]
        self._clear_key(block)
        self.num_evictions += 1
        return block

    @staticmethod
    def _clear_key(block: KVBlock) -> None:
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = None
        block.cache_salt = None
        block.hit_count = 0
        block.is_shared = False
        block.is_spilled = False

    def touch(self, block: KVBlock) -> None:
        """Take a reference on a cached block (a prefix hit); off the free list if it was free."""
        if block.ref_count == 0:
            self.policy.remove(block)
        else:
            block.is_shared = True
        block.ref_count += 1

    def free(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference on each of ``blocks``, in the given order.

        A block reaching ref_count 0 joins the free list: at the front if it has no key, else at
        the back of its eviction class. Callers pass a request's blocks tail first, so its tail
        is evicted before its head (the head is the part other requests share).
        """
        empty = self.empty
        push = self.policy.push
        tier = self.tier
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                block.num_filled = 0
                if block.block_hash is None:
                    empty.appendleft(block)
                else:
                    push(block)
                    if tier is not None and not block.is_spilled:
                        tier.on_free(block)

    def lookup(
        self,
        key: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> KVBlock | None:
        """The block cached under ``key``, only if it provably holds exactly this prefix.

        The parent key, the tokens and the salt are compared, so a hash collision can never
        hand out the wrong KV: by induction over the chain, a hit on block i means blocks
        0..i hold exactly these tokens.
        """
        block = self.cached.get(key)
        if (
            block is None
            or block.parent_hash != parent_hash
            or block.cache_salt != cache_salt
            or block.token_ids != tuple(token_ids)
        ):
            return None
        return block

    def register(
        self,
        block: KVBlock,
        key: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> bool:
        """Give a full, computed, referenced block its key. False if another block has the key.

        A duplicate (two requests computed the same prefix at once) stays keyless: it is freed
        to the front of the free list, and the first block keeps serving hits.
        """
        assert block.ref_count > 0 and block.block_hash is None
        if key in self.cached:
            return False
        block.block_hash = key
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        block.cache_salt = cache_salt
        block.hit_count = 0
        block.is_shared = block.ref_count > 1
        self.cached[key] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Drop every key. Refused (False) while any block is in use: their requests would
        keep chaining keys that no longer exist."""
        if self.num_free != self.num_blocks - self.num_reserved:
            return False
        for block in list(self.policy):
            self.policy.remove(block)
            self._clear_key(block)
            self.empty.append(block)
        self.cached.clear()
        return True

    def free_block_ids(self) -> list[int]:
        """The free list, front (handed out next) to back."""
        return [b.block_id for b in self.empty] + [b.block_id for b in self.policy]

    def check(self) -> tuple[set[int], set[int]]:
        """Pool-level invariants. Returns (ids on the free list, ids with a key)."""
        free_ids: set[int] = set()
        for block in self.empty.check():
            if block.block_hash is not None:
                raise RuntimeError(f"block {block.block_id} is in the empty queue with a key")
            free_ids.add(block.block_id)
        num_evictable = 0
        for queue in self.policy.queues():
            for block in queue.check():
                if block.block_hash is None:
                    raise RuntimeError(f"block {block.block_id} is evictable without a key")
                if block.block_id in free_ids:
                    raise RuntimeError(f"block {block.block_id} is on the free list twice")
                free_ids.add(block.block_id)
                num_evictable += 1
        if num_evictable != len(self.policy):
            raise RuntimeError(
                f"eviction policy counts {len(self.policy)} blocks but {num_evictable} are linked"
            )
        for block in self.blocks:
            on_list = block.block_id in free_ids
            if on_list != (block.queue is not None):
                raise RuntimeError(f"block {block.block_id}: queue field disagrees with the lists")
            if on_list and block.ref_count != 0:
                raise RuntimeError(
                    f"block {block.block_id} is free and referenced (ref_count={block.ref_count})"
                )
            if on_list and block.num_filled != 0:
                raise RuntimeError(f"free block {block.block_id} has num_filled={block.num_filled}")
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} has ref_count {block.ref_count}")
        keyed: set[int] = set()
        for key, block in self.cached.items():
            if block.block_hash != key:
                raise RuntimeError(
                    f"prefix map entry {key.hex()} points at block {block.block_id} whose key is "
                    f"{None if block.block_hash is None else block.block_hash.hex()}"
                )
            if block.token_ids is None:
                raise RuntimeError(f"cached block {block.block_id} has no token ids")
            keyed.add(block.block_id)
        for block in self.blocks:
            if block.block_hash is not None and block.block_id not in keyed:
                raise RuntimeError(f"block {block.block_id} has a key missing from the prefix map")
        if self.null_block is not None:
            null = self.null_block
            if null.ref_count != 0 or null.queue is not None or null.block_hash is not None:
                raise RuntimeError(f"null block {null!r} was handed out, freed or keyed")
        return free_ids, keyed
