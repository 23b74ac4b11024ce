"""The exposition matches docs/metrics.md exactly and passes `promtool check metrics`."""

from __future__ import annotations

import dataclasses
import subprocess

import httpx
from prometheus_client import CollectorRegistry

from cache_manager.stats import KVTierStats
from metrics.prometheus import AdapterCollector, PrometheusSink
from metrics.records import StepRecord
from model_runner.lora.info import AdapterCounts
from server.asgi import metrics_app, start_asgi_server
from tests.metrics.helpers import (
    documented_families,
    exposition,
    families,
    require_binary,
)
from tests.metrics.test_sink import make_record, make_stats


def busy_sink(registry: CollectorRegistry) -> PrometheusSink:
    """A sink that saw one of everything, so every family has samples."""
    info = {"model": "m", "dtype": "float32", "device": "cpu", "weights": "q4_1+q8_0"}
    info |= {"weight_bytes": "100", "kv_dtype": "float16"}
    sink = PrometheusSink(registry, model_info=info)
    stats = make_stats()  # with tier 2 on, so its families have samples too
    stats = dataclasses.replace(
        stats, kv=dataclasses.replace(stats.kv, tier2=KVTierStats("lmdb", 1 << 30))
    )
    for kind in ("prefill", "decode", "mixed", "idle"):
        sink.on_step(StepRecord(stats, kind=kind, step_duration_s=0.01, schedule_cpu_s=1e-4))
    sink.on_request_done(make_record())
    sink.on_request_done(make_record(finish_reason="abort", abort_reason="deadline"))
    sink.on_rejected("overload")
    sink.on_rpc("Generate", "OK")
    sink.on_rpc("Generate", "CANCELLED")
    registry.register(AdapterCollector(lambda: AdapterCounts(2, 5, 3)))  # a server with LoRA
    return sink


def test_exposition_is_exactly_the_documented_metrics() -> None:
    """Every exposed family is in docs/metrics.md with its type and labels, and vice versa."""
    registry = CollectorRegistry()
    busy_sink(registry)
    exposed = families(exposition(registry))
    documented = documented_families()
    assert sorted(set(exposed) - set(documented)) == [], "exposed but not in docs/metrics.md"
    assert sorted(set(documented) - set(exposed)) == [], "in docs/metrics.md but not exposed"
    for name, spec in exposed.items():
        assert documented[name] == spec, f"docs/metrics.md disagrees with the exposition: {name}"


def test_names_follow_prometheus_conventions() -> None:
    """kvserve_ prefix; counters end in _total and nothing else does; units are base units."""
    registry = CollectorRegistry()
    busy_sink(registry)
    for name, spec in families(exposition(registry)).items():
        assert name.startswith("kvserve_"), name
        assert name.endswith("_total") == (spec.type == "counter"), name
        for bad_unit in ("_ms", "_milliseconds", "_percent", "_perc", "_kb", "_mb"):
            assert bad_unit not in name, name
        assert "request_id" not in spec.labels, name


async def test_promtool_check_metrics_passes_on_a_live_exposition() -> None:
    """`promtool check metrics` finds no problem in what the HTTP server serves."""
    promtool = require_binary("promtool")
    registry = CollectorRegistry()
    busy_sink(registry)
    server = await start_asgi_server(metrics_app(registry), "127.0.0.1", 0, name="metrics")
    try:
        async with httpx.AsyncClient() as client:
            body = (await client.get(f"http://127.0.0.1:{server.port}/metrics")).content
    finally:
        await server.stop()
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=60, check=False
    )
    report = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0, f"promtool check metrics failed:\n{report}"
    assert report.strip() == "", f"promtool reported lint problems:\n{report}"
