"""The prefix cache's keys: the longest cached prefix of a prompt, and the keys of newly full
blocks. Key of block i = hash(key of block i-1, its token ids, cache_salt)::

    tokens   | block 0 | block 1 | block 2 | partial |
    keys       k0 ---->  k1 ---->  k2                 k_i = hash(k_{i-1}, tokens_i, salt)
    lookup   tier 1 (the pool) first; once the chain continues in tier 2 (staged blocks), it
             stays there: those blocks are restored at admission

``KVCacheManager.get_computed_blocks`` and ``cache_full_blocks`` call these on its pool;
taking a hit (references, statistics) stays the manager's.
"""

from __future__ import annotations

from cache_manager.allocation import CacheSequence, PrefixHit, RequestBlocks
from cache_manager.block import KVBlock
from cache_manager.block_pool import BlockPool
from cache_manager.hashing import hash_block_tokens
from cache_manager.tier import TierBlock, TierLedger


def longest_hit(
    seq: CacheSequence,
    pool: BlockPool,
    tier: TierLedger | None,
    block_size: int,
    max_num_tokens: int | None,
) -> PrefixHit:
    """The longest cached prefix of ``seq.all_token_ids`` in full blocks, at most
    ``max_num_tokens`` tokens, never covering the last token; each block verified against
    parent key, salt and tokens (``BlockPool.lookup``). Takes no references."""
    tokens = seq.all_token_ids
    bs = block_size
    num_blocks = (len(tokens) - 1) // bs
    if max_num_tokens is not None:
        num_blocks = min(num_blocks, max_num_tokens // bs)
    blocks: list[KVBlock] = []
    keys: list[bytes] = []
    restore: list[TierBlock] = []
    salt = seq.cache_salt
    parent: bytes | None = None
    staged = tier.staged(seq.request_id) if tier is not None else None
    for start in range(0, num_blocks * bs if pool.cached or staged else 0, bs):
        chunk = tokens[start : start + bs]
        key = hash_block_tokens(parent, chunk, salt)
        # Tier 1 first; once the chain continues in tier 2 it stays there.
        block = None if restore else pool.lookup(key, parent, chunk, salt)
        if block is not None:
            blocks.append(block)
        else:
            entry = None if staged is None else staged.get(key)
            if entry is None or not entry.matches(parent, chunk, salt):
                break
            restore.append(entry)
        keys.append(key)
        parent = key
    return PrefixHit(
        seq.request_id,
        tuple(blocks),
        tuple(keys),
        len(keys) * bs,
        len(tokens),
        tuple(restore),
    )


def key_full_blocks(
    seq: CacheSequence,
    state: RequestBlocks,
    pool: BlockPool,
    null: KVBlock | None,
    block_size: int,
) -> None:
    """Give each newly full, computed block of ``seq`` (table ``state``) its key; a block
    whose key another block already holds stays keyless (the first one keeps serving hits).
    ValueError if the computed tokens run past the table."""
    bs = block_size
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
