"""Tier 2 bookkeeping in the cache manager: spills on free, restores of staged blocks."""

from __future__ import annotations

from cache_manager import TierBlock, prefix_block_keys
from tests.cache_manager.helpers import make_kv, make_seq, prefill


def staged_blocks(tokens: list[int], block_size: int, salt: str | None = None) -> list[TierBlock]:
    """The TierBlocks of every full block of ``tokens`` but the last token's."""
    keys = prefix_block_keys(tokens[:-1], block_size, salt)
    return [
        TierBlock(
            key,
            keys[i - 1] if i else None,
            tuple(tokens[i * block_size : (i + 1) * block_size]),
            salt,
        )
        for i, key in enumerate(keys)
    ]


def test_keyed_blocks_spill_once_when_freed_tail_first() -> None:
    """Freeing a request plans a spill of its keyed blocks, tail first, and only once per key."""
    kv = make_kv(num_blocks=8, kv_tier=True)
    a = make_seq("a", range(10))  # blocks 0, 1 full + partial block 2
    prefill(kv, a)
    ids = kv.block_ids("a")
    assert kv.take_tier_plan().spills == []
    kv.free("a")
    plan = kv.take_tier_plan()
    keys = prefix_block_keys(list(range(10)), 4, None)
    assert [(bid, b.key) for bid, b in plan.spills] == [(ids[1], keys[1]), (ids[0], keys[0])]
    assert plan.spills[1][1] == TierBlock(keys[0], None, (0, 1, 2, 3), None)
    assert plan.restores == []
    b = make_seq("b", range(10))
    assert prefill(kv, b) == ids[:2]  # a tier-1 hit on the same blocks
    kv.free("b")
    assert kv.take_tier_plan().spills == []  # already spilled under these keys
    assert kv.make_stats().tier2_spill_blocks_total == 2
    kv.check_invariants()


def test_staged_blocks_restore_into_fresh_blocks() -> None:
    """A lookup past tier 1 continues into staged blocks; allocation gives them fresh block
    ids, keyed and computed, and plans one restore per block."""
    kv = make_kv(num_blocks=8, kv_tier=True)
    tokens = list(range(100, 113))  # 3 full blocks + 1 token
    kv.stage_tier_blocks("r", staged_blocks(tokens, 4))
    seq = make_seq("r", tokens)
    hit = kv.get_computed_blocks(seq)
    assert (hit.block_ids, len(hit.restore), hit.num_tokens) == ([], 3, 12)
    alloc = kv.allocate_slots(seq, 1, hit)
    assert alloc is not None
    table = kv.block_ids("r")
    assert alloc.new_block_ids == table and len(table) == 4
    keys = prefix_block_keys(tokens, 4, None)
    assert kv.take_tier_plan().restores == list(zip(table[:3], keys, strict=True))
    assert kv.staged_tier_request_ids() == []  # consumed by the admission
    stats = kv.make_stats()
    assert (stats.tier2_hit_blocks_total, stats.tier2_hit_tokens_total) == (3, 12)
    assert stats.prefix_hits_tokens_total == 12
    kv.check_invariants()
    seq.num_computed_tokens = 13
    kv.cache_full_blocks(seq)
    kv.free("r")
    assert kv.take_tier_plan().spills == []  # restored blocks came from the store
    assert [kv.get_computed_blocks(make_seq("s", tokens)).num_tokens] == [12]  # now tier 1


def test_tier1_prefix_then_staged_suffix() -> None:
    """Tier-1 blocks come first in the hit; the chain continues with staged blocks after."""
    kv = make_kv(num_blocks=8, kv_tier=True)
    tokens = list(range(13))
    prefill(kv, make_seq("a", tokens[:5]))  # block 0 keyed in tier 1
    first = kv.block_ids("a")[0]
    kv.free("a")
    kv.take_tier_plan()
    kv.stage_tier_blocks("r", staged_blocks(tokens, 4)[1:])
    seq = make_seq("r", tokens)
    hit = kv.get_computed_blocks(seq)
    assert (hit.block_ids, len(hit.restore), hit.num_tokens) == ([first], 2, 12)
    assert kv.allocate_slots(seq, 1, hit) is not None
    table = kv.block_ids("r")
    assert table[0] == first
    assert [bid for bid, _ in kv.take_tier_plan().restores] == table[1:3]
    kv.check_invariants()


def test_staged_block_of_another_salt_or_tokens_is_not_restored() -> None:
    """Staged blocks are verified like tier-1 hits: another salt or other tokens miss."""
    kv = make_kv(num_blocks=8, kv_tier=True)
    tokens = list(range(9))
    kv.stage_tier_blocks("r", staged_blocks(tokens, 4, salt="tenant-a"))
    assert kv.get_computed_blocks(make_seq("r", tokens, salt="tenant-b")).num_tokens == 0
    assert kv.get_computed_blocks(make_seq("r", tokens)).num_tokens == 0
    other = [9, *tokens[1:]]
    assert kv.get_computed_blocks(make_seq("r", other, salt="tenant-a")).num_tokens == 0
    assert kv.get_computed_blocks(make_seq("r", tokens, salt="tenant-a")).num_tokens == 8


def test_restore_into_a_block_evicted_in_the_same_step_is_dropped() -> None:
    """A restored block freed and handed out again before the engine moved its bytes loses
    its planned restore (nothing stale is copied over the new owner's block)."""
    kv = make_kv(num_blocks=3, kv_tier=True)
    tokens = list(range(9))
    kv.stage_tier_blocks("r", staged_blocks(tokens, 4))
    seq = make_seq("r", tokens)
    assert kv.allocate_slots(seq, 1, kv.get_computed_blocks(seq)) is not None
    kv.free("r")  # preempted in the same schedule: its keyed blocks become evictable
    other = make_seq("o", range(50, 62))
    assert kv.allocate_slots(other, 12) is not None  # evicts both restored blocks
    plan = kv.take_tier_plan()
    assert plan.restores == [] and plan.spills == []
    kv.check_invariants()


def test_tier_off_plans_nothing_and_ignores_staging() -> None:
    """Without the tier nothing is spilled and staged blocks are ignored."""
    kv = make_kv(num_blocks=8)
    tokens = list(range(9))
    kv.stage_tier_blocks("r", staged_blocks(tokens, 4))
    assert kv.get_computed_blocks(make_seq("r", tokens)).num_tokens == 0
    prefill(kv, make_seq("a", tokens))
    kv.free("a")
    assert kv.take_tier_plan().is_empty
    assert not kv.has_tier
