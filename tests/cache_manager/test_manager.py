"""Exact block ids and free-list order for every KVCacheManager operation."""

from __future__ import annotations

from dataclasses import fields

import pytest

from cache_manager import Allocation, KVCacheConfig, KVCacheManager
from scheduler.request import Request
from tests.cache_manager.helpers import Seq, decode, hit_view, make_kv, make_seq, prefill

# ----------------------------------------------------------------------------- allocation


def test_fresh_manager_hands_out_blocks_in_id_order() -> None:
    """A new pool's free list is 0..n-1, and allocations take from its front."""
    kv = make_kv(num_blocks=8, block_size=4)
    assert kv.free_block_ids() == [0, 1, 2, 3, 4, 5, 6, 7]
    a = make_seq("a", range(10))
    assert kv.allocate_slots(a, 10) == Allocation([0, 1, 2], [])
    b = make_seq("b", range(100, 105))
    assert kv.allocate_slots(b, 5) == Allocation([3, 4], [])
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.block_ids("b") == [3, 4]
    assert kv.free_block_ids() == [5, 6, 7]
    assert kv.num_free_blocks == 3
    kv.check_invariants()


def test_allocate_grows_the_table_only_at_block_boundaries() -> None:
    """Decode steps inside the last block take nothing; the step that crosses takes one block."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(6))
    prefill(kv, a, use_cache=False)
    assert kv.block_ids("a") == [0, 1]
    assert decode(kv, a, 60) == Allocation([], [])  # position 6
    assert decode(kv, a, 61) == Allocation([], [])  # position 7 fills block 1
    assert decode(kv, a, 62) == Allocation([2], [])  # position 8 opens block 2
    assert kv.block_ids("a") == [0, 1, 2]


def test_block_ids_returns_a_copy() -> None:
    """Mutating the returned table does not touch the manager's table."""
    kv = make_kv()
    a = make_seq("a", range(5))
    prefill(kv, a)
    table = kv.block_ids("a")
    table.append(99)
    assert kv.block_ids("a") == [0, 1]


def test_num_blocks_for_rounds_up() -> None:
    """num_blocks_for is ceil(tokens / block_size) and rejects negatives."""
    kv = make_kv(block_size=4)
    assert [kv.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="-1"):
        kv.num_blocks_for(-1)


def test_allocate_none_on_running_request_changes_nothing() -> None:
    """No room for a decode step: None, and table, free list and stats are unchanged."""
    kv = make_kv(num_blocks=2, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", range(8))
    prefill(kv, a)
    before = (kv.block_ids("a"), kv.free_block_ids(), kv.make_stats())
    a.tokens.append(8)
    assert kv.allocate_slots(a, 1) is None
    assert (kv.block_ids("a"), kv.free_block_ids(), kv.make_stats()) == before
    kv.check_invariants()


def test_allocate_none_counts_free_prefix_hits_against_room() -> None:
    """Hit blocks on the free list use free capacity: 2 free hits + 3 fresh > 4 free -> None,
    with no side effect; 2 free hits + 2 fresh fits exactly."""
    kv = make_kv(num_blocks=4, block_size=4)
    a = make_seq("a", range(8))
    prefill(kv, a)
    kv.free("a")
    # Block 0 and 1 are full and keyed: freed tail first behind the empty blocks.
    assert kv.free_block_ids() == [2, 3, 1, 0]
    b = make_seq("b", [*range(8), *range(100, 110)])  # 18 tokens: 5 blocks
    hit = kv.get_computed_blocks(b)
    assert hit_view(hit) == ([0, 1], 8)
    stats_before = kv.make_stats()
    assert kv.allocate_slots(b, 10, hit) is None
    assert kv.free_block_ids() == [2, 3, 1, 0]
    assert not kv.has_request("b")
    assert kv.make_stats() == stats_before
    kv.check_invariants()
    c = make_seq("c", [*range(8), *range(100, 106)])  # 14 tokens: 4 blocks
    hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 6, hit) == Allocation([0, 1, 2, 3], [])
    assert kv.free_block_ids() == []
    assert kv.make_stats().evictions_total == 0
    kv.check_invariants()


