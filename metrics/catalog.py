"""Every metric a kvserve server (or a cluster replica) exports, written once: name, kind,
labels, doc and how to read it. The Ray router's own ``kvserve_router_*`` series are
``cluster.metrics.RouterMetrics``'s.

- ``SNAPSHOT_METRICS``: read at scrape time from the latest ``SchedulerStats`` snapshot
  (``KVCacheStats`` included). ``KV_FIELD_METRICS``, which says which metric exports each
  ``KVCacheStats`` field, is derived from it: a new KV statistic is one row here.
- ``HISTOGRAMS``: the histograms the sink observes (per request, per step).
- ``EVENT_COUNTERS``: counters of events no snapshot holds (aborts, rejections, calls).
- ``ADAPTER_RESIDENT`` / ``ADAPTER_COUNTERS``: the LoRA registry's, read at scrape time
  (``metrics.prometheus.AdapterCollector``).

Names carry the ``kvserve_`` prefix at export; counters end in ``_total``. A rate such as the
prefix hit rate is computed downstream from two counters, never exported only as a gauge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)

from cache_manager.stats import TIER_ERROR_KINDS, KVCacheStats, KVTierStats
from metrics.histogram import (
    INTER_TOKEN_BUCKETS_S,
    PREDICTION_ERROR_BUCKETS,
    REQUEST_LATENCY_BUCKETS_S,
    SCHEDULER_CPU_BUCKETS_S,
    STEP_DURATION_BUCKETS_S,
    STEP_PREFILL_TOKEN_BUCKETS,
    STEP_REQUEST_BUCKETS,
    TOKEN_COUNT_BUCKETS,
    TTFT_BUCKETS_S,
)
from scheduler.lora import BASE_ADAPTER_LABEL
from scheduler.output import SchedulerStats
from scheduler.request import AbortReason, FinishReason

PREFIX = "kvserve_"
GAUGE, COUNTER, INFO = "gauge", "counter", "info"

# --- bounded label values ---
STEP_KINDS = ("prefill", "decode", "mixed")  # "idle" steps are not observed
SLO_TARGETS = ("ttft", "itl", "both")
# Priority label values of the SLO counters (a client picks its priority: bounded series).
SLO_PRIORITIES = tuple(str(p) for p in range(10))
ABORT_REASONS = (*(r.value for r in AbortReason), "overload", "error")
REJECT_REASONS = ("overload", "invalid")
# The HTTP ports and what their guard does to a connection (server.http_guard).
CONNECTION_SERVERS = ("http", "metrics")
CONNECTION_EVENTS = ("header_timeout", "body_timeout", "evicted_idle", "refused", "emfile")
# How a prefill/decode transfer ended (cluster.pd): published, or recomputed and why.
TRANSFER_OUTCOMES = ("ok", "prefill_failed", "timeout")
OTHER = "other"
MAX_RPC_SERIES = 256
# The most adapters with series of their own (beyond: "other"); the base model's requests
# are BASE_ADAPTER_LABEL's (scheduler.lora).
MAX_ADAPTER_SERIES = 64
# Model info labels always present (filled from the KV snapshot when not given).
INFO_LABELS = ("model", "dtype", "device", "block_size", "num_blocks")


@dataclass(frozen=True, slots=True)
class SnapshotMetric:
    """One metric read from the snapshot. ``read`` returns its value, or with ``label`` a
    {label value: value} mapping (an info metric: the label's text); None when the metric
    is absent from this snapshot (tier 2's store while it is off). ``kv_fields``: the
    ``KVCacheStats`` fields it exports, in the order of its label values (None: a label value
    no field holds, such as a figure derived from others)."""

    name: str
    kind: str
    doc: str
    read: Callable[[SchedulerStats], Any]
    label: str | None = None
    kv_fields: tuple[str | None, ...] = ()

    def family(self, stats: SchedulerStats) -> Metric | None:
        value = self.read(stats)
        if value is None:
            return None
        if self.kind == INFO:
            info = InfoMetricFamily(PREFIX + self.name, self.doc)
            info.add_metric([], {str(self.label): str(value)})
            return info
        family_type = GaugeMetricFamily if self.kind == GAUGE else CounterMetricFamily
        family = family_type(
            PREFIX + self.name, self.doc, labels=[self.label] if self.label else []
        )
        if self.label is None:
            family.add_metric([], float(value))
        else:
            for label_value, v in value.items():
                family.add_metric([label_value], float(v))
        return family

    def field_metrics(self) -> dict[str, str]:
        """Each of ``kv_fields`` -> the series that exports it."""
        name = PREFIX + self.name
        if not self.kv_fields:
            return {}
        if self.kind == INFO:
            return {str(self.kv_fields[0]): f"{name}_info{{{self.label}}}"}
        if self.label is None:
            return {f: name for f in self.kv_fields if f is not None}
        states = self.read(SchedulerStats.make_empty(KVCacheStats.make_empty()))
        return {
            f: f'{name}{{{self.label}="{s}"}}'
            for f, s in zip(self.kv_fields, states, strict=True)
            if f is not None
        }


def _stat(name: str, kind: str, doc: str, field: str) -> SnapshotMetric:
    return SnapshotMetric(name, kind, doc, lambda s: getattr(s, field))


def _kv(name: str, kind: str, doc: str, field: str, label: str | None = None) -> SnapshotMetric:
    """A metric exporting the ``KVCacheStats`` field ``field`` (an info metric: its text is
    the value of ``label``)."""
    return SnapshotMetric(name, kind, doc, lambda s: getattr(s.kv, field), label, (field,))


def _finished(s: SchedulerStats) -> dict[str, int]:
    finished = dict.fromkeys((f.value for f in FinishReason), 0)
    finished.update(s.num_finished_total)
    return dict(sorted(finished.items()))


def _by_adapter(counts: dict[str, int] | None) -> dict[str, int]:
    """Requests by adapter label: the base model's ("" in the snapshot) always present."""
    out = {BASE_ADAPTER_LABEL: 0}
    for name, n in (counts or {}).items():
        key = name or BASE_ADAPTER_LABEL
        if key not in out and len(out) > MAX_ADAPTER_SERIES:
            key = OTHER
        out[key] = out.get(key, 0) + n
    return out


def _tier1_hit_tokens(kv: KVCacheStats) -> int:
    """Tier 1's prefix hits: all hits minus tier 2's."""
    return max(kv.prefix_hits_tokens_total - kv.tier2_hit_tokens_total, 0)


def _by_tier(
    kv: KVCacheStats, tier1: float, tier2: Callable[[KVTierStats], float]
) -> dict[str, float]:
    """{"1": tier1, "2": tier2(the store's figures)}, "2" only while tier 2 is on."""
    values = {"1": tier1}
    if kv.tier2 is not None:
        values["2"] = tier2(kv.tier2)
    return values


def _store(name: str, doc: str, field: str) -> SnapshotMetric:
    """A counter of tier 2's store (``KVTierStats.field``), absent while the tier is off."""
    return SnapshotMetric(
        name, COUNTER, doc, lambda s: None if s.kv.tier2 is None else getattr(s.kv.tier2, field)
    )


def _store_errors(s: SchedulerStats) -> dict[str, int] | None:
    store = s.kv.tier2
    return None if store is None else {k: store.errors_total.get(k, 0) for k in TIER_ERROR_KINDS}


# KV blocks by state: label value -> KVCacheStats field.
_BLOCK_STATES = {
    "used": "num_blocks_used",
    "cached_free": "num_blocks_cached_free",
    "free": "num_blocks_free",
    "reserved": "num_blocks_reserved",
}

SNAPSHOT_METRICS: tuple[SnapshotMetric, ...] = (
    # --- the scheduler ---
    _stat("requests_running", GAUGE, "Requests in the running set (prefill or decode).",
          "num_running"),
    _stat("requests_waiting", GAUGE, "Requests in the waiting queue, preempted ones included.",
          "num_waiting"),
    _stat("requests_preempted", GAUGE, "Waiting requests that were preempted and not yet resumed.",
          "num_preempted"),
    _stat("requests_parked", GAUGE,
          "Requests not scheduled because their client stopped reading its stream.", "num_parked"),
    _stat("waiting_queue_tokens", GAUGE, "Prompt tokens still to compute across the waiting queue.",
          "num_waiting_tokens"),
    _stat("prompt_tokens_total", COUNTER, "Prompt tokens of admitted requests.",
          "num_prompt_tokens_total"),
    _stat("generation_tokens_total", COUNTER, "Output tokens produced.",
          "num_generation_tokens_total"),
    _stat("preemptions_total", COUNTER,
          "Preemptions (a running request's blocks freed, to recompute later).",
          "num_preemptions_total"),
    _stat("recomputed_tokens_total", COUNTER,
          "Computed tokens discarded by preemption (to be computed again).",
          "num_recomputed_tokens_total"),
    _stat("spec_draft_tokens_total", COUNTER,
          "Speculative draft tokens verified (n-gram drafts, --speculative ngram).",
          "num_spec_draft_tokens_total"),
    _stat("spec_accepted_tokens_total", COUNTER,
          "Speculative draft tokens accepted: output tokens that cost no step of their own.",
          "num_spec_accepted_tokens_total"),
    SnapshotMetric("lora_running_requests", GAUGE,
                   "Requests running by LoRA adapter (base: the base model).",
                   lambda s: _by_adapter(s.lora_running), "adapter"),
    SnapshotMetric("lora_waiting_requests", GAUGE,
                   "Requests waiting by LoRA adapter (base: the base model).",
                   lambda s: _by_adapter(s.lora_waiting), "adapter"),
    SnapshotMetric("requests_finished_total", COUNTER,
                   "Requests finished in the scheduler, by finish reason (stop, length, abort, "
                   "error).", _finished, "finish_reason"),
    SnapshotMetric("scheduler_batches_total", COUNTER,
                   "Batches run, by kind; a step with a prefill and a decode batch counts once "
                   "for each.",
                   lambda s: {"decode": s.num_steps_decode_total,
                              "prefill": s.num_steps_prefill_total}, "kind"),
    # --- the KV cache: one row per KVCacheStats field (the blocks by state share one) ---
    SnapshotMetric("kv_cache_blocks", GAUGE,
                   "KV blocks by state: used (referenced), cached_free (free, holding a "
                   "prefix-cache key, evictable), free (holding nothing), reserved (never handed "
                   "out).",
                   lambda s: {state: getattr(s.kv, f) for state, f in _BLOCK_STATES.items()},
                   "state", tuple(_BLOCK_STATES.values())),
    _kv("kv_cache_strategy", INFO,
        "The KV cache strategy: always, long-sequence-only, adaptive or disabled.", "kv_strategy",
        "strategy"),
    _kv("kv_cache_block_size_tokens", GAUGE, "Tokens per KV block.", "block_size"),
    _kv("kv_cache_capacity_blocks", GAUGE, "KV blocks in the pool.", "num_blocks_total"),
    _kv("kv_cache_sequences", GAUGE, "Requests holding KV blocks now.", "total_sequences"),
    _kv("kv_cache_tokens", GAUGE, "Token slots in use by the requests holding blocks.",
        "total_tokens"),
    _kv("kv_cache_block_size_bytes", GAUGE, "Bytes of KV one block occupies across all layers.",
        "block_bytes"),
    _kv("kv_cache_memory_bytes", GAUGE, "KV pool size in bytes.", "total_memory_bytes"),
    _kv("kv_cache_used_memory_bytes", GAUGE, "Bytes of the KV pool in used blocks.",
        "used_memory_bytes"),
    _kv("kv_cache_average_sequence_length_tokens", GAUGE,
        "Mean tokens per request holding blocks (0 when none).", "average_sequence_length"),
    _kv("kv_cache_efficiency_ratio", GAUGE,
        "Token slots in use / token slots allocated (0 when empty).", "cache_efficiency"),
    _kv("kv_cache_usage_ratio", GAUGE, "Used blocks / all blocks (0..1).", "usage"),
    _kv("prefix_cache_hit_ratio", GAUGE,
        "Lifetime prefix hit ratio; for a window use rate() of the hits and queries counters.",
        "cache_hit_rate"),
    _kv("prefix_cache_queries_tokens_total", COUNTER,
        "Prompt tokens looked up in the prefix cache.", "prefix_queries_tokens_total"),
    _kv("prefix_cache_hits_tokens_total", COUNTER,
        "Looked-up prompt tokens found in the prefix cache.", "prefix_hits_tokens_total"),
    _kv("kv_cache_evictions_total", COUNTER,
        "Cached-free blocks whose prefix-cache key was dropped to hand the block out.",
        "evictions_total"),
    _kv("kv_cache_cow_copies_total", COUNTER, "Copy-on-write block copies.", "cow_copies_total"),
    _kv("kv_cache_strategy_dropped_tokens_total", COUNTER,
        "KV token slots the strategy dropped after a step, to recompute them (disabled, "
        "long-sequence-only).", "strategy_dropped_tokens_total"),
    _kv("kv_cache_strategy_windowed_tokens_total", COUNTER,
        "Old KV token slots the adaptive strategy released from the longest requests under "
        "memory pressure.", "strategy_windowed_tokens_total"),
    _kv("kv_cache_sliding_blocks", GAUGE,
        "Blocks of the sliding-window layers' own pool (Gemma 3; 0 without one).",
        "sliding_blocks_total"),
    _kv("kv_cache_sliding_blocks_used", GAUGE,
        "Blocks of the sliding layers' pool referenced by some request's table.",
        "sliding_blocks_used"),
    _kv("kv_cache_sliding_blocks_released_total", COUNTER,
        "Blocks the sliding layers' tables released once they fell out of the window.",
        "sliding_blocks_released_total"),
    # --- the KV tiers: 1 is the pool's prefix cache, 2 the store (``server.kv_tier``). Hits
    # are counters by tier, so a hit rate by tier is computed from them. ---
    SnapshotMetric("kv_tier_hits_blocks_total", COUNTER, "Prefix-hit blocks by tier.",
                   lambda s: {"1": _tier1_hit_tokens(s.kv) // max(s.kv.block_size, 1),
                              "2": s.kv.tier2_hit_blocks_total},
                   "tier", (None, "tier2_hit_blocks_total")),
    SnapshotMetric("kv_tier_hits_tokens_total", COUNTER, "Prefix-hit tokens by tier.",
                   lambda s: {"1": _tier1_hit_tokens(s.kv), "2": s.kv.tier2_hit_tokens_total},
                   "tier", (None, "tier2_hit_tokens_total")),
    SnapshotMetric("kv_tier_blocks", GAUGE, "Blocks holding KV, by tier.",
                   lambda s: _by_tier(s.kv, s.kv.num_blocks_used + s.kv.num_blocks_cached_free,
                                      lambda t: t.num_blocks), "tier"),
    SnapshotMetric("kv_tier_bytes", GAUGE, "Bytes of KV held, by tier.",
                   lambda s: _by_tier(s.kv, (s.kv.num_blocks_used + s.kv.num_blocks_cached_free)
                                      * s.kv.block_bytes, lambda t: t.num_bytes), "tier"),
    SnapshotMetric("kv_tier_capacity_bytes", GAUGE, "Bytes a tier may hold.",
                   lambda s: _by_tier(s.kv, s.kv.total_memory_bytes, lambda t: t.capacity_bytes),
                   "tier"),
    _kv("kv_tier2_spill_planned_blocks_total", COUNTER,
        "Keyed blocks the cache manager planned to spill to tier 2 (once per key).",
        "tier2_spill_blocks_total"),
    SnapshotMetric("kv_tier2", INFO, "Tier 2's storage engine (off: not opened).",
                   lambda s: None if s.kv.tier2 is None else s.kv.tier2.backend, "backend",
                   ("tier2",)),
    _store("kv_tier2_spill_blocks_total", "Blocks written to tier 2 (duplicates skipped).",
           "spill_blocks_total"),
    _store("kv_tier2_spill_bytes_total", "Entry bytes written to tier 2.", "spill_bytes_total"),
    _store("kv_tier2_spill_seconds_total", "Background writer time.", "spill_seconds_total"),
    _store("kv_tier2_restore_blocks_total", "Blocks restored from tier 2 into the pool.",
           "restore_blocks_total"),
    _store("kv_tier2_restore_bytes_total", "KV bytes restored from tier 2.",
           "restore_bytes_total"),
    _store("kv_tier2_restore_seconds_total",
           "Store reads (background) and copies into the pool.", "restore_seconds_total"),
    _store("kv_tier2_lookups_blocks_total", "Blocks looked up in tier 2.",
           "lookups_blocks_total"),
    SnapshotMetric("kv_tier2_errors_total", COUNTER,
                   "Tier-2 failures by kind (each a miss or a dropped spill; requests never "
                   "fail).", _store_errors, "kind"),
)  # fmt: skip

# Every KVCacheStats field -> the series that exports it (an info metric: ``name{label}``).
KV_FIELD_METRICS: dict[str, str] = {
    field: series for m in SNAPSHOT_METRICS for field, series in m.field_metrics().items()
}


def kv_field_metrics() -> dict[str, str]:
    """KVCacheStats field -> exporting metric; raises if a field has no metric (tests use it)."""
    missing = [f.name for f in fields(KVCacheStats) if f.name not in KV_FIELD_METRICS]
    if missing:
        raise RuntimeError(f"KVCacheStats fields without a metric: {missing}")
    return dict(KV_FIELD_METRICS)


@dataclass(frozen=True, slots=True)
class HistogramSpec:
    """A histogram the sink observes; ``key`` is how the sink names it."""

    key: str
    name: str
    doc: str
    buckets: tuple[float, ...]


HISTOGRAMS: tuple[HistogramSpec, ...] = (
    # Per request, observed once when it ends.
    HistogramSpec("ttft", "request_time_to_first_token_seconds", "Arrival to first output token.",
                  TTFT_BUCKETS_S),
    HistogramSpec("itl", "request_inter_token_latency_seconds",
                  "Gap between consecutive output tokens (one observation per gap).",
                  INTER_TOKEN_BUCKETS_S),
    HistogramSpec("tpot", "request_time_per_output_token_seconds",
                  "Per request: (finished - first token) / (output tokens - 1).",
                  INTER_TOKEN_BUCKETS_S),
    HistogramSpec("e2e", "request_e2e_latency_seconds", "Arrival to finish (any finish reason).",
                  REQUEST_LATENCY_BUCKETS_S),
    HistogramSpec("queue", "request_queue_time_seconds", "Arrival to first scheduled.",
                  REQUEST_LATENCY_BUCKETS_S),
    HistogramSpec("prefill", "request_prefill_time_seconds", "First scheduled to first token.",
                  REQUEST_LATENCY_BUCKETS_S),
    HistogramSpec("decode", "request_decode_time_seconds", "First output token to finish.",
                  REQUEST_LATENCY_BUCKETS_S),
    HistogramSpec("prompt_len", "request_prompt_tokens", "Prompt length of finished requests.",
                  TOKEN_COUNT_BUCKETS),
    HistogramSpec("gen_len", "request_generation_tokens", "Output tokens of finished requests.",
                  TOKEN_COUNT_BUCKETS),
    # Per step.
    HistogramSpec("step_prefill_tokens", "step_prefill_tokens", "Prefill tokens per step.",
                  STEP_PREFILL_TOKEN_BUCKETS),
    HistogramSpec("step_prefill_reqs", "step_prefill_requests",
                  "Requests in the prefill batch per step.", STEP_REQUEST_BUCKETS),
    HistogramSpec("step_decode_reqs", "step_decode_requests",
                  "Requests in the decode batch per step.", STEP_REQUEST_BUCKETS),
    HistogramSpec("step_sched_cpu", "step_scheduler_cpu_seconds",
                  "CPU time of schedule() + update() per step.", SCHEDULER_CPU_BUCKETS_S),
    # The step-cost model (the slo policy): predicted and measured iterations.
    HistogramSpec("step_predicted", "step_predicted_seconds",
                  "The step-cost model's prediction of each iteration (slo policy).",
                  STEP_DURATION_BUCKETS_S),
    HistogramSpec("step_actual", "step_iteration_seconds",
                  "Measured iteration (schedule to processed outputs) of the predicted steps.",
                  STEP_DURATION_BUCKETS_S),
    HistogramSpec("step_error", "step_prediction_error_ratio",
                  "|predicted - measured| / measured iteration time, per step (slo policy).",
                  PREDICTION_ERROR_BUCKETS),
    # Prefill / decode split (cluster.pd): a decode replica's wait for a prefill replica.
    HistogramSpec("kv_transfer", "kv_transfer_seconds",
                  "Prefill / decode split: a decode replica's wait for a prefill replica to "
                  "compute a prompt's KV and publish it to the shared store (every outcome).",
                  REQUEST_LATENCY_BUCKETS_S),
    # Structured outputs.
    HistogramSpec("step_constraint_mask", "step_constraint_mask_seconds",
                  "Time computing the token masks of constrained rows, per step that had any "
                  "(on the torch runner it overlaps the forward pass).", SCHEDULER_CPU_BUCKETS_S),
)  # fmt: skip
# The one labelled histogram: by STEP_KINDS.
STEP_DURATION = HistogramSpec(
    "step_duration",
    "step_duration_seconds",
    "Wall time of runner.execute per step, by batch kind (prefill, decode, mixed).",
    STEP_DURATION_BUCKETS_S,
)

# Counters of events: name -> (labels, doc). The sink holds the counts.
EVENT_COUNTERS: Mapping[str, tuple[tuple[str, ...], str]] = {
    "slo_requests_total": (
        ("priority",),
        "Requests judged against their latency targets (all but client cancels and Abort "
        "calls), by priority.",
    ),
    "slo_attained_total": (
        ("priority", "target"),
        "Judged requests that met their targets, by priority and target: ttft (first token in "
        "time), itl (time per output token in time), both (goodput).",
    ),
    "request_aborts_total": (
        ("reason",),
        "Requests (each of the n samples counts) that ended without completing, by reason "
        "(client_cancel, deadline, abort_call, shutdown, stalled, error, overload).",
    ),
    "requests_rejected_total": (
        ("reason",),
        "Requests refused before reaching the scheduler, by reason (overload, invalid).",
    ),
    "rpcs_total": (
        ("method", "code"),
        "Finished calls (gRPC and HTTP) by method and status code name.",
    ),
    "connection_events_total": (
        ("server", "event"),
        "HTTP connections the server closed or refused, and accepts that failed, by port "
        "(http, metrics) and event: header_timeout / body_timeout (too slow), evicted_idle "
        "(closed at the connection cap, or to free descriptors), refused (at the cap, none "
        "idle: 503), emfile (accept() out of file descriptors; retried after 1 s).",
    ),
    "metrics_sink_errors_total": (
        (),
        "Exceptions swallowed by the metrics sink (a bug: see the server log).",
    ),
    "constrained_requests_total": (
        (),
        "Finished requests (each of the n samples counts) that carried a structured-output "
        "constraint (JSON schema, regex, choice, grammar, tool call).",
    ),
    "constraint_compiles_total": (
        (),
        "Structured-output constraints compiled (compile-cache misses).",
    ),
    "constraint_cache_hits_total": (
        (),
        "Constraints found in the compile cache (a request or check that compiled nothing).",
    ),
    "engine_failed_steps_total": (
        (),
        "Model steps that raised; each failed the requests in it (--max-step-failures).",
    ),
    "lora_requests_total": (
        ("adapter",),
        "Finished requests (each of the n samples counts) by LoRA adapter (base: the base model).",
    ),
    "lora_prompt_tokens_total": (
        ("adapter",),
        "Prompt tokens of finished requests by LoRA adapter (base: the base model).",
    ),
    "lora_generation_tokens_total": (
        ("adapter",),
        "Output tokens of finished requests by LoRA adapter (base: the base model).",
    ),
    "kv_transfers_total": (
        ("outcome",),
        "Prefill / decode split, on a decode replica: prompts handed to a prefill replica, by "
        "outcome: ok (its KV is in the shared store; read back as a tier-2 hit), "
        "prefill_failed or timeout (recomputed here; the request goes on).",
    ),
    "kv_transfer_blocks_total": (
        (),
        "Prefill / decode split: KV blocks prefill replicas published for this replica.",
    ),
    "kv_transfer_bytes_total": (
        (),
        "Prefill / decode split: bytes of those blocks.",
    ),
}
# The LoRA registry's (``model_runner.base.AdapterSource.counts``), when the server has one.
ADAPTER_RESIDENT = ("lora_adapters_resident", "LoRA adapters laid out in memory now.")
ADAPTER_COUNTERS = {
    "lora_adapter_loads_total": (
        "loads_total",
        "LoRA adapters laid out in memory (first loads, and reads after an eviction).",
    ),
    "lora_adapter_evictions_total": (
        "evictions_total",
        "LoRA adapters whose weights were dropped to stay within --max-cpu-loras.",
    ),
}
