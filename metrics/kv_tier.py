"""Prometheus families of the KV tiers (tier 1: the pool's prefix cache; tier 2: the disk
store of ``server.kv_tier``), read from a ``KVCacheStats`` snapshot at scrape time.

Hits are counters by tier, so a hit rate by tier is computed from them, never exported as a
gauge. The tier-2 store's series appear only while the tier is on (``kv.tier2`` set).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from cache_manager.stats import TIER_ERROR_KINDS, KVCacheStats

PREFIX = "kvserve_"
Metric = CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily

# KVCacheStats tier fields -> their metric (merged into prometheus.KV_FIELD_METRICS).
TIER_FIELD_METRICS = {
    "tier2_hit_blocks_total": 'kvserve_kv_tier_hits_blocks_total{tier="2"}',
    "tier2_hit_tokens_total": 'kvserve_kv_tier_hits_tokens_total{tier="2"}',
    "tier2_spill_blocks_total": "kvserve_kv_tier2_spill_planned_blocks_total",
    "tier2": "kvserve_kv_tier2_*",  # the store's figures: see kv_tier_families
}


def _counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> Metric:
    family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels or {}))
    family.add_metric(list((labels or {}).values()), float(value))
    return family


def kv_tier_families(kv: KVCacheStats) -> Iterator[Metric]:
    """Blocks, bytes and hits by tier; spills, restores and errors of tier 2."""
    bs = max(kv.block_size, 1)
    tier1_tokens = max(kv.prefix_hits_tokens_total - kv.tier2_hit_tokens_total, 0)
    for name, doc, t1, t2 in (
        ("kv_tier_hits_blocks_total", "Prefix-hit blocks by tier.", tier1_tokens // bs,
         kv.tier2_hit_blocks_total),
        ("kv_tier_hits_tokens_total", "Prefix-hit tokens by tier.", tier1_tokens,
         kv.tier2_hit_tokens_total),
    ):  # fmt: skip
        family = CounterMetricFamily(PREFIX + name, doc, labels=["tier"])
        family.add_metric(["1"], float(t1))
        family.add_metric(["2"], float(t2))
        yield family
    store = kv.tier2
    tier1_blocks = kv.num_blocks_used + kv.num_blocks_cached_free
    held_blocks = GaugeMetricFamily(
        PREFIX + "kv_tier_blocks", "Blocks holding KV, by tier.", labels=["tier"]
    )
    held_bytes = GaugeMetricFamily(
        PREFIX + "kv_tier_bytes", "Bytes of KV held, by tier.", labels=["tier"]
    )
    capacity = GaugeMetricFamily(
        PREFIX + "kv_tier_capacity_bytes", "Bytes a tier may hold.", labels=["tier"]
    )
    held_blocks.add_metric(["1"], float(tier1_blocks))
    held_bytes.add_metric(["1"], float(tier1_blocks * kv.block_bytes))
    capacity.add_metric(["1"], float(kv.total_memory_bytes))
    if store is not None:
        held_blocks.add_metric(["2"], float(store.num_blocks))
        held_bytes.add_metric(["2"], float(store.num_bytes))
        capacity.add_metric(["2"], float(store.capacity_bytes))
    yield held_blocks
    yield held_bytes
    yield capacity
    yield _counter(
        "kv_tier2_spill_planned_blocks_total",
        "Keyed blocks the cache manager planned to spill to tier 2 (once per key).",
        kv.tier2_spill_blocks_total,
    )
    if store is None:
        return
    info = InfoMetricFamily(PREFIX + "kv_tier2", "Tier 2's storage engine (off: not opened).")
    info.add_metric(["backend"], {"backend": store.backend})
    yield info
    for name, doc, value in (
        ("spill_blocks_total", "Blocks written to tier 2 (duplicates skipped).",
         store.spill_blocks_total),
        ("spill_bytes_total", "Entry bytes written to tier 2.", store.spill_bytes_total),
        ("spill_seconds_total", "Background writer time.", store.spill_seconds_total),
        ("restore_blocks_total", "Blocks restored from tier 2 into the pool.",
         store.restore_blocks_total),
        ("restore_bytes_total", "KV bytes restored from tier 2.", store.restore_bytes_total),
        ("restore_seconds_total", "Store reads (background) and copies into the pool.",
         store.restore_seconds_total),
        ("lookups_blocks_total", "Blocks looked up in tier 2.", store.lookups_blocks_total),
    ):  # fmt: skip
        yield _counter("kv_tier2_" + name, doc, value)
    errors = CounterMetricFamily(
        PREFIX + "kv_tier2_errors_total",
        "Tier-2 failures by kind (each a miss or a dropped spill; requests never fail).",
        labels=["kind"],
    )
    for kind in TIER_ERROR_KINDS:
        errors.add_metric([kind], float(store.errors_total.get(kind, 0)))
    yield errors


__all__ = ["TIER_FIELD_METRICS", "kv_tier_families"]