def test_new_request_with_computed_tokens_is_rejected() -> None:
    """KV cannot exist without blocks: a tableless request with progress is a caller bug."""
    kv = make_kv()
    a = make_seq("a", range(6))
    a.num_computed_tokens = 4
    with pytest.raises(ValueError, match="num_computed_tokens=4"):
        kv.allocate_slots(a, 2)
    with pytest.raises(ValueError, match="num_new_tokens must be >= 0, got -1"):
        kv.allocate_slots(make_seq("b", range(3)), -1)
    assert not kv.has_request("a")


# ----------------------------------------------------------------------------- free


def test_free_is_tail_first_and_keyless_blocks_go_to_the_front() -> None:
    """Freed keyed blocks join the back tail first; the keyless partial tail joins the front."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(10))
    prefill(kv, a)  # blocks 0, 1 full and keyed; block 2 holds 2 tokens, no key
    kv.free("a")
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    stats = kv.make_stats()
    assert (stats.num_blocks_free, stats.num_blocks_cached_free, stats.num_blocks_used) == (6, 2, 0)


def test_free_without_prefix_caching_returns_blocks_to_the_front_in_table_order() -> None:
    """Without keys every freed block is empty: tail first to the front leaves 0,1,2 first."""
    kv = make_kv(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq("a", range(10))
    b = make_seq("b", range(3))
    prefill(kv, a)
    prefill(kv, b)
    kv.free("a")
    assert kv.free_block_ids() == [0, 1, 2, 4, 5, 6, 7]
    kv.free("b")
    assert kv.free_block_ids() == [3, 0, 1, 2, 4, 5, 6, 7]


def test_tail_is_evicted_before_head() -> None:
    """With only keyed blocks left, the first eviction takes the freed request's last block."""
    kv = make_kv(num_blocks=4, block_size=4)
    a = make_seq("a", range(16))
    prefill(kv, a)
    kv.free("a")
    assert kv.free_block_ids() == [3, 2, 1, 0]
    b = make_seq("b", range(100, 104))
    assert kv.allocate_slots(b, 4) == Allocation([3], [])
    assert kv.make_stats().evictions_total == 1
    # Blocks 0..2 still hold a's first 12 tokens.
    again = make_seq("again", [*range(16), 99])
    assert hit_view(kv.get_computed_blocks(again)) == ([0, 1, 2], 12)


def test_double_free_and_unknown_free_raise() -> None:
    """free is exactly once: a second free, or a never-seen id, raises KeyError."""
    kv = make_kv()
    a = make_seq("a", range(5))
    prefill(kv, a)
    kv.free("a")
    with pytest.raises(KeyError, match="'a'"):
        kv.free("a")
    with pytest.raises(KeyError, match="'nobody'"):
        kv.free("nobody")
    assert not kv.has_request("a")
    kv.check_invariants()


# ----------------------------------------------------------------------------- prefix cache


def test_prefix_hit_on_a_free_cached_block_takes_it_off_the_free_list() -> None:
    """A hit reuses the freed blocks 0,1 (leaving the free list) and then takes the front block."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(10))
    prefill(kv, a)
    kv.free("a")
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    b = make_seq("b", [*range(8), 100, 101])
    hit = kv.get_computed_blocks(b)
    assert hit_view(hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 2, hit) == Allocation([0, 1, 2], [])
    assert kv.block_ids("b") == [0, 1, 2]
    assert kv.free_block_ids() == [3, 4, 5, 6, 7]
    kv.check_invariants()


def test_prefix_hit_on_a_block_in_use_shares_it() -> None:
    """Two live requests share a cached block: ref_count 2, freed only when both are freed."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(6))
    prefill(kv, a)  # [0, 1]; block 0 keyed
    b = make_seq("b", [0, 1, 2, 3, 50])
    assert prefill(kv, b) == [0]
    assert kv.block_ids("b") == [0, 2]
    kv.free("a")
    assert kv.free_block_ids() == [1, 3, 4, 5, 6, 7]
    kv.free("b")
    assert kv.free_block_ids() == [2, 1, 3, 4, 5, 6, 7, 0]


