"""Prometheus export: a ``MetricsSink`` that is also the registry's custom Collector.

The engine hands the sink plain records (``metrics.records``) and never touches
prometheus-client per token:

- ``on_step`` stores the step's ``SchedulerStats`` snapshot (one reference assignment) and
  observes the per-step histograms: O(1), one lock.
- ``on_request_done`` observes the per-request latency and length histograms once, when the
  request ends (any terminal path).
- At scrape time ``collect()`` reads the LATEST snapshot and exports every row of
  ``metrics.catalog`` (gauges, and the cumulative ``*_total`` fields as counters).

What is exported, under which name and with which doc, is ``metrics.catalog``; the buckets
and the bucket counter are ``metrics.histogram``. Label values are bounded: no request ids;
abort/rejection reasons outside the known set are reported as ``other`` and the (method,
code) pairs of ``kvserve_rpcs_total`` are capped.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from cache_manager.stats import KVCacheStats
from metrics.catalog import (
    ABORT_REASONS,
    ADAPTER_COUNTERS,
    ADAPTER_RESIDENT,
    CONNECTION_EVENTS,
    CONNECTION_SERVERS,
    EVENT_COUNTERS,
    HISTOGRAMS,
    INFO_LABELS,
    MAX_ADAPTER_SERIES,
    MAX_RPC_SERIES,
    OTHER,
    PREFIX,
    REJECT_REASONS,
    SLO_PRIORITIES,
    SNAPSHOT_METRICS,
    STEP_DURATION,
    STEP_KINDS,
    TRANSFER_OUTCOMES,
)
from metrics.histogram import Histogram
from metrics.records import RequestRecord, StepRecord
from scheduler.lora import BASE_ADAPTER_LABEL
from scheduler.output import SchedulerStats
from scheduler.request import AbortReason, FinishReason
from scheduler.slo import attained, time_per_output_token

logger = logging.getLogger(__name__)
# The sink's per-adapter counts, in the order it keeps them.
_ADAPTER_COUNTERS = (
    "lora_requests_total",
    "lora_prompt_tokens_total",
    "lora_generation_tokens_total",
)


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
        self._hist = {spec.key: Histogram(spec.buckets) for spec in HISTOGRAMS}
        self._step_duration = {k: Histogram(STEP_DURATION.buckets) for k in STEP_KINDS}
        # Requests judged against their latency targets, and those that met them, by
        # priority label (SLO_PRIORITIES or "other").
        self._slo_requests: dict[str, int] = {}
        self._slo_attained: dict[tuple[str, str], int] = {}
        # Event counters (not in any snapshot). Known label values start at 0 so the series
        # exist, and rate() over them is 0 rather than empty, from the first scrape on.
        self._aborts = dict.fromkeys(ABORT_REASONS, 0)
        self._rejected = dict.fromkeys(REJECT_REASONS, 0)
        self._rpcs: dict[tuple[str, str], int] = {}
        self._connections = {(s, e): 0 for s in CONNECTION_SERVERS for e in CONNECTION_EVENTS}
        self._transfers = dict.fromkeys(TRANSFER_OUTCOMES, 0)
        self._transfer_blocks = 0
        self._transfer_bytes = 0
        self._sink_errors = 0
        self._constrained = 0
        # By LoRA adapter: finished requests, their prompt and output tokens.
        self._adapters: dict[str, list[int]] = {BASE_ADAPTER_LABEL: [0, 0, 0]}
        self._constraint_compiles = 0
        self._constraint_cache_hits = 0
        self._failed_steps = 0
        self._logged_errors: set[str] = set()
        self.registry.register(self)

    # ----------------------------------------------------------------- MetricsSink
    @_never_raise
    def on_step(self, record: StepRecord) -> None:
        stats = record.stats
        self._stats = stats  # a reference swap: the collector reads whole snapshots
        if record.kind not in self._step_duration:
            return
        hist = self._hist
        with self._lock:
            self._constraint_compiles = record.num_constraint_compiles_total
            self._constraint_cache_hits = record.num_constraint_cache_hits_total
            self._failed_steps = record.num_failed_steps_total
            if record.constraint_mask_s > 0:
                hist["step_constraint_mask"].observe(record.constraint_mask_s)
            self._step_duration[record.kind].observe(_nonneg(record.step_duration_s))
            hist["step_prefill_tokens"].observe(stats.num_prefill_tokens)
            hist["step_prefill_reqs"].observe(stats.num_prefill_reqs)
            hist["step_decode_reqs"].observe(stats.num_decode_reqs)
            hist["step_sched_cpu"].observe(_nonneg(record.schedule_cpu_s))
            if record.predicted_s is not None and record.iteration_s > 0:
                hist["step_predicted"].observe(_nonneg(record.predicted_s))
                hist["step_actual"].observe(record.iteration_s)
                error = abs(record.predicted_s - record.iteration_s) / record.iteration_s
                hist["step_error"].observe(error)

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
        tpot_s = time_per_output_token(r.first_token_s, r.finished_s, r.num_output_tokens - 1)
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
        hist = self._hist
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
            hist["e2e"].observe(e2e_s)
            for name, value in (
                ("queue", queue_s),
                ("ttft", ttft_s),
                ("prefill", prefill_s),
                ("decode", decode_s),
                ("tpot", tpot_s),
            ):
                if value is not None:
                    hist[name].observe(value)
            hist["itl"].observe_many(gaps)
            hist["prompt_len"].observe(num_prompt)
            hist["gen_len"].observe(num_output)
            if abort_key is not None:
                self._aborts[abort_key] = self._aborts.get(abort_key, 0) + 1
            self._constrained += bool(r.constrained)
            adapter = r.adapter or BASE_ADAPTER_LABEL
            if adapter not in self._adapters and len(self._adapters) > MAX_ADAPTER_SERIES:
                adapter = OTHER
            counts = self._adapters.setdefault(adapter, [0, 0, 0])
            counts[0] += 1
            counts[1] += num_prompt
            counts[2] += num_output

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

    @_never_raise
    def on_connection_event(self, server: str, event: str) -> None:
        key = (
            server if server in CONNECTION_SERVERS else OTHER,
            event if event in CONNECTION_EVENTS else OTHER,
        )
        with self._lock:
            self._connections[key] = self._connections.get(key, 0) + 1

    @_never_raise
    def on_kv_transfer(self, outcome: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        key = outcome if outcome in self._transfers else OTHER
        with self._lock:
            self._transfers[key] = self._transfers.get(key, 0) + 1
            self._transfer_blocks += int(num_blocks)
            self._transfer_bytes += int(num_bytes)
            self._hist["kv_transfer"].observe(_nonneg(seconds))

    # ----------------------------------------------------------------- Collector
    def describe(self) -> Iterator[Metric]:
        # Names only, for the registry's duplicate check (two sinks on one registry fail).
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        stats = self._stats  # the latest snapshot, read once
        with self._lock:
            hists = self._histogram_families()
            events: dict[str, Iterable[tuple[Sequence[str], float]]] = {
                "slo_requests_total": [((p,), v) for p, v in sorted(self._slo_requests.items())],
                "slo_attained_total": sorted(self._slo_attained.items()),
                "request_aborts_total": [((k,), v) for k, v in sorted(self._aborts.items())],
                "requests_rejected_total": [((k,), v) for k, v in sorted(self._rejected.items())],
                "rpcs_total": sorted(self._rpcs.items()),
                "connection_events_total": sorted(self._connections.items()),
                "metrics_sink_errors_total": [((), self._sink_errors)],
                "constrained_requests_total": [((), self._constrained)],
                **{
                    name: [((a,), c[i]) for a, c in sorted(self._adapters.items())]
                    for i, name in enumerate(_ADAPTER_COUNTERS)
                },
                "constraint_compiles_total": [((), self._constraint_compiles)],
                "constraint_cache_hits_total": [((), self._constraint_cache_hits)],
                "engine_failed_steps_total": [((), self._failed_steps)],
                "kv_transfers_total": [((k,), v) for k, v in sorted(self._transfers.items())],
                "kv_transfer_blocks_total": [((), self._transfer_blocks)],
                "kv_transfer_bytes_total": [((), self._transfer_bytes)],
            }
        yield self._info_family(stats.kv)
        for metric in SNAPSHOT_METRICS:
            family = metric.family(stats)
            if family is not None:
                yield family
        yield from hists
        for name, samples in events.items():
            labels, doc = EVENT_COUNTERS[name]
            family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))
            for label_values, value in samples:
                family.add_metric(list(label_values), float(value))
            yield family

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

    def _histogram_families(self) -> list[Metric]:
        """Called with the lock held: copies every histogram into metric families."""
        out: list[Metric] = []
        for spec in HISTOGRAMS:
            family = HistogramMetricFamily(PREFIX + spec.name, spec.doc, labels=[])
            buckets, total = self._hist[spec.key].cumulative()
            family.add_metric([], buckets, total)
            out.append(family)
        step = HistogramMetricFamily(
            PREFIX + STEP_DURATION.name, STEP_DURATION.doc, labels=["kind"]
        )
        for kind, hist in self._step_duration.items():
            buckets, total = hist.cumulative()
            step.add_metric([kind], buckets, total)
        out.append(step)
        return out


class AdapterCounts(Protocol):
    """What ``AdapterCollector`` reads (``model_runner.lora.info.AdapterCounts``)."""

    @property
    def resident(self) -> int: ...
    @property
    def loads_total(self) -> int: ...
    @property
    def evictions_total(self) -> int: ...


class AdapterCollector:
    """The LoRA registry's adapters (``ADAPTER_RESIDENT``, ``ADAPTER_COUNTERS``), read from
    ``read`` (``AdapterSource.counts``) at each scrape; registered beside the engine's sink."""

    def __init__(self, read: Callable[[], AdapterCounts]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        counts = self._read()
        name, doc = ADAPTER_RESIDENT
        yield GaugeMetricFamily(PREFIX + name, doc, value=counts.resident)
        for name, (field, doc) in ADAPTER_COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(counts, field))


def _label_name(key: str) -> str:
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in key)
    return name if name and not name[0].isdigit() else "_" + name


def _int_or(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default
