"""cluster.routing: exact decisions of each router, the prefix index and the load guard."""

from __future__ import annotations

import random

import pytest

from cache_manager import prefix_block_keys
from cluster.routing import (
    DEFAULT_GUARD,
    CostModelPrice,
    CostScore,
    Decision,
    GuardedRouter,
    KeyLRU,
    LoadGuard,
    PowerOfTwoRouter,
    PrefixIndex,
    PrefixScore,
    ReplicaLoad,
    RoundRobinRouter,
    TokenPrice,
    make_router,
    routing_keys,
)
from scheduler.cost_model import StepCostModel, StepShape


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
    router = GuardedRouter(PrefixScore(index))
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
    router = GuardedRouter(PrefixScore(index), LoadGuard(imbalance_abs=8))
    assert router.choose(loads(("a", 5), ("b", 0)), [1, 2]).replica_id == "a"
    index.add("b", [2])
    assert router.choose(loads(("a", 5), ("b", 0)), [1, 2]) == Decision("b", "prefix_hit", 2)


def test_load_guard_falls_back_to_power_of_two_past_the_threshold() -> None:
    """busiest - idlest > abs and busiest > rel x idlest: the less loaded of two random."""
    index = PrefixIndex(capacity_blocks=16)
    index.add("a", [1, 2, 3])
    guard = LoadGuard(imbalance_abs=4, imbalance_rel=1.5)
    router = GuardedRouter(PrefixScore(index), guard, random.Random(1))
    assert not guard.tripped(loads(("a", 4), ("b", 0)))  # 4 is not > 4
    assert not guard.tripped(loads(("a", 20), ("b", 14)))  # 20 is not > 1.5 x 14
    assert router.choose(loads(("a", 4), ("b", 0)), [1, 2, 3]).reason == "prefix_hit"
    decision = router.choose(loads(("a", 5), ("b", 0)), [1, 2, 3])
    assert decision == Decision("b", "load_guard", 0)
    assert index.num_prefix_blocks("b", [1, 2, 3]) == 3  # credited with the keys it got


def test_prefix_index_is_a_bounded_lru_per_replica() -> None:
    """Past capacity the least recently added keys go; a router's retain and forget drop
    replicas from its index, and learn adds a replica's reported keys."""
    index = PrefixIndex(capacity_blocks=3)
    index.add("a", [1, 2, 3])
    index.add("a", [1, 4])  # 1 is refreshed, 2 is the oldest and goes
    assert index.num_prefix_blocks("a", [1]) == 1
    assert index.num_prefix_blocks("a", [2]) == 0
    assert index.num_keys("a") == 3
    router = GuardedRouter(PrefixScore(index))
    router.learn("b", [9])
    assert index.num_prefix_blocks("b", [9]) == 1
    router.retain(["b"])
    assert index.num_keys("a") == 0 and index.replica_ids() == ["b"]
    router.forget("b")
    assert index.num_keys("b") == 0


def test_a_replica_sized_to_its_pool_sends_the_prefixes_it_evicted_elsewhere() -> None:
    """A replica that reported a pool of 6 blocks and was sent three 3-block prefixes holds
    the latest two: the oldest goes to the other replica (a miss there as on "a", whose LRU
    dropped it), instead of following keys "a" evicted long ago and thrashing it."""
    router = GuardedRouter(PrefixScore(PrefixIndex(capacity_blocks=4096)))
    tenants = [[10 * t + 1, 10 * t + 2, 10 * t + 3] for t in range(3)]
    router.resize("a", 6)
    for keys in tenants:  # "b" not listed yet (Ray's replica set lagged): all go to "a"
        assert router.choose(loads(("a", 0)), keys).replica_id == "a"
    index = router.score.index
    assert [index.num_prefix_blocks("a", k) for k in tenants] == [0, 3, 3]
    both = loads(("a", 0), ("b", 0))
    assert router.choose(both, tenants[0]) == Decision("b", "prefix_miss", 0)
    assert router.choose(both, tenants[2]) == Decision("a", "prefix_hit", 3)
    # A smaller report trims at once; a replica first sized, then sent keys, gets its size.
    router.resize("a", 2)
    assert index.num_keys("a") == 2
    router.resize("c", 1)
    router.learn("c", [7, 8])
    assert index.num_keys("c") == 1 and index.num_prefix_blocks("c", [8]) == 1
    router.forget("c")
    router.learn("c", [7, 8])  # a restarted replica: the default size until it reports
    assert index.num_keys("c") == 2
    with pytest.raises(ValueError, match="capacity_blocks must be >= 1"):
        router.resize("a", 0)


def test_make_router_names_the_choices() -> None:
    """An unknown --router value says which ones exist."""
    prefix, cost = make_router("prefix"), make_router("cost")
    assert isinstance(prefix, GuardedRouter) and isinstance(prefix.score, PrefixScore)
    assert isinstance(cost, GuardedRouter) and isinstance(cost.score, CostScore)
    with pytest.raises(ValueError, match="round-robin, power-of-two, prefix, cost"):
        make_router("random")
    with pytest.raises(ValueError, match="imbalance_rel"):
        LoadGuard(imbalance_rel=0.5)


def test_load_only_routers_ignore_every_report() -> None:
    """Round robin and power of two take every hook and change nothing: the caller never
    asks which router it holds."""
    for router in (RoundRobinRouter(), PowerOfTwoRouter(random.Random(0))):
        router.learn("a", [1, 2])
        router.learn(None, [1, 2])
        router.retain(["a"])
        router.resize("a", 1)
        router.reprice([{"cost_model_s": [0.01, 1e-3, 0, 0, 0, 0]}])
        router.on_finished("a", [1, 2])
        router.forget("a")
        assert router.choose(loads(("a", 0)), [1, 2]).replica_id == "a"