def test_hit_never_covers_the_last_token() -> None:
    """An 8-token prompt whose 2 blocks are both cached hits only the first block."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(8))
    prefill(kv, a)
    same = make_seq("same", range(8))
    assert hit_view(kv.get_computed_blocks(same)) == ([0], 4)
    # A hit of both blocks, looked up for "same" with one token more: rejected.
    longer = kv.get_computed_blocks(make_seq("same", [*range(8), 8]))
    assert hit_view(longer) == ([0, 1], 8)
    with pytest.raises(ValueError, match="never covers the last token"):
        kv.allocate_slots(same, 0, longer)


def test_salt_isolation() -> None:
    """Same tokens under another cache_salt (or none) never hit; the same salt does."""
    kv = make_kv(num_blocks=16, block_size=4)
    a = make_seq("a", range(9), salt="tenant-1")
    prefill(kv, a)
    assert hit_view(kv.get_computed_blocks(make_seq("x", range(9), salt="tenant-2"))) == ([], 0)
    assert hit_view(kv.get_computed_blocks(make_seq("y", range(9), salt=None))) == ([], 0)
    assert hit_view(kv.get_computed_blocks(make_seq("z", range(9), salt=""))) == ([], 0)
    tenant_1 = kv.get_computed_blocks(make_seq("w", range(9), salt="tenant-1"))
    assert hit_view(tenant_1) == ([0, 1], 8)
    # Tenant 1's hit cannot be handed to a tenant-2 request: a hit belongs to its lookup.
    with pytest.raises(ValueError, match="looked up for 'w'"):
        kv.allocate_slots(make_seq("v", range(9), salt="tenant-2"), 1, tenant_1)


def test_stale_hit_ids_are_rejected() -> None:
    """Hit ids whose block was handed out between lookup and allocation raise ValueError."""
    kv = make_kv(num_blocks=2, block_size=4)
    a = make_seq("a", range(4))
    prefill(kv, a)
    kv.free("a")
    b = make_seq("b", [0, 1, 2, 3, 4])
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0]
    other = make_seq("other", range(100, 108))
    assert kv.allocate_slots(other, 8) == Allocation([1, 0], [])  # evicts block 0
    with pytest.raises(ValueError, match=r"block 0 does not hold its tokens 0\.\.3"):
        kv.allocate_slots(b, 1, hit)
    assert not kv.has_request("b")


def test_hits_only_for_a_request_without_blocks() -> None:
    """Passing a hit to a request that already holds blocks is a caller bug."""
    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", range(8)))
    b = make_seq("b", range(3))
    prefill(kv, b)
    with pytest.raises(ValueError, match="without blocks"):
        kv.allocate_slots(b, 1, kv.get_computed_blocks(b))


def test_prefix_stats_count_tokens_per_consumed_hit() -> None:
    """Each consumed hit counts len(all_token_ids) queried and the hit tokens."""
    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", range(10)))  # query 10, hit 0
    prefill(kv, make_seq("b", range(9)))  # query 9, hit 8
    prefill(kv, make_seq("c", range(9)))  # query 9, hit 8
    stats = kv.make_stats()
    assert stats.prefix_queries_tokens_total == 10 + 9 + 9
    assert stats.prefix_hits_tokens_total == 16
    assert stats.cache_hit_rate == 16 / 28


def test_a_hit_is_counted_when_consumed_and_consumed_once() -> None:
    """Lookups count nothing; the allocation that consumes a hit counts it once; a failed
    allocation counts nothing and leaves the hit usable; a consumed hit is refused after,
    changing nothing, even once its request is freed."""
    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", range(10)))  # query 10, hit 0
    b = make_seq("b", range(9))
    first = kv.get_computed_blocks(b)
    assert hit_view(first) == ([0, 1], 8)
    assert hit_view(kv.get_computed_blocks(b)) == ([0, 1], 8)
    stats = kv.make_stats()
    assert (stats.prefix_queries_tokens_total, stats.prefix_hits_tokens_total) == (10, 0)
    assert kv.reserve_slots(b, 40, first) is None  # 10 blocks > 8
    assert kv.make_stats() == stats
    assert kv.allocate_slots(b, 1, first) == Allocation([0, 1, 3], [])
    stats = kv.make_stats()
    assert (stats.prefix_queries_tokens_total, stats.prefix_hits_tokens_total) == (19, 8)
    kv.check_invariants()
    with pytest.raises(ValueError, match="already consumed"):
        kv.allocate_slots(b, 1, first)
    kv.free("b")
    before = (kv.free_block_ids(), kv.make_stats())
    with pytest.raises(ValueError, match="already consumed"):
        kv.reserve_slots(b, 12, first)
    assert (kv.free_block_ids(), kv.make_stats()) == before
    assert not kv.has_request("b")
    kv.check_invariants()


def test_prefix_caching_disabled_never_hits_or_counts() -> None:
    """With prefix caching off, lookups return nothing, count nothing and no block gets a key."""
    kv = make_kv(num_blocks=8, block_size=4, enable_prefix_caching=False)
    prefill(kv, make_seq("a", range(10)))
    kv.free("a")
    assert hit_view(kv.get_computed_blocks(make_seq("b", range(10)))) == ([], 0)
    stats = kv.make_stats()
    assert (stats.prefix_queries_tokens_total, stats.num_blocks_cached_free) == (0, 0)
    # A hit from a manager with prefix caching on is refused here.
    cached = make_kv(num_blocks=8, block_size=4)
    prefill(cached, make_seq("a", range(10)))
    foreign = cached.get_computed_blocks(make_seq("c", range(10)))
    assert hit_view(foreign) == ([0, 1], 8)
    with pytest.raises(ValueError, match="disabled"):
        kv.allocate_slots(make_seq("c", range(10)), 2, foreign)


def test_duplicate_prefix_keeps_the_first_block() -> None:
    """Two requests that compute the same prefix at once: only the first block is keyed; the
    duplicate is freed to the front as an empty block."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(5))
    b = make_seq("b", range(5))
    assert kv.allocate_slots(a, 5) == Allocation([0, 1], [])
    assert kv.allocate_slots(b, 5) == Allocation([2, 3], [])
    for seq in (a, b):
        seq.num_computed_tokens = 5
        kv.cache_full_blocks(seq)
    kv.check_invariants()
    kv.free("b")
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7]
    assert hit_view(kv.get_computed_blocks(make_seq("c", range(5)))) == ([0], 4)


