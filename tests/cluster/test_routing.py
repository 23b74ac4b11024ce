"""cluster.routing: exact decisions of each router, the prefix index and the load guard."""

from __future__ import annotations

import random

import pytest

from cache_manager import prefix_block_keys
from cluster.routing import (
    Decision,
    PowerOfTwoRouter,
    PrefixIndex,
    PrefixRouter,
    ReplicaLoad,
    RoundRobinRouter,
    make_router,
    routing_keys,
)


def loads(*pairs: tuple[str, int]) -> list[ReplicaLoad]:
    return [ReplicaLoad(rid, n) for rid, n in pairs]


def test_routing_keys_are_the_cache_keys_of_the_blocks_before_the_last_token() -> None:
    """Keys cover full blocks of prompt[:-1] (a hit never covers the last token), 64 bits."""
    prompt = list(range(9))  # 8 tokens before the last: exactly 2 blocks of 4
    full = prefix_block_keys(prompt[:-1], 4, None)
    assert routing_keys(prompt, 4, None) == [int.from_bytes(k[:8], "little") for k in full]
    assert len(routing_keys(list(range(8)), 4, None)) == 1  # 7 tokens before the last
    assert routing_keys(prompt, 4, "a") != routing_keys(prompt, 4, "b")


def test_round_robin_cycles_in_replica_id_order() -> None:
    """Round robin visits replicas sorted by id, whatever order they are listed in."""
    router = RoundRobinRouter()
    replicas = loads(("b", 0), ("a", 5))
    picks = [router.choose(replicas, []).replica_id for _ in range(4)]
    assert picks == ["a", "b", "a", "b"]


def test_power_of_two_picks_the_less_loaded_of_the_two_drawn() -> None:
    """With two replicas both are drawn, so the less loaded one always wins."""
    router = PowerOfTwoRouter(random.Random(0))
    for _ in range(10):
        assert router.choose(loads(("a", 3), ("b", 1)), []) == Decision("b", "power_of_two", 0)


def test_prefix_router_follows_the_longest_held_prefix() -> None:
    """A request goes where most of its leading keys are; misses go to the least loaded."""
    index = PrefixIndex(capacity_blocks=16)
    router = PrefixRouter(index)
    replicas = loads(("a", 0), ("b", 0))
    assert router.choose(replicas, [1, 2, 3]) == Decision("a", "prefix_miss", 0)
    # "a" now holds 1, 2, 3; a miss ties on load, so it goes to the replica holding fewer keys.
    assert router.choose(replicas, [7, 8]) == Decision("b", "prefix_miss", 0)
    assert router.choose(replicas, [1, 2, 9]) == Decision("a", "prefix_hit", 2)
    assert router.choose(replicas, [7, 8, 1]) == Decision("b", "prefix_hit", 2)
    # The chain stops at the first miss: "a" holds 2 but not 5 at position 0.
    assert index.num_prefix_blocks("a", [5, 2]) == 0


def test_prefix_router_prefers_a_longer_hit_over_a_lower_load() -> None:
    """Within the balance threshold, hit length beats load; equal hits go to lower load."""
    index = PrefixIndex(capacity_blocks=16)
    index.add("a", [1, 2])
    index.add("b", [1])
    router = PrefixRouter(index, imbalance_abs=8)
    assert router.choose(loads(("a", 5), ("b", 0)), [1, 2]).replica_id == "a"
    index.add("b", [2])
    assert router.choose(loads(("a", 5), ("b", 0)), [1, 2]) == Decision("b", "prefix_hit", 2)


def test_load_guard_falls_back_to_power_of_two_past_the_threshold() -> None:
    """busiest - idlest > abs and busiest > rel x idlest: the less loaded of two random."""
    index = PrefixIndex(capacity_blocks=16)
    index.add("a", [1, 2, 3])
    router = PrefixRouter(index, imbalance_abs=4, imbalance_rel=1.5, rng=random.Random(1))
    assert not router.is_imbalanced(loads(("a", 4), ("b", 0)))  # 4 is not > 4
    assert not router.is_imbalanced(loads(("a", 20), ("b", 14)))  # 20 is not > 1.5 x 14
    assert router.choose(loads(("a", 4), ("b", 0)), [1, 2, 3]).reason == "prefix_hit"
    decision = router.choose(loads(("a", 5), ("b", 0)), [1, 2, 3])
    assert decision == Decision("b", "load_guard", 0)
    assert index.num_prefix_blocks("b", [1, 2, 3]) == 3  # credited with the keys it got


def test_prefix_index_is_a_bounded_lru_per_replica() -> None:
    """Past capacity the least recently added keys go; drop/retain forget replicas."""
    index = PrefixIndex(capacity_blocks=3)
    index.add("a", [1, 2, 3])
    index.add("a", [1, 4])  # 1 is refreshed, 2 is the oldest and goes
    assert index.num_prefix_blocks("a", [1]) == 1
    assert index.num_prefix_blocks("a", [2]) == 0
    assert index.num_keys("a") == 3
    index.add("b", [9])
    index.retain(["b"])
    assert index.num_keys("a") == 0
    index.drop("b")
    assert index.num_keys("b") == 0


def test_make_router_names_the_choices() -> None:
    """An unknown --router value says which ones exist."""
    assert isinstance(make_router("prefix"), PrefixRouter)
    with pytest.raises(ValueError, match="round-robin, power-of-two, prefix"):
        make_router("random")
    with pytest.raises(ValueError, match="imbalance_rel"):
        PrefixRouter(PrefixIndex(4), imbalance_rel=0.5)
