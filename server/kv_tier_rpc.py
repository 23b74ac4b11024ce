"""The KV tiers' figures in ``GetKVCacheStats`` (fields 24..27 of ``kvserve.v1.KVCacheStats``)."""

from __future__ import annotations

from typing import Any

from cache_manager.stats import KVCacheStats
from server.rpc import generation_pb2 as pb


def kv_tier_rpc_fields(kv: KVCacheStats) -> dict[str, Any]:
    """Keyword arguments of ``pb.KVCacheStats`` for the tier fields of ``kv``."""
    fields: dict[str, Any] = {
        "tier2_hit_blocks_total": kv.tier2_hit_blocks_total,
        "tier2_hit_tokens_total": kv.tier2_hit_tokens_total,
        "tier2_spill_blocks_total": kv.tier2_spill_blocks_total,
    }
    store = kv.tier2
    if store is not None:
        fields["tier2"] = pb.KVTierStats(
            backend=store.backend,
            capacity_bytes=store.capacity_bytes,
            num_blocks=store.num_blocks,
            num_bytes=store.num_bytes,
            spill_blocks_total=store.spill_blocks_total,
            spill_bytes_total=store.spill_bytes_total,
            spill_seconds_total=store.spill_seconds_total,
            restore_blocks_total=store.restore_blocks_total,
            restore_bytes_total=store.restore_bytes_total,
            restore_seconds_total=store.restore_seconds_total,
            lookups_blocks_total=store.lookups_blocks_total,
            errors_total=store.errors_total,
        )
    return fields