def test_reset_prefix_cache_refused_while_in_use_then_drops_keys() -> None:
    """reset_prefix_cache is False while a request holds blocks; afterwards no key survives."""
    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", range(10)))
    assert kv.reset_prefix_cache() is False
    kv.free("a")
    assert kv.make_stats().num_blocks_cached_free == 2
    assert kv.reset_prefix_cache() is True
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert kv.make_stats().num_blocks_cached_free == 0
    assert hit_view(kv.get_computed_blocks(make_seq("b", range(10)))) == ([], 0)
    kv.check_invariants()


def test_works_with_scheduler_request() -> None:
    """scheduler.request.Request satisfies CacheSequence: prefill, hit and free with it."""
    kv = make_kv(num_blocks=8, block_size=4)
    first = Request("r0", prompt_token_ids=list(range(9)), cache_salt="s")
    assert kv.allocate_slots(first, 9) == Allocation([0, 1, 2], [])
    first.num_computed_tokens = 9
    kv.cache_full_blocks(first)
    second = Request("r1", prompt_token_ids=list(range(9)), cache_salt="s")
    assert hit_view(kv.get_computed_blocks(second)) == ([0, 1], 8)
    kv.free("r0")
    kv.check_invariants()


# ----------------------------------------------------------------------------- fork + CoW


