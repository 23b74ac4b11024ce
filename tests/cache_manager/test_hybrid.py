"""HybridKVCacheManager: the global layers' tables and the sliding layers' own, block by block."""

from __future__ import annotations

import pytest

from cache_manager import KVCacheConfig
from cache_manager.hybrid import HybridKVCacheManager, window_blocks_for
from tests.cache_manager.helpers import Seq, make_seq, prefill

# Global group: blocks 0..7. Sliding group: its own 0 (null) .. 5, in the step's ids 8..13.
BS, WINDOW = 4, 4


def make_hybrid(num_global: int = 8, num_window: int = 6, **kw: object) -> HybridKVCacheManager:
    full = KVCacheConfig(num_blocks=num_global, block_size=BS, **kw)  # type: ignore[arg-type]
    window = KVCacheConfig(num_blocks=num_window, block_size=BS, sliding_window=WINDOW)
    return HybridKVCacheManager(full, window, max_chunk_tokens=8)


def test_both_tables_grow_and_the_window_releases_its_old_blocks() -> None:
    kv = make_hybrid()
    seq = make_seq("a", range(10))
    prefill(kv, seq)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.window_block_ids("a") == [9, 10, 11]
    # The next query (position 10) sees 7..10: block 0 (positions 0-3) is dead, block 1 not.
    assert kv.release_out_of_window(seq) == 1
    assert (kv.block_ids("a"), kv.window_block_ids("a")) == ([0, 1, 2], [8, 10, 11])
    stats = kv.make_stats()
    assert (stats.num_blocks_used, stats.sliding_blocks_used) == (3, 2)
    assert (stats.sliding_blocks_total, stats.sliding_blocks_released_total) == (5, 1)
    assert kv.num_free_blocks == min(8 - 3, 5 - 2)
    for token in range(10, 14):  # decodes to 14 tokens: block 1 (4-7) falls out too
        seq.tokens.append(token)
        assert kv.allocate_slots(seq, 1) is not None
        seq.num_computed_tokens += 1
        kv.cache_full_blocks(seq)
        kv.release_out_of_window(seq)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert kv.window_block_ids("a") == [8, 8, 11, 12]
    assert kv.make_stats().sliding_blocks_released_total == 2
    kv.check_invariants()
    kv.free("a")
    assert (kv.num_free_blocks, kv.window.num_free_blocks) == (5, 5)
    kv.check_invariants()


def test_a_prefix_hit_needs_its_blocks_in_both_groups() -> None:
    kv = make_hybrid()
    a = make_seq("a", range(10))
    prefill(kv, a)
    kv.release_out_of_window(a)  # window block 9 released, still cached with its key
    b = make_seq("b", [*range(10), 99])
    hit = kv.get_computed_blocks(b)
    assert (hit.block_ids, hit.num_tokens) == ([0, 1], 8)
    alloc = kv.allocate_slots(b, 3, hit)
    assert alloc is not None and alloc.new_block_ids == [0, 1, 3]
    assert kv.window_block_ids("b") == [9, 10, 12]
    b.num_computed_tokens = 8
    kv.release_out_of_window(b)  # positions 0-3 are out of b's window too
    assert kv.window_block_ids("b") == [8, 10, 12]
    kv.check_invariants()


def test_the_hit_is_as_short_as_the_shorter_groups() -> None:
    """The sliding group evicted a's first block: no hit at all, though the global group
    holds a's prefix."""
    kv = make_hybrid(num_window=5)  # window group: own 1..4
    a = make_seq("a", range(10))
    prefill(kv, a)
    kv.release_out_of_window(a)  # own 1 cached-free
    c = make_seq("c", range(100, 108))  # takes own 4, then evicts own 1 for its second block
    prefill(kv, c)
    assert kv.window_block_ids("c") == [12, 9]
    b = make_seq("b", [*range(10), 99])
    hit = kv.get_computed_blocks(b)
    assert (hit.block_ids, hit.num_tokens) == ([], 0)
    assert kv.allocate_slots(b, 11, hit) is None  # no room in the sliding group
    kv.check_invariants()


