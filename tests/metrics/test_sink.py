"""PrometheusSink with hand-made records: every metric's exact value, labels and buckets."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
from prometheus_client import CollectorRegistry

from cache_manager.stats import KVCacheStats
from metrics.catalog import ABORT_REASONS, MAX_RPC_SERIES, kv_field_metrics
from metrics.prometheus import PrometheusSink
from metrics.records import MetricsSink, RequestRecord, StepRecord
from scheduler.output import SchedulerStats
from server.asgi import metrics_app, start_asgi_server
from tests.metrics.helpers import value


def make_kv(**overrides: float) -> KVCacheStats:
    base = KVCacheStats(
        block_size=16,
        num_blocks_total=100,
        num_blocks_used=30,
        num_blocks_cached_free=20,
        num_blocks_free=50,
        total_sequences=3,
        total_tokens=400,
        block_bytes=4096,
        total_memory_bytes=409600,
        used_memory_bytes=122880,
        average_sequence_length=133.5,
        cache_efficiency=0.75,
        usage=0.3,
        prefix_queries_tokens_total=1000,
        prefix_hits_tokens_total=250,
        cache_hit_rate=0.25,
        evictions_total=7,
        cow_copies_total=2,
    )
    return dataclasses.replace(base, **overrides)


def make_stats(kv: KVCacheStats | None = None, **overrides: object) -> SchedulerStats:
    base = SchedulerStats(
        step_id=12,
        num_running=3,
        num_waiting=5,
        num_preempted=1,
        num_prefill_tokens=96,
        num_prefill_reqs=2,
        num_decode_reqs=3,
        num_steps_prefill_total=6,
        num_steps_decode_total=10,
        num_preemptions_total=4,
        num_recomputed_tokens_total=64,
        num_prompt_tokens_total=900,
        num_generation_tokens_total=321,
        num_finished_total={"stop": 2, "length": 8},
        num_waiting_tokens=77,
        kv=kv if kv is not None else make_kv(),
        num_spec_draft_tokens_total=40,
        num_spec_accepted_tokens_total=30,
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def make_record(**overrides: object) -> RequestRecord:
    base = RequestRecord(
        request_id="r0",
        finish_reason="length",
        abort_reason=None,
        num_prompt_tokens=20,
        num_cached_tokens=16,
        num_output_tokens=5,
        arrival_s=100.0,
        first_scheduled_s=100.5,
        first_token_s=101.0,
        finished_s=103.0,
        inter_token_s=[0.5, 0.5, 0.25, 0.75],
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def test_sink_satisfies_the_protocol(registry: CollectorRegistry) -> None:
    """PrometheusSink is a MetricsSink (the engine's contract) and registers itself."""
    sink: MetricsSink = PrometheusSink(registry)
    assert isinstance(sink, PrometheusSink)
    assert value(registry, "kvserve_model_info", model="", dtype="", device="",
                 block_size="16", num_blocks="0") == 1.0  # fmt: skip


def test_request_record_observes_every_latency_once(registry: CollectorRegistry) -> None:
    """One finished request: TTFT, queue, prefill, decode, TPOT, e2e, ITL gaps, lengths."""
    sink = PrometheusSink(registry)
    sink.on_request_done(make_record())
    expected_sums = {
        "kvserve_request_time_to_first_token_seconds": 1.0,
        "kvserve_request_queue_time_seconds": 0.5,
        "kvserve_request_prefill_time_seconds": 0.5,
        "kvserve_request_decode_time_seconds": 2.0,
        "kvserve_request_time_per_output_token_seconds": 0.5,
        "kvserve_request_e2e_latency_seconds": 3.0,
        "kvserve_request_prompt_tokens": 20.0,
        "kvserve_request_generation_tokens": 5.0,
    }
    for name, total in expected_sums.items():
        assert value(registry, name + "_count") == 1.0, name
        assert value(registry, name + "_sum") == total, name
    assert value(registry, "kvserve_request_inter_token_latency_seconds_count") == 4.0
    assert value(registry, "kvserve_request_inter_token_latency_seconds_sum") == 2.0
    itl = "kvserve_request_inter_token_latency_seconds_bucket"
    assert value(registry, itl, le="0.2") == 0.0
    assert value(registry, itl, le="0.3") == 1.0  # 0.25
    assert value(registry, itl, le="0.5") == 3.0  # 0.25, 0.5, 0.5 (le is inclusive)
    assert value(registry, itl, le="0.75") == 4.0
    assert value(registry, itl, le="+Inf") == 4.0
    ttft = "kvserve_request_time_to_first_token_seconds_bucket"
    assert value(registry, ttft, le="0.75") == 0.0
    assert value(registry, ttft, le="1.0") == 1.0
    gen = "kvserve_request_generation_tokens_bucket"
    assert value(registry, gen, le="4.0") == 0.0
    assert value(registry, gen, le="8.0") == 1.0
    for reason in ABORT_REASONS:
        assert value(registry, "kvserve_request_aborts_total", reason=reason) == 0.0


def test_request_aborted_while_waiting_has_no_first_token(registry: CollectorRegistry) -> None:
    """A request that never ran counts e2e and lengths only, and an abort by its reason."""
    sink = PrometheusSink(registry)
    sink.on_request_done(
        make_record(
            finish_reason="abort",
            abort_reason="client_cancel",
            num_output_tokens=0,
            first_scheduled_s=None,
            first_token_s=None,
            finished_s=100.25,
            inter_token_s=[],
        )
    )
    assert value(registry, "kvserve_request_e2e_latency_seconds_sum") == 0.25
    assert value(registry, "kvserve_request_generation_tokens_bucket", le="1.0") == 1.0
    for name in (
        "kvserve_request_time_to_first_token_seconds",
        "kvserve_request_queue_time_seconds",
        "kvserve_request_prefill_time_seconds",
        "kvserve_request_decode_time_seconds",
        "kvserve_request_time_per_output_token_seconds",
        "kvserve_request_inter_token_latency_seconds",
    ):
        assert value(registry, name + "_count") == 0.0, name
    assert value(registry, "kvserve_request_aborts_total", reason="client_cancel") == 1.0
    assert value(registry, "kvserve_request_aborts_total", reason="deadline") == 0.0


def test_single_token_request_has_no_time_per_output_token(registry: CollectorRegistry) -> None:
    """TPOT needs two output tokens; a one-token request still has TTFT and decode time."""
    sink = PrometheusSink(registry)
    sink.on_request_done(make_record(num_output_tokens=1, finished_s=101.0, inter_token_s=[]))
    assert value(registry, "kvserve_request_time_per_output_token_seconds_count") == 0.0
    assert value(registry, "kvserve_request_time_to_first_token_seconds_count") == 1.0
    assert value(registry, "kvserve_request_decode_time_seconds_sum") == 0.0


def test_abort_reasons_errors_and_unknown_reasons(registry: CollectorRegistry) -> None:
    """Each abort reason has its label; finish_reason error counts as reason error."""
    sink = PrometheusSink(registry)
    for reason in ("deadline", "abort_call", "shutdown", "deadline", "martian"):
        sink.on_request_done(make_record(finish_reason="abort", abort_reason=reason))
    sink.on_request_done(make_record(finish_reason="error"))
    sink.on_request_done(make_record(finish_reason="stop"))
    aborts = "kvserve_request_aborts_total"
    assert value(registry, aborts, reason="deadline") == 2.0
    assert value(registry, aborts, reason="abort_call") == 1.0
    assert value(registry, aborts, reason="shutdown") == 1.0
    assert value(registry, aborts, reason="client_cancel") == 0.0
    assert value(registry, aborts, reason="error") == 1.0
    assert value(registry, aborts, reason="other") == 1.0
    assert value(registry, "kvserve_request_e2e_latency_seconds_count") == 7.0


def test_rejections_count_overload_as_an_abort_too(registry: CollectorRegistry) -> None:
    """on_rejected counts by reason; overload is also an abort reason; unknown -> other."""
    sink = PrometheusSink(registry)
    sink.on_rejected("overload")
    sink.on_rejected("overload")
    sink.on_rejected("invalid")
    sink.on_rejected("cosmic-ray")
    assert value(registry, "kvserve_requests_rejected_total", reason="overload") == 2.0
    assert value(registry, "kvserve_requests_rejected_total", reason="invalid") == 1.0
    assert value(registry, "kvserve_requests_rejected_total", reason="other") == 1.0
    assert value(registry, "kvserve_request_aborts_total", reason="overload") == 2.0


def test_rpcs_by_method_and_code_with_bounded_pairs(registry: CollectorRegistry) -> None:
    """RPCs count by (method, code); a full method path keeps its last part; pairs are capped."""
    sink = PrometheusSink(registry)
    sink.on_rpc("Generate", "OK")
    sink.on_rpc("/kvserve.v1.Generation/Generate", "OK")
    sink.on_rpc("Generate", "INVALID_ARGUMENT")
    assert value(registry, "kvserve_rpcs_total", method="Generate", code="OK") == 2.0
    assert value(registry, "kvserve_rpcs_total", method="Generate", code="INVALID_ARGUMENT") == 1.0
    for i in range(MAX_RPC_SERIES + 5):
        sink.on_rpc(f"M{i}", "OK")
    assert value(registry, "kvserve_rpcs_total", method="other", code="other") == 7.0
    assert value(registry, "kvserve_rpcs_total", method=f"M{MAX_RPC_SERIES - 3}", code="OK") == 1.0
    assert registry.get_sample_value("kvserve_rpcs_total", {"method": "M254", "code": "OK"}) is None


def test_step_snapshot_gauges_and_counters(registry: CollectorRegistry) -> None:
    """on_step stores the snapshot: queue gauges and scheduler counters read from it."""
    sink = PrometheusSink(registry)
    sink.on_step(StepRecord(make_stats(), kind="mixed", step_duration_s=0.02, schedule_cpu_s=1e-4))
    assert value(registry, "kvserve_requests_running") == 3.0
    assert value(registry, "kvserve_requests_waiting") == 5.0
    assert value(registry, "kvserve_requests_preempted") == 1.0
    assert value(registry, "kvserve_waiting_queue_tokens") == 77.0
    assert value(registry, "kvserve_prompt_tokens_total") == 900.0
    assert value(registry, "kvserve_generation_tokens_total") == 321.0
    assert value(registry, "kvserve_preemptions_total") == 4.0
    assert value(registry, "kvserve_recomputed_tokens_total") == 64.0
    assert value(registry, "kvserve_spec_draft_tokens_total") == 40.0
    assert value(registry, "kvserve_spec_accepted_tokens_total") == 30.0
    finished = "kvserve_requests_finished_total"
    assert value(registry, finished, finish_reason="stop") == 2.0
    assert value(registry, finished, finish_reason="length") == 8.0
    assert value(registry, finished, finish_reason="abort") == 0.0
    assert value(registry, finished, finish_reason="error") == 0.0
    assert value(registry, "kvserve_scheduler_batches_total", kind="prefill") == 6.0
    assert value(registry, "kvserve_scheduler_batches_total", kind="decode") == 10.0


def test_step_histograms_by_kind_and_idle_steps(registry: CollectorRegistry) -> None:
    """Step duration by kind, batch composition and scheduler CPU; idle steps observe nothing."""
    sink = PrometheusSink(registry)
    sink.on_step(StepRecord(make_stats(), kind="mixed", step_duration_s=0.02, schedule_cpu_s=2e-5))
    decode_only = make_stats(num_prefill_tokens=0, num_prefill_reqs=0, num_decode_reqs=4)
    sink.on_step(StepRecord(decode_only, kind="decode", step_duration_s=0.004, schedule_cpu_s=0.0))
    idle = make_stats(num_running=0, num_prefill_tokens=0, num_prefill_reqs=0, num_decode_reqs=0)
    sink.on_step(StepRecord(idle, kind="idle", step_duration_s=0.0, schedule_cpu_s=1e-6))
    dur = "kvserve_step_duration_seconds"
    assert value(registry, dur + "_count", kind="mixed") == 1.0
    assert value(registry, dur + "_count", kind="decode") == 1.0
    assert value(registry, dur + "_count", kind="prefill") == 0.0
    assert value(registry, dur + "_bucket", kind="decode", le="0.0025") == 0.0
    assert value(registry, dur + "_bucket", kind="decode", le="0.005") == 1.0
    assert value(registry, dur + "_bucket", kind="mixed", le="0.02") == 1.0
    assert value(registry, "kvserve_step_prefill_tokens_count") == 2.0
    assert value(registry, "kvserve_step_prefill_tokens_sum") == 96.0
    assert value(registry, "kvserve_step_prefill_tokens_bucket", le="0.0") == 1.0
    assert value(registry, "kvserve_step_prefill_tokens_bucket", le="64.0") == 1.0
    assert value(registry, "kvserve_step_prefill_tokens_bucket", le="128.0") == 2.0
    assert value(registry, "kvserve_step_prefill_requests_sum") == 2.0
    assert value(registry, "kvserve_step_decode_requests_sum") == 7.0
    assert value(registry, "kvserve_step_decode_requests_bucket", le="2.0") == 0.0
    assert value(registry, "kvserve_step_decode_requests_bucket", le="4.0") == 2.0
    assert value(registry, "kvserve_step_scheduler_cpu_seconds_count") == 2.0
    assert value(registry, "kvserve_step_scheduler_cpu_seconds_bucket", le="1e-05") == 1.0
    assert value(registry, "kvserve_step_scheduler_cpu_seconds_bucket", le="2.5e-05") == 2.0
    # The idle step's snapshot is still the one a scrape reads.
    assert value(registry, "kvserve_requests_running") == 0.0


def test_collector_reads_the_latest_snapshot(registry: CollectorRegistry) -> None:
    """A scrape reads whichever snapshot came last; counters follow the snapshot."""
    sink = PrometheusSink(registry)
    sink.on_step(StepRecord(make_stats(), kind="decode", step_duration_s=0.01, schedule_cpu_s=0))
    assert value(registry, "kvserve_prefix_cache_hits_tokens_total") == 250.0
    later = make_stats(kv=make_kv(prefix_hits_tokens_total=300, num_blocks_used=31,
                                  num_blocks_free=49), num_generation_tokens_total=324)  # fmt: skip
    sink.on_step(StepRecord(later, kind="decode", step_duration_s=0.01, schedule_cpu_s=0))
    assert value(registry, "kvserve_prefix_cache_hits_tokens_total") == 300.0
    assert value(registry, "kvserve_generation_tokens_total") == 324.0
    assert value(registry, "kvserve_kv_cache_blocks", state="used") == 31.0
    assert value(registry, "kvserve_kv_cache_blocks", state="free") == 49.0


def test_every_kv_cache_stats_field_is_exported(registry: CollectorRegistry) -> None:
    """Each KVCacheStats field, set to a distinct value, appears in its mapped metric."""
    mapping = kv_field_metrics()
    distinct = {
        f.name: f"text-{i}" if f.type == "str" else (i + 1) * 3 + (0.5 if f.type == "float" else 0)
        for i, f in enumerate(dataclasses.fields(KVCacheStats))
        if f.name != "tier2"  # the store's figures: tests/metrics/test_kv_tier.py
    }
    kv = KVCacheStats(
        **{k: (v if isinstance(v, (float, str)) else int(v)) for k, v in distinct.items()}
    )
    sink = PrometheusSink(registry)
    stats = make_stats(kv=kv)
    sink.on_step(StepRecord(stats, kind="idle", step_duration_s=0.0, schedule_cpu_s=0.0))
    for field_name, metric in mapping.items():
        if field_name not in distinct:
            continue
        name, _, label = metric.partition("{")
        label = label.rstrip("}").replace('"', "")
        field_value = getattr(kv, field_name)
        if isinstance(field_value, str):  # an info metric: the text is the label
            assert value(registry, name, **{label: field_value}) == 1.0, field_name
            continue
        labels = dict([label.split("=")]) if label else {}
        assert value(registry, name, **labels) == field_value, field_name


def test_model_info_labels(registry: CollectorRegistry) -> None:
    """The info metric carries the given model labels plus the KV geometry of the snapshot."""
    sink = PrometheusSink(
        registry, model_info={"model": "smollm2", "dtype": "bfloat16", "device": "cuda:0"}
    )
    sink.on_step(StepRecord(make_stats(), kind="idle", step_duration_s=0, schedule_cpu_s=0))
    labels = {"model": "smollm2", "dtype": "bfloat16", "device": "cuda:0",
              "block_size": "16", "num_blocks": "100"}  # fmt: skip
    assert value(registry, "kvserve_model_info", **labels) == 1.0
    given = PrometheusSink(
        CollectorRegistry(), model_info={"num_blocks": "64", "quant-type": "q4_1"}
    )
    assert value(given.registry, "kvserve_kv_cache_capacity_blocks") == 64.0
    assert value(given.registry, "kvserve_model_info", model="", dtype="", device="",
                 block_size="16", num_blocks="64", quant_type="q4_1") == 1.0  # fmt: skip


def test_sink_never_raises_and_counts_its_errors(registry: CollectorRegistry) -> None:
    """A broken record is swallowed (the engine loop must not die), counted, and not applied."""
    sink = PrometheusSink(registry)
    sink.on_request_done(make_record(arrival_s=None))  # type: ignore[arg-type]
    sink.on_request_done(make_record(inter_token_s=None))  # type: ignore[arg-type]
    sink.on_step(None)  # type: ignore[arg-type]
    assert value(registry, "kvserve_metrics_sink_errors_total") == 3.0
    # A malformed record changes nothing else (no half-observed request).
    assert value(registry, "kvserve_request_e2e_latency_seconds_count") == 0.0
    assert value(registry, "kvserve_request_time_to_first_token_seconds_count") == 0.0


def test_two_sinks_cannot_share_a_registry(registry: CollectorRegistry) -> None:
    """Registering a second sink on the same registry fails loudly (duplicate names)."""
    PrometheusSink(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        PrometheusSink(registry)


async def test_metrics_server_on_port_zero(registry: CollectorRegistry) -> None:
    """The metrics app on the ASGI server binds port 0, returns the real port, and serves
    /metrics."""
    sink = PrometheusSink(registry, model_info={"model": "m"})
    sink.on_rpc("Generate", "OK")
    server = await start_asgi_server(metrics_app(registry), "127.0.0.1", 0, name="metrics")
    try:
        assert server.port > 0
        async with httpx.AsyncClient() as client:
            resp = await client.get(f"http://127.0.0.1:{server.port}/metrics")
        assert resp.status_code == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        assert 'kvserve_rpcs_total{code="OK",method="Generate"} 1.0' in resp.text
    finally:
        await server.stop()


def test_histogram_edges_nan_and_overflow(registry: CollectorRegistry) -> None:
    """A value above the largest bound lands only in +Inf; NaN gaps are dropped."""
    sink = PrometheusSink(registry)
    sink.on_request_done(make_record(inter_token_s=[float("nan"), 1000.0, 0.001]))
    itl = "kvserve_request_inter_token_latency_seconds"
    assert value(registry, itl + "_count") == 2.0
    assert value(registry, itl + "_sum") == 1000.001
    assert value(registry, itl + "_bucket", le="0.001") == 1.0
    assert value(registry, itl + "_bucket", le="20.0") == 1.0
    assert value(registry, itl + "_bucket", le="+Inf") == 2.0


def test_requests_tokens_and_queues_by_adapter(registry: CollectorRegistry) -> None:
    """Finished requests and their tokens count by LoRA adapter (base: the base model, always
    exported); the running and waiting gauges read the snapshot's per-adapter counts."""
    sink = PrometheusSink(registry)
    assert value(registry, "kvserve_lora_requests_total", adapter="base") == 0.0
    sink.on_request_done(make_record(adapter="sql"))
    sink.on_request_done(make_record(adapter="sql", num_prompt_tokens=4, num_output_tokens=2))
    sink.on_request_done(make_record())
    assert value(registry, "kvserve_lora_requests_total", adapter="sql") == 2.0
    assert value(registry, "kvserve_lora_prompt_tokens_total", adapter="sql") == 24.0
    assert value(registry, "kvserve_lora_generation_tokens_total", adapter="sql") == 7.0
    assert value(registry, "kvserve_lora_requests_total", adapter="base") == 1.0
    stats = make_stats(lora_running={"": 1, "sql": 2}, lora_waiting={"chat": 3})
    sink.on_step(StepRecord(stats, kind="mixed", step_duration_s=0.02, schedule_cpu_s=1e-4))
    assert value(registry, "kvserve_lora_running_requests", adapter="sql") == 2.0
    assert value(registry, "kvserve_lora_running_requests", adapter="base") == 1.0
    assert value(registry, "kvserve_lora_waiting_requests", adapter="chat") == 3.0
    assert value(registry, "kvserve_lora_waiting_requests", adapter="base") == 0.0
