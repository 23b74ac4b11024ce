"""Eviction order under each policy: exact free-list order and exact victims."""

from __future__ import annotations

import pytest

from cache_manager import Allocation, KVCacheManager
from tests.cache_manager.helpers import hit_view, make_kv, make_seq, prefill


def _history(kv: KVCacheManager) -> None:
    """Eight blocks of 2 tokens. Afterwards the empty blocks are 6, 7 and the keyed free blocks
    carry this history (freed order = LRU order; hits; sharing):

    block  prefix        freed at  hit_count  shared
      1    [1,2,3,4]     step 1        0        no
      0    [1,2]         step 3        2        yes (hit)
      3    [5,6,7,8]     step 4        0        no
      5    [20..23]      step 5        0        yes (forked)
      4    [20,21]       step 5        0        yes (forked)
      2    [5,6]         step 6        1        yes (hit)
    """
    prefill(kv, make_seq("A", [1, 2, 3, 4]))  # step 1: blocks 0, 1
    kv.free("A")
    for name, tail in (("C", 50), ("C2", 51)):  # steps 2, 3: hit block 0 twice
        assert prefill(kv, make_seq(name, [1, 2, tail])) == [0]
        kv.free(name)
    prefill(kv, make_seq("B", [5, 6, 7, 8]))  # step 4: blocks 2, 3
    kv.free("B")
    prefill(kv, make_seq("F", [20, 21, 22, 23]))  # step 5: blocks 4, 5, shared by a fork
    kv.fork("F", "G")
    kv.free("F")
    kv.free("G")
    assert prefill(kv, make_seq("H", [5, 6, 60])) == [2]  # step 6: hit block 2
    kv.free("H")
    kv.check_invariants()


@pytest.mark.parametrize(
    ("policy", "free_order", "new_block_ids"),
    [
        # Least recently freed first.
        ("lru", [6, 7, 1, 0, 3, 5, 4, 2], [6, 7, 1, 0, 3]),
        # Hit count 0 (in freed order: 1, 3, 5, 4), then 1 (block 2), then 2 (block 0).
        ("lfu", [6, 7, 1, 3, 5, 4, 2, 0], [6, 7, 1, 3, 5]),
        # Unshared (1, 3) first, then shared or hit blocks in freed order (0, 5, 4, 2).
        ("shared-prefix", [6, 7, 1, 3, 0, 5, 4, 2], [6, 7, 1, 3, 0]),
    ],
)
def test_eviction_order(policy: str, free_order: list[int], new_block_ids: list[int]) -> None:
    """The free list, and the victims of a 5-block allocation, follow the policy."""
    kv = make_kv(num_blocks=8, block_size=2, eviction_policy=policy)
    _history(kv)
    assert kv.free_block_ids() == free_order
    assert kv.make_stats().evictions_total == 0
    z = make_seq("Z", range(90, 100))
    assert kv.allocate_slots(z, 10) == Allocation(new_block_ids, [])
    assert kv.make_stats().evictions_total == 3
    assert kv.free_block_ids() == free_order[5:]
    kv.check_invariants()


def test_evicted_block_loses_its_key_and_its_hit_count() -> None:
    """LFU: a block that was hit, evicted and re-keyed starts again at hit count 0."""
    kv = make_kv(num_blocks=3, block_size=2, eviction_policy="lfu")
    prefill(kv, make_seq("A", [1, 2, 3]))  # block 0 keyed [1,2], block 1 partial
    kv.free("A")
    assert prefill(kv, make_seq("B", [1, 2, 4])) == [0]  # block 0 hit once
    kv.free("B")
    assert kv.free_block_ids() == [1, 2, 0]
    prefill(kv, make_seq("C", [7, 8, 9, 10, 11, 12]))  # needs all 3 blocks: evicts 0
    assert kv.block_ids("C") == [1, 2, 0]
    kv.free("C")
    # C's blocks are all keyed, each with hit count 0: tail first.
    assert kv.free_block_ids() == [0, 2, 1]
    assert hit_view(kv.get_computed_blocks(make_seq("D", [1, 2, 5]))) == ([], 0)