def test_no_room_in_one_group_changes_neither() -> None:
    kv = make_hybrid(num_global=8, num_window=3)  # sliding group: own 1, 2
    prefill(kv, make_seq("a", range(8)))
    before = (kv.block_ids("a"), kv.num_free_blocks, kv._pool.num_free)
    b = make_seq("b", range(50, 55))
    assert kv.allocate_slots(b, 5, kv.get_computed_blocks(b)) is None
    assert not kv.has_request("b") and not kv.window.has_request("b")
    assert (kv.block_ids("a"), kv.num_free_blocks, kv._pool.num_free) == before
    kv.check_invariants()


def test_fork_copies_on_write_in_both_groups_with_the_steps_ids() -> None:
    kv = make_hybrid()
    parent = make_seq("p", range(6))
    prefill(kv, parent)
    kv.fork("p", "c")
    child = Seq("c", list(range(6)), num_computed_tokens=6)
    child.tokens.append(7)
    alloc = kv.allocate_slots(child, 1)
    assert alloc is not None and alloc.block_copies == [(1, 2), (10, 11)]
    assert (kv.block_ids("c"), kv.window_block_ids("c")) == ([0, 2], [9, 11])
    kv.check_invariants()
    kv.free("p")
    kv.free("c")
    assert (kv._pool.num_free, kv.window.num_free_blocks) == (8, 5)


def test_rollback_and_free_reach_both_groups() -> None:
    kv = make_hybrid()
    seq = make_seq("a", range(3))
    prefill(kv, seq)
    assert kv.allocate_slots(seq, 6) is not None  # drafts to position 8: a block more each
    assert (kv.block_ids("a"), kv.window_block_ids("a")) == ([0, 1, 2], [9, 10, 11])
    assert kv.rollback_slots(seq) == 4  # back to 3 computed: two blocks a group
    assert (kv.block_ids("a"), kv.window_block_ids("a")) == ([0], [9])
    kv.drop_kv("a")
    with pytest.raises(KeyError):
        kv.free("a")
    assert (kv._pool.num_free, kv.window.num_free_blocks) == (8, 5)


@pytest.mark.parametrize(
    ("kw", "what"),
    [
        ({"kv_tier": True}, "the disk KV tier"),
        ({"kv_strategy": "adaptive"}, "the adaptive KV strategy"),
        ({"sliding_window": 16}, "a window over every layer"),
    ],
)
def test_what_it_does_not_run_with_is_refused_in_one_line(kw: dict[str, object], what: str) -> None:
    with pytest.raises(ValueError, match=what) as err:
        make_hybrid(**kw)
    assert "--sliding-layer-blocks off" in str(err.value)


def test_the_sliding_pool_holds_every_running_request_s_window() -> None:
    # window 512 + a 256-token chunk: 48 blocks of 16, and one partial block; 8 requests.
    assert window_blocks_for(8, 32768, 512, 16, 256) == 8 * 49 + 1
    # a context shorter than that: the whole context.
    assert window_blocks_for(4, 100, 512, 16, 256) == 4 * 7 + 1


def test_lookups_never_allocated_hold_nothing_and_a_stale_hit_is_refused() -> None:
    """The scheduler allocates right after it looks up; a request looked up and then left
    waiting (no room, then aborted) holds nothing here, however many there are, and only the
    last lookup's hit can be allocated."""
    kv = make_hybrid()
    a = make_seq("a", range(10))
    prefill(kv, a)
    for i in range(1000):  # looked up, never admitted
        kv.get_computed_blocks(make_seq(f"w{i}", [*range(10), 50]))
    assert kv._window_hit is not None and kv._window_hit[0] == "w999"
    b, c = make_seq("b", [*range(10), 99]), make_seq("c", [*range(10), 98])
    hit_b = kv.get_computed_blocks(b)
    kv.get_computed_blocks(c)
    free = (kv.num_free_blocks, kv.window.num_free_blocks)
    with pytest.raises(ValueError, match="request 'b': a prefix hit not from"):
        kv.allocate_slots(b, 3, hit_b)
    assert (kv.num_free_blocks, kv.window.num_free_blocks) == free
    hit_b = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 3, hit_b) is not None
    assert kv._window_hit is None
    kv.check_invariants()
