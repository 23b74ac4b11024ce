"""Prometheus export: a ``MetricsSink`` that is also the registry's custom Collector.

The engine hands the sink plain records (``metrics.records``) and never touches
prometheus-client per token:

- ``on_step`` stores the step's ``SchedulerStats`` snapshot (one reference assignment) and
  observes five per-step histograms: O(1), one lock.
- ``on_request_done`` observes the per-request latency and length histograms once, when the
  request ends (any terminal path).
- At scrape time ``collect()`` reads the LATEST snapshot and exports its gauges and its
  cumulative counters (``*_total`` fields) as counters; a rate such as the prefix hit rate is
  computed downstream from two counters, never exported only as a gauge.

The histograms are kept here (bucket counts under one lock) rather than as prometheus-client
``Histogram`` objects: one lock per step instead of one per observation, a request's
inter-token gaps are observed in one call, and the exposition carries no ``_created`` series.
Label values are bounded: no request ids; abort/rejection reasons outside the known set are
reported as ``other`` and the (method, code) pairs of ``kvserve_rpcs_total`` are capped.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import fields
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from cache_manager.stats import KVCacheStats
from metrics.kv_tier import TIER_FIELD_METRICS, kv_tier_families
from metrics.records import RequestRecord, StepRecord
from scheduler.output import SchedulerStats
from scheduler.request import AbortReason, FinishReason
from scheduler.slo import attained

logger = logging.getLogger(__name__)

PREFIX = "kvserve_"

# --- histogram buckets (upper bounds). They span a GPU (ms steps) and a CPU (s steps). ---
TTFT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip
STEP_DURATION_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
SCHEDULER_CPU_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1,
)  # fmt: skip
STEP_PREFILL_TOKEN_BUCKETS = (
    0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
STEP_REQUEST_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

# --- bounded label values ---
STEP_KINDS = ("prefill", "decode", "mixed")  # "idle" steps are not observed
PREDICTION_ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
SLO_TARGETS = ("ttft", "itl", "both")
# Priority label values of the SLO counters (a client picks its priority: bounded series).
SLO_PRIORITIES = tuple(str(p) for p in range(10))
ABORT_REASONS = (*(r.value for r in AbortReason), "overload", "error")
REJECT_REASONS = ("overload", "invalid")
OTHER = "other"
MAX_RPC_SERIES = 256

# Model info labels always present (filled from the KV snapshot when not given).
INFO_LABELS = ("model", "dtype", "device", "block_size", "num_blocks")

# Every KVCacheStats field -> the metric that exports it (tests check this covers all fields).
# A text field is an info metric's label: ``name{label}``, the sample with that label = 1.
KV_FIELD_METRICS: dict[str, str] = {
    "block_size": "kvserve_kv_cache_block_size_tokens",
    "num_blocks_total": "kvserve_kv_cache_capacity_blocks",
    "num_blocks_used": 'kvserve_kv_cache_blocks{state="used"}',
    "num_blocks_cached_free": 'kvserve_kv_cache_blocks{state="cached_free"}',
    "num_blocks_free": 'kvserve_kv_cache_blocks{state="free"}',
    "num_blocks_reserved": 'kvserve_kv_cache_blocks{state="reserved"}',
    "total_sequences": "kvserve_kv_cache_sequences",
    "total_tokens": "kvserve_kv_cache_tokens",
    "block_bytes": "kvserve_kv_cache_block_size_bytes",
    "total_memory_bytes": "kvserve_kv_cache_memory_bytes",
    "used_memory_bytes": "kvserve_kv_cache_used_memory_bytes",
    "average_sequence_length": "kvserve_kv_cache_average_sequence_length_tokens",
    "cache_efficiency": "kvserve_kv_cache_efficiency_ratio",
    "usage": "kvserve_kv_cache_usage_ratio",
    "prefix_queries_tokens_total": "kvserve_prefix_cache_queries_tokens_total",
    "prefix_hits_tokens_total": "kvserve_prefix_cache_hits_tokens_total",
    "cache_hit_rate": "kvserve_prefix_cache_hit_ratio",
    "evictions_total": "kvserve_kv_cache_evictions_total",
    "cow_copies_total": "kvserve_kv_cache_cow_copies_total",
    "kv_strategy": "kvserve_kv_cache_strategy_info{strategy}",
    "strategy_dropped_tokens_total": "kvserve_kv_cache_strategy_dropped_tokens_total",
    "strategy_windowed_tokens_total": "kvserve_kv_cache_strategy_windowed_tokens_total",
    **TIER_FIELD_METRICS,
}


class _Histogram:
    """Bucket counts and a sum; the owner serializes access with its lock."""

    __slots__ = ("counts", "le_labels", "sum", "upper_bounds")

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in upper_bounds)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing, got {bounds}")
        self.upper_bounds = bounds
        self.le_labels = [_go_float(b) for b in bounds]  # the "le" label values, made once
        self.counts = [0] * (len(bounds) + 1)  # last slot: above the largest bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return
        # bisect_left: the first bound >= value, i.e. the "le" bucket the value belongs to.
        self.counts[bisect_left(self.upper_bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: Iterable[float]) -> None:
        counts, bounds = self.counts, self.upper_bounds
        total = 0.0
        for value in values:
            if math.isnan(value):
                continue
            value = max(0.0, value)
            counts[bisect_left(bounds, value)] += 1
            total += value
        self.sum += total

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        buckets: list[tuple[str, float]] = []
        running = 0
        for le, count in zip(self.le_labels, self.counts, strict=False):
            running += count
            buckets.append((le, float(running)))
        running += self.counts[-1]
        buckets.append(("+Inf", float(running)))
        return buckets, self.sum


_F = TypeVar("_F", bound=Callable[..., None])


def _never_raise(method: _F) -> _F:
    """Sink calls come from the engine loop: a metrics bug is logged and counted, not raised."""

    @functools.wraps(method)
    def wrapper(self: PrometheusSink, *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception:
            with self._lock:
                self._sink_errors += 1
                first = method.__name__ not in self._logged_errors
                self._logged_errors.add(method.__name__)
            if first:
                logger.exception("metrics sink %s failed (logged once)", method.__name__)

    return wrapper  # type: ignore[return-value]


def _go_float(value: float) -> str:
    """A bucket bound as Prometheus clients write it ("0.005", "1.0", "1e-05")."""
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]


def _nonneg(value: float) -> float:
    return value if value > 0.0 else 0.0


def _delta(start: float, end: float | None) -> float | None:
    """``end - start`` clamped at 0, or None when ``end`` never happened."""
    return None if end is None else _nonneg(end - start)


class PrometheusSink:
    """``MetricsSink`` + Collector for one engine; register one per registry.

    ``model_info`` becomes the labels of ``kvserve_model_info`` (model, dtype, device,
    block_size, num_blocks and any extra keys); block_size / num_blocks missing from it are
    read from the latest KV snapshot.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        model_info: dict[str, str] | None = None,
        stats: SchedulerStats | None = None,
        slo_targets_s: tuple[float, float] = (2.0, 0.15),
    ) -> None:
        """``slo_targets_s``: the server's default (TTFT, ITL) targets, for requests that
        carry none."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self._slo_targets_s = slo_targets_s
        self._model_info = {_label_name(k): str(v) for k, v in (model_info or {}).items()}
        self._lock = threading.Lock()
        # ``stats``: the engine's snapshot at start-up (pool sizes known before any step).
        self._stats: SchedulerStats = stats or SchedulerStats.make_empty(
            KVCacheStats.make_empty(
                num_blocks=_int_or(self._model_info.get("num_blocks"), 0),
                block_size=_int_or(self._model_info.get("block_size"), 16),
            )
        )
        # Per request.
        self._ttft = _Histogram(TTFT_BUCKETS_S)
        self._itl = _Histogram(INTER_TOKEN_BUCKETS_S)
        self._tpot = _Histogram(INTER_TOKEN_BUCKETS_S)
        self._e2e = _Histogram(REQUEST_LATENCY_BUCKETS_S)
        self._queue = _Histogram(REQUEST_LATENCY_BUCKETS_S)
        self._prefill = _Histogram(REQUEST_LATENCY_BUCKETS_S)
        self._decode = _Histogram(REQUEST_LATENCY_BUCKETS_S)
        self._prompt_len = _Histogram(TOKEN_COUNT_BUCKETS)
        self._gen_len = _Histogram(TOKEN_COUNT_BUCKETS)
        # Per step.
        self._step_duration = {k: _Histogram(STEP_DURATION_BUCKETS_S) for k in STEP_KINDS}
        self._step_prefill_tokens = _Histogram(STEP_PREFILL_TOKEN_BUCKETS)
        self._step_prefill_reqs = _Histogram(STEP_REQUEST_BUCKETS)
        self._step_decode_reqs = _Histogram(STEP_REQUEST_BUCKETS)
        self._step_sched_cpu = _Histogram(SCHEDULER_CPU_BUCKETS_S)
        # The step-cost model (the slo policy): predicted and measured iterations.
        self._step_predicted = _Histogram(STEP_DURATION_BUCKETS_S)
        self._step_actual = _Histogram(STEP_DURATION_BUCKETS_S)
        self._step_error = _Histogram(PREDICTION_ERROR_BUCKETS)
        # Requests judged against their latency targets, and those that met them, by
        # priority label (SLO_PRIORITIES or "other").
        self._slo_requests: dict[str, int] = {}
        self._slo_attained: dict[tuple[str, str], int] = {}
        # Event counters (not in any snapshot). Known label values start at 0 so the series
        # exist, and rate() over them is 0 rather than empty, from the first scrape on.
        self._aborts = dict.fromkeys(ABORT_REASONS, 0)
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._rpcs: dict[tuple[str, str], int] = {}
        self._sink_errors = 0
        self._logged_errors: set[str] = set()
        self.registry.register(self)

    # ----------------------------------------------------------------- MetricsSink
    @_never_raise
    def on_step(self, record: StepRecord) -> None:
        stats = record.stats
        self._stats = stats  # a reference swap: the collector reads whole snapshots
        if record.kind not in self._step_duration:
            return
        with self._lock:
            self._step_duration[record.kind].observe(_nonneg(record.step_duration_s))
            self._step_prefill_tokens.observe(stats.num_prefill_tokens)
            self._step_prefill_reqs.observe(stats.num_prefill_reqs)
            self._step_decode_reqs.observe(stats.num_decode_reqs)
            self._step_sched_cpu.observe(_nonneg(record.schedule_cpu_s))
            if record.predicted_s is not None and record.iteration_s > 0:
                self._step_predicted.observe(_nonneg(record.predicted_s))
                self._step_actual.observe(record.iteration_s)
                error = abs(record.predicted_s - record.iteration_s) / record.iteration_s
                self._step_error.observe(error)

    @_never_raise
    def on_request_done(self, record: RequestRecord) -> None:
        r = record
        # Everything is computed before the lock, so a malformed record changes nothing.
        e2e_s = _nonneg(r.finished_s - r.arrival_s)
        queue_s = _delta(r.arrival_s, r.first_scheduled_s)
        ttft_s = _delta(r.arrival_s, r.first_token_s)
        prefill_s = (
            None if r.first_scheduled_s is None else _delta(r.first_scheduled_s, r.first_token_s)
        )
        decode_s = _delta(r.first_token_s, r.finished_s) if r.first_token_s is not None else None
        tpot_s = (
            decode_s / (r.num_output_tokens - 1)
            if decode_s is not None and r.num_output_tokens > 1
            else None
        )
        gaps = list(r.inter_token_s)
        abort_key: str | None = None
        if r.finish_reason == FinishReason.ABORT.value:
            abort_key = r.abort_reason if r.abort_reason in self._aborts else OTHER
        elif r.finish_reason == FinishReason.ERROR.value:
            abort_key = "error"
        num_prompt, num_output = int(r.num_prompt_tokens), int(r.num_output_tokens)
        # Goodput: every request but those its client gave up on is judged on its targets.
        judged = abort_key not in (AbortReason.CLIENT_CANCEL.value, AbortReason.ABORT_CALL.value)
        default_ttft, default_itl = self._slo_targets_s
        ttft_ok, itl_ok = attained(
            ttft_s,
            tpot_s,
            default_ttft if r.ttft_target_s is None else r.ttft_target_s,
            default_itl if r.itl_target_s is None else r.itl_target_s,
        )
        priority = str(r.priority) if str(r.priority) in SLO_PRIORITIES else OTHER
        with self._lock:
            if judged:
                self._slo_requests[priority] = self._slo_requests.get(priority, 0) + 1
                for target, ok in (
                    ("ttft", ttft_ok),
                    ("itl", itl_ok),
                    ("both", ttft_ok and itl_ok),
                ):
                    key = (priority, target)
                    self._slo_attained[key] = self._slo_attained.get(key, 0) + ok
            self._e2e.observe(e2e_s)
            for hist, value in (
                (self._queue, queue_s),
                (self._ttft, ttft_s),
                (self._prefill, prefill_s),
                (self._decode, decode_s),
                (self._tpot, tpot_s),
            ):
                if value is not None:
                    hist.observe(value)
            self._itl.observe_many(gaps)
            self._prompt_len.observe(num_prompt)
            self._gen_len.observe(num_output)
            if abort_key is not None:
                self._aborts[abort_key] = self._aborts.get(abort_key, 0) + 1

    @_never_raise
    def on_rejected(self, reason: str) -> None:
        with self._lock:
            key = reason if reason in self._rejected else OTHER
            self._rejected[key] = self._rejected.get(key, 0) + 1
            if reason == "overload":
                self._aborts["overload"] += 1

    @_never_raise
    def on_rpc(self, method: str, code: str) -> None:
        key = (method.rsplit("/", 1)[-1], code)
        with self._lock:
            if key not in self._rpcs and len(self._rpcs) >= MAX_RPC_SERIES:
                key = (OTHER, OTHER)
            self._rpcs[key] = self._rpcs.get(key, 0) + 1

    # ----------------------------------------------------------------- Collector
    def describe(self) -> Iterator[Metric]:
        # Names only, for the registry's duplicate check (two sinks on one registry fail).
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        stats = self._stats  # the latest snapshot, read once
        with self._lock:
            hists = self._histogram_families()
            aborts = dict(self._aborts)
            rejected = dict(self._rejected)
            rpcs = dict(self._rpcs)
            sink_errors = self._sink_errors
            slo_requests = dict(self._slo_requests)
            slo_attained = dict(self._slo_attained)
        yield self._info_family(stats.kv)
        yield _counter(
            "slo_requests_total",
            "Requests judged against their latency targets (all but client cancels and Abort "
            "calls), by priority.",
            ["priority"],
            [((p,), v) for p, v in sorted(slo_requests.items())],
        )
        yield _counter(
            "slo_attained_total",
            "Judged requests that met their targets, by priority and target: ttft (first "
            "token in time), itl (time per output token in time), both (goodput).",
            ["priority", "target"],
            [(k, v) for k, v in sorted(slo_attained.items())],
        )
        yield from self._scheduler_families(stats)
        yield from self._kv_families(stats.kv)
        yield from kv_tier_families(stats.kv)
        yield from hists
        yield _counter(
            "request_aborts_total",
            "Requests (each of the n samples counts) that ended without completing, by reason "
            "(client_cancel, deadline, abort_call, shutdown, stalled, error, overload).",
            ["reason"],
            [((k,), v) for k, v in sorted(aborts.items())],
        )
        yield _counter(
            "requests_rejected_total",
            "Requests refused before reaching the scheduler, by reason (overload, invalid).",
            ["reason"],
            [((k,), v) for k, v in sorted(rejected.items())],
        )
        yield _counter(
            "rpcs_total",
            "Finished calls (gRPC and HTTP) by method and status code name.",
            ["method", "code"],
            [(k, v) for k, v in sorted(rpcs.items())],
        )
        yield _counter(
            "metrics_sink_errors_total",
            "Exceptions swallowed by the metrics sink (a bug: see the server log).",
            [],
            [((), sink_errors)],
        )

    def _info_family(self, kv: KVCacheStats) -> Metric:
        labels = dict.fromkeys(INFO_LABELS, "")
        labels["block_size"] = str(kv.block_size)
        labels["num_blocks"] = str(kv.num_blocks_total)
        labels.update(self._model_info)
        family = InfoMetricFamily(
            PREFIX + "model", "The model and KV cache geometry this server runs."
        )
        family.add_metric(list(labels), labels)
        return family

    def _scheduler_families(self, s: SchedulerStats) -> Iterator[Metric]:
        for name, doc, value in (
            ("requests_running", "Requests in the running set (prefill or decode).", s.num_running),
            (
                "requests_waiting",
                "Requests in the waiting queue, preempted ones included.",
                s.num_waiting,
            ),
            (
                "requests_preempted",
                "Waiting requests that were preempted and not yet resumed.",
                s.num_preempted,
            ),
            (
                "requests_parked",
                "Requests not scheduled because their client stopped reading its stream.",
                s.num_parked,
            ),
            (
                "waiting_queue_tokens",
                "Prompt tokens still to compute across the waiting queue.",
                s.waiting_tokens,
            ),
        ):
            yield _gauge(name, doc, value)
        for name, doc, value in (
            (
                "prompt_tokens_total",
                "Prompt tokens of admitted requests.",
                s.num_prompt_tokens_total,
            ),
            ("generation_tokens_total", "Output tokens produced.", s.num_generation_tokens_total),
            (
                "preemptions_total",
                "Preemptions (a running request's blocks freed, to recompute later).",
                s.num_preemptions_total,
            ),
            (
                "recomputed_tokens_total",
                "Computed tokens discarded by preemption (to be computed again).",
                s.num_recomputed_tokens_total,
            ),
            (
                "spec_draft_tokens_total",
                "Speculative draft tokens verified (n-gram drafts, --speculative ngram).",
                s.num_spec_draft_tokens_total,
            ),
            (
                "spec_accepted_tokens_total",
                "Speculative draft tokens accepted: output tokens that cost no step of their own.",
                s.num_spec_accepted_tokens_total,
            ),
        ):
            yield _counter(name, doc, [], [((), value)])
        finished = dict.fromkeys((f.value for f in FinishReason), 0)
        finished.update(s.num_finished_total)
        yield _counter(
            "requests_finished_total",
            "Requests finished in the scheduler, by finish reason (stop, length, abort, error).",
            ["finish_reason"],
            [((k,), v) for k, v in sorted(finished.items())],
        )
        yield _counter(
            "scheduler_batches_total",
            "Batches run, by kind; a step with a prefill and a decode batch counts once for each.",
            ["kind"],
            [(("decode",), s.num_steps_decode_total), (("prefill",), s.num_steps_prefill_total)],
        )

    def _kv_families(self, kv: KVCacheStats) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            PREFIX + "kv_cache_blocks",
            "KV blocks by state: used (referenced), cached_free (free, holding a prefix-cache "
            "key, evictable), free (holding nothing), reserved (never handed out).",
            labels=["state"],
        )
        blocks.add_metric(["used"], kv.num_blocks_used)
        blocks.add_metric(["cached_free"], kv.num_blocks_cached_free)
        blocks.add_metric(["free"], kv.num_blocks_free)
        blocks.add_metric(["reserved"], kv.num_blocks_reserved)
        yield blocks
        strategy = InfoMetricFamily(
            PREFIX + "kv_cache_strategy",
            "The KV cache strategy: always, long-sequence-only, adaptive or disabled.",
        )
        strategy.add_metric(["strategy"], {"strategy": kv.kv_strategy})
        yield strategy
        for name, doc, value in (
            ("kv_cache_block_size_tokens", "Tokens per KV block.", kv.block_size),
            ("kv_cache_capacity_blocks", "KV blocks in the pool.", kv.num_blocks_total),
            ("kv_cache_sequences", "Requests holding KV blocks now.", kv.total_sequences),
            (
                "kv_cache_tokens",
                "Token slots in use by the requests holding blocks.",
                kv.total_tokens,
            ),
            (
                "kv_cache_block_size_bytes",
                "Bytes of KV one block occupies across all layers.",
                kv.block_bytes,
            ),
            ("kv_cache_memory_bytes", "KV pool size in bytes.", kv.total_memory_bytes),
            (
                "kv_cache_used_memory_bytes",
                "Bytes of the KV pool in used blocks.",
                kv.used_memory_bytes,
            ),
            (
                "kv_cache_average_sequence_length_tokens",
                "Mean tokens per request holding blocks (0 when none).",
                kv.average_sequence_length,
            ),
            (
                "kv_cache_efficiency_ratio",
                "Token slots in use / token slots allocated (0 when empty).",
                kv.cache_efficiency,
            ),
            ("kv_cache_usage_ratio", "Used blocks / all blocks (0..1).", kv.usage),
            (
                "prefix_cache_hit_ratio",
                "Lifetime prefix hit ratio; for a window use rate() of the hits and queries "
                "counters.",
                kv.cache_hit_rate,
            ),
        ):
            yield _gauge(name, doc, value)
        for name, doc, value in (
            (
                "prefix_cache_queries_tokens_total",
                "Prompt tokens looked up in the prefix cache.",
                kv.prefix_queries_tokens_total,
            ),
            (
                "prefix_cache_hits_tokens_total",
                "Looked-up prompt tokens found in the prefix cache.",
                kv.prefix_hits_tokens_total,
            ),
            (
                "kv_cache_evictions_total",
                "Cached-free blocks whose prefix-cache key was dropped to hand the block out.",
                kv.evictions_total,
            ),
            ("kv_cache_cow_copies_total", "Copy-on-write block copies.", kv.cow_copies_total),
            (
                "kv_cache_strategy_dropped_tokens_total",
                "KV token slots the strategy dropped after a step, to recompute them "
                "(disabled, long-sequence-only).",
                kv.strategy_dropped_tokens_total,
            ),
            (
                "kv_cache_strategy_windowed_tokens_total",
                "Old KV token slots the adaptive strategy released from the longest requests "
                "under memory pressure.",
                kv.strategy_windowed_tokens_total,
            ),
        ):
            yield _counter(name, doc, [], [((), value)])

    def _histogram_families(self) -> list[Metric]:
        """Called with the lock held: copies every histogram into metric families."""
        out: list[Metric] = []
        for name, doc, hist in (
            ("request_time_to_first_token_seconds", "Arrival to first output token.", self._ttft),
            (
                "request_inter_token_latency_seconds",
                "Gap between consecutive output tokens (one observation per gap).",
                self._itl,
            ),
            (
                "request_time_per_output_token_seconds",
                "Per request: (finished - first token) / (output tokens - 1).",
                self._tpot,
            ),
            ("request_e2e_latency_seconds", "Arrival to finish (any finish reason).", self._e2e),
            ("request_queue_time_seconds", "Arrival to first scheduled.", self._queue),
            ("request_prefill_time_seconds", "First scheduled to first token.", self._prefill),
            ("request_decode_time_seconds", "First output token to finish.", self._decode),
            ("request_prompt_tokens", "Prompt length of finished requests.", self._prompt_len),
            ("request_generation_tokens", "Output tokens of finished requests.", self._gen_len),
            ("step_prefill_tokens", "Prefill tokens per step.", self._step_prefill_tokens),
            (
                "step_prefill_requests",
                "Requests in the prefill batch per step.",
                self._step_prefill_reqs,
            ),
            (
                "step_decode_requests",
                "Requests in the decode batch per step.",
                self._step_decode_reqs,
            ),
            (
                "step_scheduler_cpu_seconds",
                "CPU time of schedule() + update() per step.",
                self._step_sched_cpu,
            ),
            (
                "step_predicted_seconds",
                "The step-cost model's prediction of each iteration (slo policy).",
                self._step_predicted,
            ),
            (
                "step_iteration_seconds",
                "Measured iteration (schedule to processed outputs) of the predicted steps.",
                self._step_actual,
            ),
            (
                "step_prediction_error_ratio",
                "|predicted - measured| / measured iteration time, per step (slo policy).",
                self._step_error,
            ),
        ):
            family = HistogramMetricFamily(PREFIX + name, doc, labels=[])
            buckets, total = hist.cumulative()
            family.add_metric([], buckets, total)
            out.append(family)
        step = HistogramMetricFamily(
            PREFIX + "step_duration_seconds",
            "Wall time of runner.execute per step, by batch kind (prefill, decode, mixed).",
            labels=["kind"],
        )
        for kind, hist in self._step_duration.items():
            buckets, total = hist.cumulative()
            step.add_metric([kind], buckets, total)
        out.append(step)
        return out


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=float(value))


def _counter(
    name: str,
    doc: str,
    labels: list[str],
    samples: Iterable[tuple[Sequence[str], float]],
) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
    for label_values, value in samples:
        family.add_metric(list(label_values), float(value))
    return family


def _label_name(key: str) -> str:
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
    return name if name and not name[0].isdigit() else "_" + name


def _int_or(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def kv_field_metrics() -> dict[str, str]:
    """KVCacheStats field -> exporting metric; raises if a field has no metric (tests use it)."""
    missing = [f.name for f in fields(KVCacheStats) if f.name not in KV_FIELD_METRICS]
    if missing:
        raise RuntimeError(f"KVCacheStats fields without a metric: {missing}")
    return dict(KV_FIELD_METRICS)
