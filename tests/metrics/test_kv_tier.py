"""Prometheus figures of the KV tiers, from a KVCacheStats snapshot."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry

from cache_manager.stats import KVCacheStats, KVTierStats
from metrics.prometheus import PrometheusSink
from metrics.records import StepRecord
from scheduler.output import SchedulerStats
from tests.metrics.helpers import value


def scrape(kv: KVCacheStats) -> CollectorRegistry:
    registry = CollectorRegistry()
    sink = PrometheusSink(registry)
    stats = SchedulerStats.make_empty(kv)
    sink.on_step(StepRecord(stats, kind="idle", step_duration_s=0.0, schedule_cpu_s=0.0))
    return registry


def test_hits_blocks_and_bytes_by_tier_and_store_figures() -> None:
    """Tier 1 = all prefix hits minus tier 2's; the store's blocks, bytes, moves and errors
    by kind are exported while the tier is on."""
    kv = dataclasses.replace(
        KVCacheStats.make_empty(num_blocks=10, block_size=4, block_bytes=100),
        num_blocks_used=2,
        num_blocks_cached_free=3,
        num_blocks_free=5,
        prefix_hits_tokens_total=40,
        tier2_hit_blocks_total=6,
        tier2_hit_tokens_total=24,
        tier2_spill_blocks_total=9,
        tier2=KVTierStats(
            backend="lmdb",
            capacity_bytes=1000,
            num_blocks=7,
            num_bytes=770,
            spill_blocks_total=8,
            restore_bytes_total=600,
            restore_seconds_total=0.25,
            errors_total={"checksum": 2},
        ),
    )
    registry = scrape(kv)
    assert value(registry, "kvserve_kv_tier_hits_tokens_total", tier="1") == 16
    assert value(registry, "kvserve_kv_tier_hits_blocks_total", tier="1") == 4
    assert value(registry, "kvserve_kv_tier_hits_blocks_total", tier="2") == 6
    assert value(registry, "kvserve_kv_tier_blocks", tier="1") == 5
    assert value(registry, "kvserve_kv_tier_bytes", tier="1") == 500
    assert value(registry, "kvserve_kv_tier_blocks", tier="2") == 7
    assert value(registry, "kvserve_kv_tier_bytes", tier="2") == 770
    assert value(registry, "kvserve_kv_tier_capacity_bytes", tier="2") == 1000
    assert value(registry, "kvserve_kv_tier2_spill_planned_blocks_total") == 9
    assert value(registry, "kvserve_kv_tier2_spill_blocks_total") == 8
    assert value(registry, "kvserve_kv_tier2_restore_bytes_total") == 600
    assert value(registry, "kvserve_kv_tier2_restore_seconds_total") == 0.25
    assert value(registry, "kvserve_kv_tier2_errors_total", kind="checksum") == 2
    assert value(registry, "kvserve_kv_tier2_errors_total", kind="disk_full") == 0
    assert value(registry, "kvserve_kv_tier2_info", backend="lmdb") == 1


def test_tier_off_exports_no_store_series() -> None:
    """Without tier 2, its hits are 0 and the store's series are absent."""
    registry = scrape(KVCacheStats.make_empty(num_blocks=10))
    assert value(registry, "kvserve_kv_tier_hits_blocks_total", tier="2") == 0
    assert registry.get_sample_value("kvserve_kv_tier2_spill_blocks_total") is None