def test_fork_then_parent_appends_copies_the_shared_partial_block() -> None:
    """The parent's write into the shared half-full block 1 copies it into block 2; the child
    then writes block 1 in place (no longer shared)."""
    kv = make_kv(num_blocks=8, block_size=4)
    parent = make_seq("p", range(6))
    prefill(kv, parent)  # [0, 1]: block 1 holds positions 4, 5
    kv.fork("p", "c")
    child = Seq("c", list(parent.tokens), num_computed_tokens=6)
    assert kv.block_ids("c") == [0, 1]
    assert decode(kv, parent, 50) == Allocation([], [(1, 2)])
    assert kv.block_ids("p") == [0, 2]
    assert decode(kv, child, 60) == Allocation([], [])
    assert kv.block_ids("c") == [0, 1]
    assert kv.make_stats().cow_copies_total == 1
    kv.free("p")
    kv.free("c")
    # p tail first: 2 (front), 0 stays (c holds it); then c: 1 (front), 0 (keyed, back).
    assert kv.free_block_ids() == [1, 2, 3, 4, 5, 6, 7, 0]


def test_fork_then_child_appends_first() -> None:
    """Either side copies: here the child writes first and gets the copy."""
    kv = make_kv(num_blocks=8, block_size=4)
    parent = make_seq("p", range(6))
    prefill(kv, parent)
    kv.fork("p", "c")
    child = Seq("c", list(parent.tokens), num_computed_tokens=6)
    assert decode(kv, child, 60) == Allocation([], [(1, 2)])
    assert decode(kv, parent, 50) == Allocation([], [])
    assert (kv.block_ids("p"), kv.block_ids("c")) == ([0, 1], [0, 2])


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    """When the shared blocks are all full, both sides just open new blocks."""
    kv = make_kv(num_blocks=8, block_size=4)
    parent = make_seq("p", range(8))
    prefill(kv, parent)
    kv.fork("p", "c")
    child = Seq("c", list(parent.tokens), num_computed_tokens=8)
    assert decode(kv, parent, 50) == Allocation([2], [])
    assert decode(kv, child, 60) == Allocation([3], [])
    assert kv.make_stats().cow_copies_total == 0


def test_fork_of_reserved_blocks_copies_only_blocks_with_data() -> None:
    """A shared block with computed slots is copied; a shared reserved block with none is
    replaced without a copy."""
    kv = make_kv(num_blocks=8, block_size=4)
    parent = make_seq("p", range(5))
    assert kv.reserve_slots(parent, 12) == Allocation([0, 1, 2], [])
    assert kv.allocate_slots(parent, 5) == Allocation([], [])
    parent.num_computed_tokens = 5
    kv.fork("p", "c")
    parent.tokens.extend([5, 6, 7, 8])
    assert kv.allocate_slots(parent, 4) == Allocation([], [(1, 3)])
    assert kv.block_ids("p") == [0, 3, 4]
    assert kv.block_ids("c") == [0, 1, 2]
    kv.check_invariants()


def test_fork_errors() -> None:
    """Forking an unknown parent is KeyError; forking onto an existing child is ValueError."""
    kv = make_kv()
    prefill(kv, make_seq("p", range(5)))
    prefill(kv, make_seq("q", range(5)))
    with pytest.raises(KeyError):
        kv.fork("nobody", "c")
    with pytest.raises(ValueError, match="'q'"):
        kv.fork("p", "q")


def test_copy_on_write_none_when_no_block_for_the_copy() -> None:
    """A write that needs a copy but finds no free block returns None and changes nothing."""
    kv = make_kv(num_blocks=2, block_size=4)
    parent = make_seq("p", range(6))
    prefill(kv, parent)
    kv.fork("p", "c")
    parent.tokens.append(50)
    assert kv.allocate_slots(parent, 1) is None
    assert kv.block_ids("p") == [0, 1]
    assert kv.make_stats().cow_copies_total == 0
    kv.check_invariants()


# ----------------------------------------------------------------------------- reservation


