"""Prefill and decode on separate replicas (cluster.pd): a local Ray cluster in this process,
fake runners sharing one KV tier 2 on disk; tokens, transfers, and the faults that must cost
no request."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server.client import KVServeClient
from tests.cluster.helpers import (
    LocalCluster,
    replica_actor,
    replica_id_of,
    replica_targets,
    scrape,
    start_local_cluster,
    total,
    wait_for,
)
from tests.cluster.test_ray_serve import fake_tokens

pytestmark = pytest.mark.slow

# BOS + 102 bytes = 103 tokens: 6 full blocks of 16 before the last token, 7 tokens after.
PROMPTS = [f"document {i}: " + "abcdefghij" * 9 for i in range(3)]
NUM_BLOCKS = 6
TAIL = 103 - NUM_BLOCKS * 16
Samples = dict[str, list[tuple[dict[str, str], float]]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from start_local_cluster()


def engine(tmp_path: Path, **more: Any) -> dict[str, Any]:
    return {"runner": "fake", "kv_disk_dir": str(tmp_path), "block_size": 16, **more}


async def generate(cluster: LocalCluster, prompt: str, request_id: str, n: int) -> list[int]:
    async with KVServeClient(cluster.address) as client:
        return [
            t
            async for r in client.generate(prompt, request_id=request_id, max_tokens=n)
            for t in r.token_ids
        ]


def by_role(metrics_port: int, num_replicas: int) -> dict[str, list[Samples]]:
    """Every replica's scrape, grouped by its role label."""
    out: dict[str, list[Samples]] = {}
    for url in replica_targets(metrics_port, num_replicas):
        samples = scrape(url)
        (labels, _), *_ = samples["kvserve_model_info"]
        out.setdefault(labels["role"], []).append(samples)
    return out


