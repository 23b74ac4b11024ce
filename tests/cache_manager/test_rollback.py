"""Exact block ids for ``rollback_slots``: the KV of rejected speculative drafts is dropped."""

from __future__ import annotations

import pytest

from cache_manager import Allocation, KVCacheManager
from tests.cache_manager.helpers import Seq, make_kv, make_seq, prefill


def verify_step(kv: KVCacheManager, seq: Seq, num_drafts: int, accepted: list[int]) -> int:
    """A decode of the last token with ``num_drafts`` drafts, of which ``accepted`` (plus
    one sampled token, 99) become tokens; then the rollback. Returns the blocks freed."""
    assert kv.allocate_slots(seq, 1 + num_drafts) is not None
    seq.num_computed_tokens += 1 + len(accepted)
    seq.tokens += [*accepted, 99]
    kv.cache_full_blocks(seq)
    freed = kv.rollback_slots(seq)
    kv.check_invariants()
    return freed


def test_rollback_frees_whole_blocks_tail_first() -> None:
    """Position 6 plus 7 drafts write blocks 2 and 3 (slots up to 13); one accepted draft
    leaves 8 computed slots: blocks 3 then 2 go back to the front of the free list, and the
    table, its slot count and the used slots shrink to blocks 0 and 1."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(7))
    assert kv.allocate_slots(a, 6) == Allocation([0, 1], [])
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 8) == Allocation([2, 3], [])
    assert kv.make_stats().total_tokens == 14
    a.num_computed_tokens = 8
    a.tokens += [70, 99]
    kv.cache_full_blocks(a)
    assert kv.rollback_slots(a) == 2
    assert kv.block_ids("a") == [0, 1]
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7]
    stats = kv.make_stats()
    assert (stats.total_tokens, stats.num_blocks_used, stats.cache_efficiency) == (8, 2, 1.0)
    kv.check_invariants()


def test_rollback_keeps_the_computed_slots_of_a_partial_block() -> None:
    """Two accepted drafts of four: 10 computed slots stay in blocks 0..2 (block 2 holds two
    of them), block 3 is freed; the next step writes from position 10 into block 2 again."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(7))
    prefill_to(kv, a, 6)
    assert kv.block_ids("a") == [0, 1]
    assert verify_step(kv, a, 6, [70, 71]) == 1  # positions 6..12: blocks 2, 3
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.free_block_ids() == [3, 4, 5, 6, 7]
    stats = kv.make_stats()
    assert (stats.total_tokens, stats.cache_efficiency) == (9, 9 / 12)
    assert kv.allocate_slots(a, 1) == Allocation([], [])  # position 9 is in block 2


def test_rollback_is_a_no_op_without_rejected_slots() -> None:
    """All drafts accepted (or none scheduled): nothing is written past the computed
    tokens, so nothing changes."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(7))
    prefill_to(kv, a, 6)
    assert verify_step(kv, a, 2, [70, 71]) == 0
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.make_stats().total_tokens == 9


def test_reserved_blocks_keep_their_place() -> None:
    """Reserve mode: blocks reserved up to max length stay in the table (emptied) instead of
    being freed, so later positions keep their blocks."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(7))
    assert kv.reserve_slots(a, 20, None, 6) == Allocation([0, 1, 2, 3, 4], [])
    a.num_computed_tokens = 6
    assert verify_step(kv, a, 6, [70]) == 0
    assert kv.block_ids("a") == [0, 1, 2, 3, 4]
    stats = kv.make_stats()
    assert (stats.total_tokens, stats.num_blocks_used) == (8, 5)
    assert stats.cache_efficiency == 8 / 20


def test_rollback_never_touches_prefix_cached_blocks() -> None:
    """A request that hit the prefix cache drafts into fresh blocks only; after the
    rollback the hit blocks keep their keys and serve the next identical prompt."""
    kv = make_kv(num_blocks=10, block_size=4)
    a = make_seq("a", [*range(8), 50])
    prefill(kv, a)
    kv.free("a")
    b = make_seq("b", [*range(8), 60, 61])
    assert prefill(kv, b) == [0, 1]  # a's two full blocks; a's freed tail block 2 is next
    assert kv.block_ids("b") == [0, 1, 2]
    assert verify_step(kv, b, 4, []) == 1  # positions 9..13 took block 3; 10 slots stay
    assert kv.block_ids("b") == [0, 1, 2]
    assert kv.free_block_ids()[0] == 3
    c = make_seq("c", [*range(8), 70])
    assert kv.get_computed_blocks(c).block_ids == [0, 1]


def test_rollback_refuses_to_cut_keyed_or_unknown_blocks() -> None:
    """Shrinking below a keyed (full, computed) block is a caller bug, as is a request
    without a table."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(9))
    prefill(kv, a)
    assert kv.allocate_slots(a, 3) is not None
    a.num_computed_tokens = 7
    with pytest.raises(ValueError, match="keyed"):
        kv.rollback_slots(a)
    with pytest.raises(KeyError):
        kv.rollback_slots(make_seq("x", range(3)))


def prefill_to(kv: KVCacheManager, seq: Seq, num_tokens: int) -> None:
    """Compute the first ``num_tokens`` of ``seq`` without the prefix cache."""
    assert kv.allocate_slots(seq, num_tokens) is not None
    seq.num_computed_tokens = num_tokens
    kv.cache_full_blocks(seq)