def test_reserve_then_allocate_within_reservation_takes_nothing() -> None:
    """reserve_slots takes the whole length up front; steps inside it take no block."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(5))
    assert kv.reserve_slots(a, 12) == Allocation([0, 1, 2], [])
    assert kv.free_block_ids() == [3, 4, 5, 6, 7]
    assert kv.allocate_slots(a, 5) == Allocation([], [])
    a.num_computed_tokens = 5
    for token in range(5, 12):
        assert decode(kv, a, token) == Allocation([], [])
    assert decode(kv, a, 12) == Allocation([3], [])
    assert kv.reserve_slots(a, 8) == Allocation([], [])  # already covered


def test_reserve_after_fork_makes_every_block_to_be_written_private() -> None:
    """Reserve mode after a fork: the child's reservation copies the shared half-full block 1
    into 3 and replaces the unwritten shared block 2 by 4; no later step takes a block."""
    kv = make_kv(num_blocks=8, block_size=4)
    parent = make_seq("p", range(5))
    assert kv.reserve_slots(parent, 12) == Allocation([0, 1, 2], [])
    assert kv.allocate_slots(parent, 5) == Allocation([], [])
    parent.num_computed_tokens = 5
    kv.fork("p", "c")
    child = Seq("c", list(parent.tokens), num_computed_tokens=5)
    assert kv.reserve_slots(child, 12) == Allocation([], [(1, 3)])
    assert kv.block_ids("c") == [0, 3, 4]
    assert kv.reserve_slots(parent, 12) == Allocation([], [])  # 1 and 2 are private again
    assert kv.free_block_ids() == [5, 6, 7]
    for token in range(5, 12):
        assert decode(kv, parent, token) == Allocation([], [])
        assert decode(kv, child, 100 + token) == Allocation([], [])
    assert kv.make_stats().cow_copies_total == 1
    assert kv.reserve_slots(Seq("d", [1], num_computed_tokens=0), 13) is None  # 4 > 3 free
    kv.check_invariants()


def test_reserve_none_when_too_long_and_with_hits() -> None:
    """A reservation that does not fit returns None untouched; one with hits takes them first."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(8))
    prefill(kv, a)
    kv.free("a")
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    b = make_seq("b", [*range(8), 8])
    hit = kv.get_computed_blocks(b)
    assert kv.reserve_slots(b, 40, hit) is None  # 10 blocks > 8
    assert kv.reserve_slots(make_seq("c", range(3)), 33) is None
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    assert kv.reserve_slots(b, 20, hit) == Allocation([0, 1, 2, 3, 4], [])
    assert kv.free_block_ids() == [5, 6, 7]
    kv.check_invariants()


# ----------------------------------------------------------------------------- one core (_grow)


def test_grow_plain_copies_on_write_before_taking_fresh_blocks() -> None:
    """Growth through a shared partial block: the copy takes the front free block (2), the
    fresh blocks the next ones (3, 4); slots and holders are counted once."""
    kv = make_kv(num_blocks=8, block_size=4)
    parent = make_seq("p", range(6))
    prefill(kv, parent)  # [0, 1]: block 1 holds positions 4, 5
    kv.fork("p", "c")
    parent.tokens.extend(range(6, 13))  # positions 6..12: blocks 1 (shared), 2, 3 of the table
    assert kv.allocate_slots(parent, 7) == Allocation([3, 4], [(1, 2)])
    assert (kv.block_ids("p"), kv.block_ids("c")) == ([0, 2, 3, 4], [0, 1])
    assert kv.free_block_ids() == [5, 6, 7]
    stats = kv.make_stats()
    # p holds 13 slots, c 6; slots with KV: 4 (0) + 2 (1) + 4 (2) + 4 (3) + 1 (4) of 5 blocks.
    assert (stats.total_tokens, stats.cache_efficiency, stats.cow_copies_total) == (19, 15 / 20, 1)
    kv.check_invariants()


def test_grow_reserve_with_a_hit_and_the_first_chunk_in_one_call() -> None:
    """Reserve-mode admission: hit blocks 0, 1 leave the free list, fresh 2, 3 cover the rest
    of 16 slots, and the first chunk's 3 slots are written, in one call; no later step
    within the reservation takes a block."""
    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", range(10)))
    kv.free("a")
    assert kv.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    b = make_seq("b", [*range(8), 50, 51, 52])
    hit = kv.get_computed_blocks(b)
    assert kv.reserve_slots(b, 16, hit, num_new_tokens=3) == Allocation([0, 1, 2, 3], [])
    assert kv.free_block_ids() == [4, 5, 6, 7]
    stats = kv.make_stats()
    assert (stats.total_tokens, stats.cache_efficiency) == (11, 11 / 16)
    assert (stats.prefix_queries_tokens_total, stats.prefix_hits_tokens_total) == (10 + 11, 8)
    kv.check_invariants()
    b.num_computed_tokens = 11
    kv.cache_full_blocks(b)
    for token in range(53, 58):
        assert decode(kv, b, token) == Allocation([], [])
    assert kv.block_ids("b") == [0, 1, 2, 3]
    assert decode(kv, b, 58) == Allocation([4], [])  # slot 16: past the reservation


