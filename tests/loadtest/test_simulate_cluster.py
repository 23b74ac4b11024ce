"""``kvserve simulate --replicas``: N simulated engines behind cluster.routing's routers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.simulate import RunSpec, main, simulate, simulate_cluster
from loadtest.workload import Workload, arrival_offsets
from model_runner.sim import get_profile
from scheduler import SchedulerConfig

PROFILE = get_profile("h100-llama3-8b-bf16")
CONFIG = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192)
TENANTS = Path(__file__).parents[2] / "loadtest" / "workloads" / "tenants.json"

# 12 tenants with 256-token system prompts; random tenant order; 8 output tokens.
SMALL_TENANTS = {
    "name": "small-tenants",
    "seed": 3,
    "num_requests": 96,
    "prompt": {"source": "random", "len": 16},
    "shared_prefix": {"num_prefixes": 12, "len": 256, "fraction": 1.0, "order": "random"},
    "output": {"len": 8, "ignore_eos": True},
}


def small_run(**kwargs: object) -> dict[str, object]:
    workload = Workload.from_dict(SMALL_TENANTS)
    specs = workload.build(96, vocab_size=PROFILE.model.vocab_size)
    arrivals = arrival_offsets(96, 40.0, 1.0, 0)
    return simulate_cluster(
        RunSpec("continuous", CONFIG),
        PROFILE,
        specs,
        arrivals,
        **kwargs,  # type: ignore[arg-type]
    )


def test_one_replica_is_the_single_engine_simulation() -> None:
    """With one replica, every router gives exactly the single-engine report."""
    workload = Workload.from_dict(SMALL_TENANTS)
    specs = workload.build(96, vocab_size=PROFILE.model.vocab_size)
    arrivals = arrival_offsets(96, 40.0, 1.0, 0)
    run = RunSpec("continuous", CONFIG)
    single = simulate(run, PROFILE, specs, arrivals, num_blocks=200)
    for router in ("round-robin", "power-of-two", "prefix", "cost"):
        cluster = simulate_cluster(
            run, PROFILE, specs, arrivals, num_replicas=1, router=router, num_blocks=200
        )
        extra = {"replicas", "router", "router_decisions"}
        assert {k: v for k, v in cluster.items() if k not in extra | {"name"}} == {
            k: v for k, v in single.items() if k != "name"
        }
        assert sum(cluster["router_decisions"].values()) == 96


def test_prefix_routing_keeps_each_tenant_on_one_replica() -> None:
    """Two replicas of 120 blocks (7 tenants' 16-block prompts each, 12 in all): prefix routing
    misses each tenant once and hits the rest; round robin thrashes both caches."""
    prefix = small_run(num_replicas=2, router="prefix", num_blocks=120)
    round_robin = small_run(num_replicas=2, router="round-robin", num_blocks=120)
    assert prefix["router_decisions"] == {"prefix_hit": 96 - 12, "prefix_miss": 12}
    assert round_robin["router_decisions"] == {"round_robin": 96}
    assert prefix["kv"]["prefix_hit_rate"] > 1.6 * round_robin["kv"]["prefix_hit_rate"]
    assert prefix["kv"]["evictions"] < round_robin["kv"]["evictions"]
    assert prefix["num_finished"] == round_robin["num_finished"] == 96


def test_cli_prints_and_writes_one_run_per_count_and_router(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """--replicas 1,2 --router prefix,round-robin: four runs, per-replica rate and count."""
    path = tmp_path / "cluster.json"
    argv = [
        f"--workload={TENANTS}",
        "--replicas=1,2",
        "--router=prefix,round-robin",
        "--num-requests=6",
        "--rate=20",
        "--ttft-slo-ms=500",
        f"--json={path}",
    ]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    runs = [(r["replicas"], r["router"], r["num_requests"]) for r in report["runs"]]
    assert runs == [
        (1, "prefix", 6),
        (1, "round-robin", 6),
        (2, "prefix", 12),
        (2, "round-robin", 12),
    ]
    assert report["runs"][0]["slo"]["ttft_target_s"] == 0.5
    out = capsys.readouterr().out
    assert "goodput req/s" in out and "2         round-robin" in out


def test_cli_names_the_routers_on_a_typo(capsys) -> None:  # type: ignore[no-untyped-def]
    """An unknown router is a usage error that lists the choices."""
    with pytest.raises(SystemExit) as exc:
        main(["--replicas=2", "--router=prefx"])
    assert exc.value.code == 2
    assert "round-robin, power-of-two, prefix" in capsys.readouterr().err


def test_a_shared_tier_lets_any_replica_restore_what_another_spilled() -> None:
    """Round robin over 2 replicas of 120 blocks with a shared tier 2: every tenant's second
    visit lands on the other replica, which restores its 16-block system prompt instead of
    recomputing it; every request finishes and the store counts the restores."""
    alone = small_run(num_replicas=2, router="round-robin", num_blocks=120)
    shared = small_run(
        num_replicas=2,
        router="round-robin",
        num_blocks=120,
        tier_capacity_blocks=10_000,
        restore_s_per_block=1e-4,
    )
    assert alone["kv"]["tier2_hit_rate"] == 0.0
    assert shared["kv"]["tier2_hit_rate"] > 0.3
    assert shared["kv"]["prefix_hit_rate"] > 1.5 * alone["kv"]["prefix_hit_rate"]
    tier2 = shared["kv"]["tier2"]
    assert tier2["restored_blocks"] >= 12 * 16 and tier2["spilled_blocks"] > 0
    assert shared["num_finished"] == 96


def test_a_held_request_waits_for_its_read_on_the_replicas_one_reader() -> None:
    """SimStore reads in chain order up to the first block neither tier holds (a block tier 1
    holds may be missing), and a replica's reads queue on its one reader."""
    from cache_manager import TierBlock
    from loadtest.sim_engine import SimStore

    store = SimStore(capacity_blocks=2, restore_s_per_block=0.5)
    blocks = [TierBlock(bytes([i]) * 8, None, (i,), None) for i in range(4)]
    store.put(blocks[:3])  # capacity 2: block 0 (the oldest) goes
    assert store.read(blocks, [True, False, False, False]) == blocks[1:3]
    assert store.read(blocks, [False, False, False, False]) == []
    run = small_run(
        num_replicas=1, router="prefix", num_blocks=40, tier_capacity_blocks=1000,
        restore_s_per_block=0.05,
    )  # fmt: skip
    # 40 blocks hold 2 of 12 tenants: most prompts are restored, 0.8 s each, one at a time.
    assert run["kv"]["tier2_hit_rate"] > 0.5
    assert run["queue_s"]["p50"] > 0.8
