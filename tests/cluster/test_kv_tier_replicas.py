"""Tier 2 shared by the replicas of `kvserve cluster serve` on one host (Ray, fake runner)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kv_store import open_store
from server.client import KVServeClient
from tests.cluster.helpers import (
    LocalCluster,
    replica_targets,
    scrape,
    start_local_cluster,
    total,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from start_local_cluster()


async def test_a_prefix_prefilled_by_one_replica_is_restored_by_the_other(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Round robin sends the same prompt to replica 0, then to replica 1: the second one
    restores its 4 full blocks from the shared store (a tier-2 hit), it does not recompute."""
    engine = {"runner": "fake", "block_size": 16, "kv_disk_dir": str(tmp_path)}
    metrics_port = cluster.deploy("kv-tier", engine=engine, num_replicas=2, router="round-robin")
    urls = replica_targets(metrics_port, 2)
    prompt = "x" * 70  # BOS + 70 bytes: 4 full blocks of 16 before the last token
    async with KVServeClient(cluster.address) as client:
        async for _ in client.generate(prompt, request_id="first", max_tokens=2):
            pass

        store = open_store("lmdb", str(tmp_path / "lmdb"), capacity_bytes=1 << 30)
        await wait_for(lambda: store.usage()[0] >= 4)  # replica 0 wrote its blocks
        store.close()
        async for _ in client.generate(prompt, request_id="second", max_tokens=2):
            pass
    samples = [scrape(u) for u in urls]
    hits = [total([s], "kvserve_kv_tier_hits_blocks_total", tier="2") for s in samples]
    assert sorted(hits) == [0, 4]
    assert total(samples, "kvserve_kv_tier_hits_blocks_total", tier="1") == 0