def test_grow_admission_takes_free_hits_before_fresh_blocks() -> None:
    """Admission with a hit on free cached blocks 0, 1: they leave the free list first, so the
    fresh blocks come from the rest (3, then 2 evicted); 4 blocks asked of 4 free fits."""
    kv = make_kv(num_blocks=4, block_size=4)
    prefill(kv, make_seq("a", range(12)))
    kv.free("a")
    assert kv.free_block_ids() == [3, 2, 1, 0]
    b = make_seq("b", [*range(8), *range(200, 205)])  # 13 tokens: hit 8, 2 fresh blocks
    hit = kv.get_computed_blocks(b)
    assert hit_view(hit) == ([0, 1], 8)
    assert kv.allocate_slots(b, 5, hit) == Allocation([0, 1, 3, 2], [])
    assert kv.free_block_ids() == []
    stats = kv.make_stats()
    assert (stats.evictions_total, stats.total_tokens, stats.cache_efficiency) == (1, 13, 13 / 16)
    kv.check_invariants()


# ----------------------------------------------------------------------------- sliding window


def test_sliding_window_releases_blocks_to_the_null_block() -> None:
    """Window 8, block 4: at 16 computed tokens positions 0..7 are dead; blocks 1, 2 are
    released and their table slots point at null block 0."""
    kv = make_kv(num_blocks=8, block_size=4, sliding_window=8)
    assert kv.null_block_id == 0
    assert kv.free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    a = make_seq("a", range(16))
    prefill(kv, a)
    assert kv.block_ids("a") == [1, 2, 3, 4]
    assert kv.release_out_of_window(a) == 2
    assert kv.block_ids("a") == [0, 0, 3, 4]
    # Released blocks are full and keyed: tail first to the back of the free list.
    assert kv.free_block_ids() == [5, 6, 7, 2, 1]
    assert kv.release_out_of_window(a) == 0
    assert decode(kv, a, 16) == Allocation([5], [])  # 17 computed: dead below 9, block 2 only
    assert kv.release_out_of_window(a) == 0
    for token in (17, 18, 19):
        decode(kv, a, token)
    assert kv.release_out_of_window(a) == 1  # 20 computed: dead below 12
    assert kv.block_ids("a") == [0, 0, 0, 4, 5]
    stats = kv.make_stats()
    assert (stats.num_blocks_reserved, stats.num_blocks_used, stats.total_tokens) == (1, 2, 8)
    kv.free("a")
    assert kv.free_block_ids() == [6, 7, 2, 1, 3, 5, 4]
    kv.check_invariants()


def test_num_usable_blocks_excludes_the_null_block() -> None:
    """Every block but the reserved null block can be handed out; usage is over those."""
    assert make_kv(num_blocks=8).num_usable_blocks == 8
    kv = make_kv(num_blocks=8, block_size=4, sliding_window=8)
    assert kv.num_usable_blocks == 7 == kv.num_free_blocks
    prefill(kv, make_seq("a", range(8)))
    assert kv.usage == 2 / 7


def test_sliding_window_off_releases_nothing() -> None:
    """Without a window release_out_of_window is a no-op and there is no null block."""
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_seq("a", range(16))
    prefill(kv, a)
    assert kv.null_block_id is None
    assert kv.release_out_of_window(a) == 0
    assert kv.block_ids("a") == [0, 1, 2, 3]


