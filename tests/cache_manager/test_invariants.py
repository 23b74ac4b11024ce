"""check_invariants detects each kind of corruption, so it cannot pass silently."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cache_manager import KVCacheManager
from tests.cache_manager.helpers import make_kv, make_seq, prefill


def _setup() -> KVCacheManager:
    """Blocks: 0,1 keyed and held by a; 2 partial held by a; 3,4 cached-free; 5..7 empty."""
    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", range(10)))
    prefill(kv, make_seq("b", range(100, 108)))
    kv.free("b")
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.free_block_ids() == [5, 6, 7, 4, 3]
    kv.check_invariants()
    return kv


def _ref_count_plus_one(kv: KVCacheManager) -> None:
    kv._pool.blocks[1].ref_count += 1


def _ref_count_on_free_block(kv: KVCacheManager) -> None:
    kv._pool.blocks[6].ref_count = 1


def _leak_a_block(kv: KVCacheManager) -> None:
    kv._pool.empty.remove(kv._pool.blocks[6])


def _broken_prev_link(kv: KVCacheManager) -> None:
    kv._pool.blocks[6].prev = kv._pool.blocks[7]


def _broken_next_link(kv: KVCacheManager) -> None:
    kv._pool.blocks[5].next = kv._pool.blocks[7]  # skips block 6


def _free_list_length(kv: KVCacheManager) -> None:
    kv._pool.empty._len += 1


def _key_changed_under_map(kv: KVCacheManager) -> None:
    kv._pool.blocks[3].block_hash = b"\x00" * 16


def _map_entry_to_wrong_block(kv: KVCacheManager) -> None:
    key = kv._pool.blocks[3].block_hash
    assert key is not None
    kv._pool.cached[key] = kv._pool.blocks[4]


def _key_missing_from_map(kv: KVCacheManager) -> None:
    key = kv._pool.blocks[0].block_hash
    assert key is not None
    del kv._pool.cached[key]


def _table_id_mismatch(kv: KVCacheManager) -> None:
    kv._requests["a"].block_ids[2] = 7


def _block_in_two_places(kv: KVCacheManager) -> None:
    state = kv._requests["a"]
    state.blocks.append(kv._pool.blocks[5])
    state.block_ids.append(5)
    kv._pool.blocks[5].ref_count = 1  # referenced and still on the free list


def _used_slots_counter(kv: KVCacheManager) -> None:
    # a holds 10 tokens: blocks 0, 1, 2 hold 4 + 4 + 2 slots.
    kv._num_used_slots += 1


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_ref_count_plus_one, "block 1: ref_count=2 but 1 block tables hold it"),
        (_ref_count_on_free_block, "block 6 is free and referenced"),
        (_leak_a_block, "block 6 leaked: neither free nor referenced"),
        (_broken_prev_link, r"block 6.prev is not block 5"),
        (_broken_next_link, "block 7.prev is not block 5"),
        (_free_list_length, "empty: length 4 but 3 blocks linked"),
        (_key_changed_under_map, "prefix map entry .* points at block 3 whose key is 0000"),
        (_map_entry_to_wrong_block, "points at block 4"),
        (_key_missing_from_map, "block 0 has a key missing from the prefix map"),
        (_table_id_mismatch, r"block_ids\[2\]=7 but the table holds block 2"),
        (_block_in_two_places, "block 5 is free and referenced"),
        (_used_slots_counter, "used slots: counter 11, blocks 10"),
    ],
)
def test_check_invariants_detects(corrupt: Callable[[KVCacheManager], None], message: str) -> None:
    """Each corruption makes check_invariants raise RuntimeError naming it."""
    kv = _setup()
    corrupt(kv)
    with pytest.raises(RuntimeError, match=message):
        kv.check_invariants()