# The cost router: 4-token blocks, 1 s per prefilled token, 0.25 s per restored block (so a
# restored block costs 1/16 of recomputing it), replicas "a" and "b" idle unless said.
def cost_router(
    shared: bool = True, guard: LoadGuard = DEFAULT_GUARD, rng: random.Random | None = None
) -> tuple[GuardedRouter, CostScore]:
    """The router and its score."""
    score = CostScore(
        PrefixIndex(64),
        TokenPrice(1.0),
        block_size=4,
        shared=KeyLRU(64) if shared else None,
        restore_s_per_block=0.25,
    )
    return GuardedRouter(score, guard, rng), score


IDLE = loads(("a", 0), ("b", 0))


def test_cost_router_prices_ram_then_the_shared_tier_then_recomputation() -> None:
    """A 17-token prompt (4 keys): "a" holds 2 blocks in RAM and the shared tier the first
    3, so "a" restores 1 block and prefills 5 tokens (5.25 s) while "b" restores 3 and
    prefills 5 (5.75 s): "a" wins; its estimate names each tier's blocks."""
    router, score = cost_router()
    score.index.add("a", [1, 2])
    router.learn(None, [1, 2, 3])
    a = score.estimate("a", [1, 2, 3, 4], 17, now_s=0.0)
    b = score.estimate("b", [1, 2, 3, 4], 17, now_s=0.0)
    assert (a.num_ram_blocks, a.num_shared_blocks, a.work_s) == (2, 1, 5.25)
    assert (b.num_ram_blocks, b.num_shared_blocks, b.work_s) == (0, 3, 5.75)
    decision = router.choose(IDLE, [1, 2, 3, 4], num_prompt_tokens=17, now_s=0.0)
    assert decision == Decision("a", "prefix_hit", 2, 1)


def test_cost_router_restores_elsewhere_when_the_holder_has_a_backlog() -> None:
    """Two requests for one 17-token prompt whose 4 blocks are in the shared tier: the first
    goes to "a" (a tie, by id) and costs 2 s there (4 restores of 0.25 s, 1 token). At the same
    instant the second would cost 2 s of backlog + 1 s on "a" (its RAM holds the prefix now)
    and 2 s on "b", which restores it: "b". The prefix router would send both to "a"."""
    router, score = cost_router()
    router.learn(None, [1, 2, 3, 4])
    keys = [1, 2, 3, 4]
    first = router.choose(IDLE, keys, num_prompt_tokens=17, now_s=0.0)
    assert first == Decision("a", "shared_hit", 0, 4)
    assert score.backlog_s("a", now_s=0.0) == 2.0
    second = router.choose(IDLE, keys, num_prompt_tokens=17, now_s=0.0)
    assert second == Decision("b", "shared_hit", 0, 4)


def test_cost_router_stays_with_ram_while_the_backlog_costs_less_than_recomputing() -> None:
    """Without a shared tier, "b" must recompute the 17-token prompt (17 s): "a" holds its
    prefix in RAM (1 s of work), so requests keep going to "a" until backlog + 1 s reaches
    17 s (a tie goes to the replica holding fewer keys); the backlog runs down with time."""
    router, score = cost_router(shared=False)
    score.index.add("a", [1, 2, 3, 4])
    keys = [1, 2, 3, 4]
    picks = [router.choose(IDLE, keys, num_prompt_tokens=17, now_s=0.0).replica_id]
    while picks[-1] == "a":
        picks.append(router.choose(IDLE, keys, num_prompt_tokens=17, now_s=0.0).replica_id)
    assert picks == ["a"] * 16 + ["b"]
    assert score.backlog_s("a", now_s=10.0) == 6.0
    assert score.backlog_s("a", now_s=20.0) == 0.0


def test_cost_router_keeps_the_load_guard() -> None:
    """Past the imbalance threshold the cost router picks by power of two choices, and still
    credits the chosen replica with the keys."""
    router, score = cost_router(guard=LoadGuard(4, 1.5), rng=random.Random(1))
    score.index.add("a", [1, 2])
    decision = router.choose(loads(("a", 5), ("b", 0)), [1, 2], num_prompt_tokens=9)
    assert decision == Decision("b", "load_guard", 0, 0)
    assert score.index.num_prefix_blocks("b", [1, 2]) == 2


def test_cost_router_learns_the_shared_tier_from_finished_requests_only_with_a_tier() -> None:
    """A request that ended has its blocks spilled: its keys become shared-tier hits for every
    replica; replicas that share no tier learn nothing from it."""
    router, score = cost_router()
    router.on_finished("a", [5, 6])
    assert score.estimate("b", [5, 6, 7], 13, now_s=0.0).num_shared_blocks == 2
    alone, alone_score = cost_router(shared=False)
    alone.on_finished("a", [5, 6])
    assert alone_score.estimate("b", [5, 6, 7], 13, now_s=0.0).num_shared_blocks == 0
    alone.forget("a")
    assert alone_score.index.num_keys("a") == 0


def test_cost_model_price_is_one_predicted_step_per_chunk() -> None:
    """600 new tokens after 100 cached, chunks of 256: the predictions of chunks (256, 100),
    (256, 356) and (88, 612), summed."""
    model = StepCostModel([0.01, 1e-4, 0.0, 1e-8, 0.0, 0.002])
    price = CostModelPrice(model, chunk_tokens=256)
    want = sum(
        model.predict(StepShape.of([(n, start)], []))
        for n, start in ((256, 100), (256, 356), (88, 612))
    )
    assert price.prefill_s(600, 100) == pytest.approx(want)
    assert price.prefill_s(0, 100) == 0.0