def test_sliding_window_released_keys_still_chain() -> None:
    """Blocks released before cache_full_blocks ran still get keys chained for later blocks."""
    kv = make_kv(num_blocks=8, block_size=4, sliding_window=4)
    a = make_seq("a", range(13))
    assert kv.allocate_slots(a, 13) == Allocation([1, 2, 3, 4], [])
    a.num_computed_tokens = 13
    assert kv.release_out_of_window(a) == 2  # dead below 9: positions 0..7
    kv.cache_full_blocks(a)  # positions 0, 1 get chain keys only; block 3 (position 2) a key
    kv.check_invariants()
    kv.free("a")
    assert kv.make_stats().num_blocks_cached_free == 1
    # Released keyless (front, tail first: 2 then 1), then a: 4 keyless to the front, 3 keyed.
    assert kv.free_block_ids() == [4, 1, 2, 5, 6, 7, 3]
    # Lookups start at position 0, whose KV is gone, so nothing hits.
    assert hit_view(kv.get_computed_blocks(make_seq("b", range(13)))) == ([], 0)


# ----------------------------------------------------------------------------- stats


def test_stats_by_hand() -> None:
    """Every KVCacheStats field for two requests, one forked, computed by hand."""
    kv = make_kv(num_blocks=8, block_size=4, block_bytes=1000)
    a = make_seq("a", range(10))  # blocks 0,1,2: 4 + 4 + 2 slots
    prefill(kv, a)
    b = make_seq("b", range(100, 105))  # blocks 3,4: 4 + 1 slots
    prefill(kv, b)
    kv.fork("b", "c")  # c shares 3, 4: holds 5 tokens too
    prefill(kv, make_seq("q", [*range(8), 77]))  # query 9, hit 8 (q shares 0, 1; takes 5)
    kv.free("q")  # 5 back to the front of the free list
    stats = kv.make_stats()
    assert stats.block_size == 4
    assert stats.num_blocks_total == 8
    assert stats.num_blocks_used == 5
    assert stats.num_blocks_cached_free == 0
    assert stats.num_blocks_free == 3
    assert stats.num_blocks_reserved == 0
    assert stats.total_sequences == 3
    assert stats.total_tokens == 10 + 5 + 5
    assert stats.average_sequence_length == 20 / 3
    # Distinct slots holding KV: 4+4+2 + 4+1 = 15 of 5 blocks * 4 = 20.
    assert stats.cache_efficiency == 15 / 20
    assert stats.block_bytes == 1000
    assert stats.total_memory_bytes == 8000
    assert stats.used_memory_bytes == 5000
    assert stats.usage == 5 / 8
    # Queries: a (10, hit 0), b (5, hit 0; no keyed block matches), q (9, hit 8).
    assert stats.prefix_queries_tokens_total == 24
    assert stats.prefix_hits_tokens_total == 8
    assert stats.cache_hit_rate == 8 / 24
    assert stats.evictions_total == 0
    assert stats.cow_copies_total == 0
    assert "preemptions_total" not in {f.name for f in fields(stats)}  # the scheduler's count
    kv.free("a")
    kv.free("b")
    kv.free("c")
    empty = kv.make_stats()
    assert (empty.num_blocks_used, empty.num_blocks_cached_free, empty.num_blocks_free) == (0, 3, 5)
    assert (empty.total_tokens, empty.average_sequence_length, empty.cache_efficiency) == (0, 0, 0)


def test_config_validation_messages_carry_numbers() -> None:
    """Bad configs raise ValueError naming the offending value."""
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        KVCacheConfig(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match=r"num_blocks must be >= 1 .*got 0"):
        KVCacheConfig(num_blocks=0)
    with pytest.raises(ValueError, match=r"num_blocks must be >= 2 .*got 1"):
        KVCacheConfig(num_blocks=1, sliding_window=8)
    with pytest.raises(ValueError, match="'fifo'"):
        KVCacheConfig(num_blocks=4, eviction_policy="fifo")
    with pytest.raises(ValueError, match="sliding_window must be >= 1 tokens, got 0"):
        KVCacheConfig(num_blocks=4, sliding_window=0)
    with pytest.raises(ValueError, match="block_bytes must be >= 0, got -1"):
        KVCacheConfig(num_blocks=4, block_bytes=-1)
    assert KVCacheManager(KVCacheConfig(num_blocks=3)).num_free_blocks == 3