async def test_a_prefill_replica_publishes_and_the_decode_replica_reads_it(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """1 prefill + 1 decode replica: each prompt is computed on the prefill replica, its 6
    blocks published to the shared store and restored by the decode replica (tier-2 hits),
    which prefills only the 7 tokens after them itself; the tokens are the fake runner's
    exact ones, and each replica's series carry its role."""
    metrics_port = cluster.deploy(
        "pd-ok",
        engine=engine(tmp_path),
        num_replicas=1,
        num_prefill_replicas=1,
        transfer_min_tokens=16,
    )
    for i, prompt in enumerate(PROMPTS):
        assert await generate(cluster, prompt, f"pd-{i}", 5) == fake_tokens(f"pd-{i}", 5)
    roles = by_role(metrics_port, 2)
    (decode,), (prefill,) = roles["decode"], roles["prefill"]
    assert total([decode], "kvserve_kv_transfers_total", outcome="ok") == 3
    assert total([decode], "kvserve_kv_transfer_blocks_total") == 3 * NUM_BLOCKS
    assert total([decode], "kvserve_kv_tier_hits_blocks_total", tier="2") == 3 * NUM_BLOCKS
    # The decode replica computed each prompt's tail (and its decodes); the prefill replica
    # the prompts (one 1-token job each).
    assert total([decode], "kvserve_step_prefill_tokens_sum") == 3 * TAIL
    assert total([prefill], "kvserve_step_prefill_tokens_sum") == sum(len(p) + 1 for p in PROMPTS)
    assert total([prefill], "kvserve_requests_finished_total", finish_reason="length") == 3


async def test_a_prefill_replica_killed_mid_transfer_costs_no_request(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The prefill replica computes a prompt in 7 chunks of 16 tokens, 3 s a step: killed
    after its first chunk, the decode replica's transfer fails (prefill_failed), it computes
    the prompt itself and the request gets its exact tokens."""
    import ray
    from ray import serve

    from cluster.app import PREFILL_DEPLOYMENT

    metrics_port = cluster.deploy(
        "pd-kill",
        engine=engine(tmp_path),
        num_replicas=1,
        num_prefill_replicas=1,
        transfer_min_tokens=16,
        prefill_engine={
            "fake_step_sleep_s": 3.0,
            "max_num_seqs": 16,
            "max_num_batched_tokens": 16,
            "long_prefill_token_threshold": 16,
        },
        router="round-robin",  # the cost router's replicas calibrate: 3 s steps each
    )
    decode_url = replica_targets(metrics_port, 1)[0]
    prefill = serve.get_deployment_handle(PREFILL_DEPLOYMENT, app_name="pd-kill")
    stats = await prefill.options(method_name="record_routing_stats").remote()
    prefill_url = stats["metrics_url"]  # the one prefill replica's
    task = asyncio.create_task(generate(cluster, PROMPTS[0], "kill-0", 4))
    await wait_for(lambda: total([scrape(prefill_url)], "kvserve_requests_running") == 1)
    ray.kill(replica_actor(replica_id_of(scrape(prefill_url))), no_restart=True)
    assert await task == fake_tokens("kill-0", 4)
    decode = scrape(decode_url)
    assert total([decode], "kvserve_kv_transfers_total", outcome="prefill_failed") == 1
    assert total([decode], "kvserve_kv_tier_hits_blocks_total", tier="2") == 0


async def test_a_corrupt_block_and_a_full_store_cost_no_request(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A block corrupted in the store after it was published is a checksum miss on the
    decode replica that reads it, recomputed there; a full store (a byte bound that keeps no
    entry) drops every published block, and they are recomputed too. Every request gets its
    exact tokens."""
    # Round robin over 2 decode replicas: the second request for the prompt lands on the
    # replica that does not hold it in RAM, and reads the store.
    corrupt_dir = tmp_path / "corrupt"
    metrics_port = cluster.deploy(
        "pd-corrupt",
        engine=engine(corrupt_dir, kv_disk_store="file"),
        num_replicas=2,
        num_prefill_replicas=1,
        transfer_min_tokens=16,
        router="round-robin",
    )
    assert await generate(cluster, PROMPTS[0], "c-0", 4) == fake_tokens("c-0", 4)
    entries = [p for p in (corrupt_dir / "file").rglob("*") if p.is_file() and p.stat().st_size]
    assert len(entries) >= NUM_BLOCKS
    for path in entries:  # flip a byte in the middle of every entry
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    # Round robin sends the next request to the other decode replica once the router knows
    # both; a loaded machine can start it with one known, so a request may hit RAM again:
    # up to 4 more requests, each exact, until a decode replica has read a corrupt block.
    checksum_misses = 0.0
    for i in range(1, 5):
        assert await generate(cluster, PROMPTS[0], f"c-{i}", 4) == fake_tokens(f"c-{i}", 4)
        roles = by_role(metrics_port, 3)
        checksum_misses = total(roles["decode"], "kvserve_kv_tier2_errors_total", kind="checksum")
        if checksum_misses >= 1:
            break
    assert checksum_misses >= 1
    full_dir = tmp_path / "full"
    metrics_port = cluster.deploy(
        "pd-full",
        engine=engine(full_dir, kv_disk_bytes="1"),
        num_replicas=1,
        num_prefill_replicas=1,
        transfer_min_tokens=16,
    )
    for i, prompt in enumerate(PROMPTS):
        assert await generate(cluster, prompt, f"f-{i}", 4) == fake_tokens(f"f-{i}", 4)
    (decode,) = by_role(metrics_port, 2)["decode"]
    assert total([decode], "kvserve_requests_finished_total", finish_reason="length") == 3
    assert total([decode], "kvserve_kv_transfers_total", outcome="ok") == 3
    assert total([decode], "kvserve_kv_tier_hits_blocks_total", tier="2") == 0
    assert total([decode], "kvserve_step_prefill_tokens_sum") == sum(len(p) + 1 for p in PROMPTS)
