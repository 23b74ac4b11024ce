"""End to end: a live kvserve under load, scraped by a real Prometheus; every dashboard query.

kvserve runs as a subprocess (``python -m server.cli serve --runner fake``, a small per-step
sleep), Prometheus scrapes it every second from a temporary config, a bounded asyncio load
(normal, invalid, cancelled and deadline-exceeded requests, plus unary RPCs) runs for
``LOAD_S`` seconds, and then every query of every panel of every dashboard is evaluated
through Prometheus's HTTP API at the end of the load, with Grafana's variables resolved.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import shlex
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest

from loadtest.launch import ServerProcess
from server.client import KVServeClient
from tests.metrics.dashboards import (
    load_dashboards,
    metric_names,
    queries,
    resolve,
    variable_queries,
)
from tests.metrics.helpers import (
    documented_families,
    families,
    require_binary,
    sample_names,
)
from tests.metrics.prom import PrometheusProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SCRAPE_INTERVAL_S = 1.0
LOAD_S = 12.0  # the load runs this long ...
RATE_WINDOW = "15s"  # ... inside this window, which stands in for $__rate_interval
MAX_REQUESTS = 4000  # count bound of the load, next to its time bound
MIN_REQUESTS = 50  # ... and on a machine whose cores are busy, it runs at least this many
NUM_WORKERS = 6
# Token ids < 256: the fake runner's byte tokenizer. Each prefix is 4 blocks of 16 tokens.
SHARED_PREFIXES = [list(range(32, 96)), list(range(96, 160))]


@pytest.fixture(scope="module")
def live(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, PrometheusProcess]]:
    workdir = tmp_path_factory.mktemp("e2e-metrics")
    require_binary("prometheus")
    serve_args = [
        *shlex.split(
            "--runner fake --fake-step-sleep-s 0.005 --num-blocks 48 --block-size 16 "
            "--max-num-seqs 8 --max-num-batched-tokens 256 --grace-period-s 2 --log-level warning "
            # slo: the cost-model panels have data; n-gram speculation with 1-gram matches drafts
            # often, so its panels have data too.
            "--policy slo --speculative ngram --ngram-min 1 "
            # a silent connection to /metrics is closed within a second: the connection panel
            "--http-header-timeout-s 1"
        ),
        *("--kv-disk-dir", str(workdir / "kv-tier")),  # tier 2: its series have data too
    ]
    server = ServerProcess(
        serve_args,
        startup_timeout_s=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")},
    ).start()
    prom = PrometheusProcess(workdir, [f"127.0.0.1:{server.metrics_port}"], SCRAPE_INTERVAL_S)
    try:
        prom.start()
        yield server, prom
    finally:
        prom.stop()
        server.stop()


# ------------------------------------------------------------------------------- load
async def _one(client: KVServeClient, i: int, rng: random.Random, outcomes: Counter[str]) -> None:
    kind = i % 10
    prefix = SHARED_PREFIXES[i % 2]
    prompt = prefix + [rng.randrange(160, 256) for _ in range(rng.randrange(4, 24))]
    try:
        if kind == 7:  # invalid argument
            await client.generate_text(prompt, temperature=-1.0, max_tokens=4, timeout_s=10)
        elif kind == 3:  # the client walks away after the first chunk: CANCELLED, client_cancel
            async for _ in client.generate(prompt, max_tokens=64, ignore_eos=True, timeout_s=10):
                break
            outcomes["cancelled"] += 1
            return
        elif kind == 5:  # deadline passes mid-generation: DEADLINE_EXCEEDED, deadline
            await client.generate_text(prompt, max_tokens=400, ignore_eos=True, timeout_s=0.05)
        elif kind == 1:  # structured outputs: the constraint panels have data
            text, _ = await client.generate_text(
                prompt, max_tokens=8, choice=["yes", "no"], timeout_s=10
            )
            assert text in ("yes", "no"), text
        elif kind == 9:
            await client.kv_cache_stats(timeout_s=10)
            await client.model_info(timeout_s=10)
        else:
            await client.generate_text(
                prompt, max_tokens=rng.randrange(4, 32), temperature=0.0, timeout_s=30
            )
        outcomes["ok"] += 1
    except grpc.aio.AioRpcError as exc:
        outcomes[exc.code().name] += 1


async def _load(address: str, duration_s: float) -> Counter[str]:
    outcomes: Counter[str] = Counter()
    deadline = time.monotonic() + duration_s
    counter = iter(range(MAX_REQUESTS))
    async with KVServeClient(address) as client:
        await client.wait_ready(timeout_s=10)

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while True:
                i = next(counter, None)
                if i is None or (i >= MIN_REQUESTS and time.monotonic() >= deadline):
                    return
                await _one(client, i, rng, outcomes)

        await asyncio.wait_for(
            asyncio.gather(*(worker(s) for s in range(NUM_WORKERS))), timeout=duration_s + 60
        )
    return outcomes


@pytest.fixture(scope="module")
def loaded(live: tuple[ServerProcess, PrometheusProcess]) -> tuple[float, Counter[str], str]:
    """Run the load; returns (end time, client-side outcomes, exposition after the load)."""
    server, prom = live
    outcomes = asyncio.run(_load(server.target, LOAD_S))
    # A connection that never sends a request: the metrics port closes it at the header
    # timeout and counts it (kvserve_connection_events_total).
    address = ("127.0.0.1", server.metrics_port)
    with (
        socket.create_connection(address, timeout=10) as silent,
        contextlib.suppress(ConnectionResetError),
    ):
        assert silent.recv(1) == b""
    end = time.time()
    # Bounded wait until Prometheus has a scrape from after the load ended.
    deadline = time.monotonic() + 30
    while True:
        got = prom.query('timestamp(kvserve_generation_tokens_total{job="kvserve"})')
        if got and float(got[0]["value"][1]) >= end:
            break
        assert time.monotonic() < deadline, (
            f"Prometheus has no scrape after the load: {got}; targets {prom.targets_health()}; "
            f"log:\n{prom.log_tail()}"
        )
        time.sleep(0.25)
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return end, outcomes, text


# ------------------------------------------------------------------------------- tests
def test_load_produced_every_outcome(loaded: tuple[float, Counter[str], str]) -> None:
    """The load ran and produced successes, invalid arguments, cancels and deadlines."""
    _, outcomes, _ = loaded
    assert outcomes["ok"] >= 20, outcomes
    for code in ("INVALID_ARGUMENT", "DEADLINE_EXCEEDED"):
        assert outcomes[code] >= 1, outcomes
    assert outcomes["cancelled"] >= 1, outcomes


def test_prometheus_scrapes_the_server(live: tuple[ServerProcess, PrometheusProcess]) -> None:
    """The scrape target is up (Prometheus parsed kvserve's exposition)."""
    _, prom = live
    targets = prom.targets_health()
    assert [t["health"] for t in targets] == ["up"], targets


def test_every_dashboard_query_returns_data(
    live: tuple[ServerProcess, PrometheusProcess], loaded: tuple[float, Counter[str], str]
) -> None:
    """Every panel query, variables resolved, returns a non-empty vector with a finite value."""
    _, prom = live
    end, _, _ = loaded
    dashboards = load_dashboards()
    variables = {"__rate_interval": RATE_WINDOW, "__interval": "1s", "datasource": "Prometheus"}
    for name, var_query in variable_queries(dashboards).items():
        metric, label = _label_values(var_query)
        values = prom.api("label/" + label + "/values", {"match[]": metric})
        # A single server has no replica label ("kvserve cluster serve" adds it); the empty
        # regex then matches every series, as Grafana's "All" (.*) does.
        assert values or name == "replica", f"variable {name}: {var_query} has no values"
        # Grafana escapes regex characters of the selected values inside =~ matchers.
        variables[name] = "|".join(v.replace(".", "\\\\.") for v in values)
    problems: list[str] = []
    all_queries = queries(dashboards)
    assert len(all_queries) >= 40
    for query in all_queries:
        expr = resolve(query.expr, variables)
        result = prom.query(expr, at=end)
        finite = [s for s in result if math.isfinite(float(s["value"][1]))]
        if not result:
            problems.append(f"{query.where}: empty result for {expr}")
        elif not finite:
            problems.append(f"{query.where}: only NaN/Inf for {expr}: {result}")
    assert not problems, "\n".join(problems)


def test_key_panels_show_the_traffic(
    live: tuple[ServerProcess, PrometheusProcess], loaded: tuple[float, Counter[str], str]
) -> None:
    """Throughput, latency, errors by code, hit rate and batch composition are non-zero."""
    _, prom = live
    end, _, _ = loaded

    def values(expr: str) -> dict[str, float]:
        result = prom.query(expr.replace("$w", RATE_WINDOW), at=end)
        return {",".join(f"{k}={v}" for k, v in sorted(s["metric"].items())):
                float(s["value"][1]) for s in result}  # fmt: skip

    assert values("sum(rate(kvserve_generation_tokens_total[$w]))")[""] > 0
    ttft = values(
        "histogram_quantile(0.5, sum by (le) "
        "(rate(kvserve_request_time_to_first_token_seconds_bucket[$w])))"
    )[""]
    assert 0 < ttft < 10
    errors = values('sum by (code) (rate(kvserve_rpcs_total{code!="OK"}[$w]))')
    for code in ("INVALID_ARGUMENT", "CANCELLED", "DEADLINE_EXCEEDED"):
        assert errors.get(f"code={code}", 0) > 0, errors
    aborts = values("sum by (reason) (increase(kvserve_request_aborts_total[$w]))")
    assert aborts["reason=client_cancel"] > 0 and aborts["reason=deadline"] > 0, aborts
    hit_rate = values(
        "sum(rate(kvserve_prefix_cache_hits_tokens_total[$w])) / "
        "sum(rate(kvserve_prefix_cache_queries_tokens_total[$w]))"
    )[""]
    assert 0 < hit_rate <= 1
    decode_per_step = values(
        "sum(rate(kvserve_step_decode_requests_sum[$w])) / "
        "sum(rate(kvserve_step_decode_requests_count[$w]))"
    )[""]
    assert decode_per_step > 0
    steps = values("sum by (kind) (increase(kvserve_step_duration_seconds_count[$w]))")
    assert steps["kind=decode"] + steps["kind=mixed"] > 0, steps
    blocks = values("sum by (state) (kvserve_kv_cache_blocks)")
    assert sum(blocks.values()) == 48, blocks


def test_dashboard_metrics_exist_in_the_live_exposition(
    loaded: tuple[float, Counter[str], str],
) -> None:
    """Every metric a dashboard names is a sample name of the live server's exposition."""
    _, _, text = loaded
    exposed = sample_names(text)
    for query in queries(load_dashboards()):
        missing = metric_names(query.expr) - exposed
        assert not missing, f"{query.where}: {sorted(missing)} not exposed"


def test_live_exposition_is_exactly_the_documented_metrics(
    loaded: tuple[float, Counter[str], str],
) -> None:
    """The live server's families equal docs/metrics.md (names, types, label names)."""
    _, _, text = loaded
    exposed = families(text)
    documented = documented_families()
    assert sorted(set(exposed) - set(documented)) == [], "exposed but not documented"
    assert sorted(set(documented) - set(exposed)) == [], "documented but not exposed"
    for name, spec in exposed.items():
        assert documented[name] == spec, name


def test_promtool_check_metrics_on_the_live_server(loaded: tuple[float, Counter[str], str]) -> None:
    """`promtool check metrics` passes on the live server's exposition after the load."""
    promtool = require_binary("promtool")
    _, _, text = loaded
    proc = subprocess.run(
        [promtool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60,
        check=False,
    )  # fmt: skip
    report = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0 and not report.strip(), report


def _label_values(var_query: str) -> tuple[str, str]:
    """``label_values(metric, label)`` -> (metric, label)."""
    inner = var_query.strip()
    assert inner.startswith("label_values(") and inner.endswith(")"), var_query
    metric, label = (part.strip() for part in inner[len("label_values(") : -1].split(","))
    return metric, label
