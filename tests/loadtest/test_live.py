"""The load generator against a live ``kvserve serve --runner fake`` on 127.0.0.1."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from loadtest.cli import main
from loadtest.launch import REPO_ROOT, ServerProcess
from loadtest.workload import Workload, arrival_offsets
from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc

WORKLOAD = {
    "name": "live",
    "seed": 5,
    "num_requests": 24,
    "prompt": {"source": "random", "len": 16},
    "output": {"len": {"type": "uniform", "min": 4, "max": 12}, "ignore_eos": True},
    "sampling": {"temperature": 0.0},
    "priorities": [{"value": 0, "weight": 1}, {"value": 1, "weight": 1}],
    "cancel": {"fraction": 0.25, "after_tokens": 2},
}

TOP_LEVEL_KEYS = {
    "schema",
    "workload",
    "load",
    "requests",
    "duration_s",
    "request_throughput_rps",
    "output_token_throughput_tps",
    "input_tokens_total",
    "output_tokens_total",
    "cached_prompt_tokens_total",
    "latency_s",
    "goodput",
    "by_priority",
    "server",
}
SUMMARY_KEYS = {"count", "mean", "p50", "p90", "p99", "min", "max"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--runner", "fake"]) as s:
        yield s


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ServerProcess]:
    """Each engine step sleeps 50 ms: a 1000-token request takes about 50 s."""
    with ServerProcess(["--runner", "fake", "--fake-step-sleep-s", "0.05"], metrics=False) as s:
        yield s


def _vocab_size(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        info = pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    return int(info.vocab_size)


def _write(tmp_path: Path, spec: dict[str, Any]) -> Path:
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(spec))
    return path


def test_report_schema_and_counts(server: ServerProcess, tmp_path: Path) -> None:
    """Closed loop, 4 users: the JSON has exactly the documented keys and exact counts."""
    wl_path = _write(tmp_path, WORKLOAD)
    out = tmp_path / "report.json"
    argv = [
        "--target", server.target, "--workload", str(wl_path), "--users", "4",
        "--metrics-url", str(server.metrics_url), "--sample-interval-s", "0.05",
        "--ttft-slo-ms", "60000", "--itl-slo-ms", "60000",
        "--out", str(out), "--plot-dir", str(tmp_path / "plots"), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    specs = Workload.load(wl_path).build(vocab_size=_vocab_size(server.target))
    ok = [s for s in specs if s.cancel_after_tokens is None]
    cancelled = [s for s in specs if s.cancel_after_tokens is not None]
    assert (len(ok), len(cancelled)) == (18, 6)

    assert set(report) == TOP_LEVEL_KEYS
    assert report["schema"] == "kvserve.loadtest/v1"
    assert report["requests"] == {
        "planned": 24,
        "sent": 24,
        "ok": 18,
        "cancelled": 6,
        "failed": 0,
        "interrupted": 0,
        "not_sent": 0,
        "by_code": {"CANCELLED": 6, "OK": 18},
    }
    assert report["load"] == {
        "api": "grpc",
        "target": server.target,
        "mode": "closed",
        "rate": None,
        "burstiness": None,
        "users": 4,
        "num_requests": 24,
        "duration_s": 600.0,
        "seed": 5,
        "request_timeout_s": None,
        "metrics_url": server.metrics_url,
        "reuse_cache": False,
        "cache_salt": report["load"]["cache_salt"],
    }
    assert report["load"]["cache_salt"].startswith("loadtest-")
    assert report["workload"]["name"] == "live"
    assert report["input_tokens_total"] == 24 * 16
    # The fake server streams one token per message; a cancel happens right after token 2.
    assert report["output_tokens_total"] == sum(s.max_tokens for s in ok) + 2 * 6
    lat = report["latency_s"]
    assert set(lat) == {"ttft", "itl", "tpot", "e2e"}
    assert all(set(v) == SUMMARY_KEYS for v in lat.values())
    assert lat["ttft"]["count"] == lat["tpot"]["count"] == lat["e2e"]["count"] == 18
    assert lat["itl"]["count"] == sum(s.max_tokens - 1 for s in ok)
    assert report["goodput"]["num_ok_within_slo"] == 18
    assert report["goodput"]["slo_ttft_s"] == 60.0
    assert report["by_priority"].keys() == {"0", "1"}
    for prio in (0, 1):
        entry = report["by_priority"][str(prio)]
        assert entry["count"] == sum(1 for s in specs if s.priority == prio) == 12
        assert entry["ok"] == sum(1 for s in ok if s.priority == prio)
        # The SLO is loose: every request that finished OK is within it, cancels are not.
        assert entry["num_ok_within_slo"] == entry["ok"]
        assert entry["fraction_within_slo"] == entry["ok"] / entry["count"]
    srv = report["server"]
    assert set(srv) == {
        "source",
        "prefix_queries_tokens",
        "prefix_hits_tokens",
        "prefix_hit_rate",
        "preemptions",
        "kv_usage_peak",
        "num_usage_samples",
        "counter_deltas",
    }
    assert srv["source"] == "metrics"
    assert srv["preemptions"] == 0.0
    assert srv["num_usage_samples"] >= 2  # before and after, plus periodic samples
    deltas = srv["counter_deltas"]
    assert deltas["kvserve_prompt_tokens_total"] == 24 * 16
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 0


def test_priorities_and_cancellations_reach_the_server(
    server: ServerProcess, tmp_path: Path
) -> None:
    """Each request carries its priority, and cancelled ones stop after exactly their tokens."""
    spec = {
        **WORKLOAD,
        "cancel": {"fraction": 0.5, "after_tokens": {"type": "uniform", "min": 1, "max": 3}},
    }
    wl_path = _write(tmp_path, spec)
    out = tmp_path / "report.json"
    argv = ["--target", server.target, "--workload", str(wl_path), "--users", "3",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    specs = Workload.load(wl_path).build(vocab_size=_vocab_size(server.target))
    cancelled = [s for s in specs if s.cancel_after_tokens is not None]
    assert len(cancelled) == 12
    assert report["requests"]["by_code"] == {"CANCELLED": 12, "OK": 12}
    assert Counter(s.priority for s in specs) == {0: 12, 1: 12}
    ok_tokens = sum(s.max_tokens for s in specs if s.cancel_after_tokens is None)
    cancel_tokens = sum(s.cancel_after_tokens or 0 for s in cancelled)
    assert report["output_tokens_total"] == ok_tokens + cancel_tokens
    assert report["server"]["source"] == "grpc"  # no metrics URL: GetKVCacheStats


def test_rate_sweep_writes_runs_and_plots(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--sweep-rates runs one open-loop run per rate into a sweep document with plots, and
    prints the path of every file it wrote."""
    wl_path = _write(tmp_path, {**WORKLOAD, "cancel": {"fraction": 0.0}})
    out = tmp_path / "sweep.json"
    argv = ["--target", server.target, "--workload", str(wl_path), "--num-requests", "8",
            "--sweep-rates", "50,200", "--burstiness", "0.5", "--out", str(out),
            "--plot-dir", str(tmp_path), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {"schema", "runs"}
    assert doc["schema"] == "kvserve.loadtest.sweep/v1"
    assert [r["load"]["rate"] for r in doc["runs"]] == [50.0, 200.0]
    assert all(r["load"]["mode"] == "open" and r["load"]["burstiness"] == 0.5 for r in doc["runs"])
    assert all(set(r) == TOP_LEVEL_KEYS for r in doc["runs"])
    assert [r["requests"]["ok"] for r in doc["runs"]] == [8, 8]
    for name in ("latency_cdf.png", "sweep_latency.png", "sweep_goodput.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert written == [
        f"wrote {(tmp_path / name).resolve()}"
        for name in ("sweep.json", "latency_cdf.png", "sweep_latency.png", "sweep_goodput.png")
    ]


# 40-token prompts: two full 16-token blocks each can be cached; random prompts share none.
ISOLATION = {**WORKLOAD, "num_requests": 8, "prompt": {"source": "random", "len": 40},
             "cancel": {"fraction": 0.0}}  # fmt: skip


def _sweep_twice(server: ServerProcess, tmp_path: Path, seed: int, *flags: str) -> list[Any]:
    """The same workload at the same rate twice, as one sweep; the two run reports."""
    wl_path = _write(tmp_path, {**ISOLATION, "seed": seed})
    out = tmp_path / "sweep.json"
    argv = ["--target", server.target, "--workload", str(wl_path), "--sweep-rates", "200,200",
            "--out", str(out), "--no-progress", *flags]  # fmt: skip
    assert main(argv) == 0
    runs: list[Any] = json.loads(out.read_text())["runs"]
    return runs


def test_each_sweep_point_starts_from_a_cold_prefix_cache(
    server: ServerProcess, tmp_path: Path
) -> None:
    """Two points with the same prompts: each has a salt of its own, so neither hits."""
    runs = _sweep_twice(server, tmp_path, seed=101)
    assert [r["cached_prompt_tokens_total"] for r in runs] == [0, 0]
    salts = [r["load"]["cache_salt"] for r in runs]
    assert salts[0] != salts[1] and salts[0][:-1] == salts[1][:-1]
    assert [r["load"]["reuse_cache"] for r in runs] == [False, False]


def test_reuse_cache_lets_a_point_hit_what_the_last_one_cached(
    server: ServerProcess, tmp_path: Path
) -> None:
    """--reuse-cache: the second point finds both full blocks of every prompt cached."""
    runs = _sweep_twice(server, tmp_path, 102, "--reuse-cache")
    assert [r["cached_prompt_tokens_total"] for r in runs] == [0, 8 * 32]
    assert [(r["load"]["reuse_cache"], r["load"]["cache_salt"]) for r in runs] == [(True, None)] * 2


def _run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    """``python -m loadtest`` as its own process; pytest's timeout is the outer bound."""
    return subprocess.run(
        [sys.executable, "-m", "loadtest", *args, "--no-progress"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_process_ends_at_the_count_bound(server: ServerProcess, tmp_path: Path) -> None:
    """--num-requests 5 of a 24-request workload: 5 sent, the process exits 0 by itself."""
    out = tmp_path / "r.json"
    wl = str(_write(tmp_path, WORKLOAD))
    done = _run_cli(["--target", server.target, "--workload", wl, "--num-requests", "5",
                     "--out", str(out)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    req = json.loads(out.read_text())["requests"]
    assert (req["planned"], req["sent"], req["not_sent"], req["interrupted"]) == (5, 5, 0, 0)


def test_open_loop_ends_at_the_time_bound(slow_server: ServerProcess, tmp_path: Path) -> None:
    """Open loop at 4 req/s, 1.5 s bound, 1000-token requests: sends what arrives before the
    bound, interrupts them all, and exits 0 long before the requests could finish."""
    spec = {**WORKLOAD, "num_requests": 100, "output": {"len": 1000}, "cancel": {"fraction": 0}}
    out = tmp_path / "r.json"
    wl = str(_write(tmp_path, spec))
    done = _run_cli(["--target", slow_server.target, "--workload", wl, "--mode", "open",
                     "--rate", "4", "--duration-s", "1.5", "--out", str(out)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    expected_sent = sum(1 for t in arrival_offsets(100, 4.0, 1.0, seed=5) if t < 1.5)
    assert expected_sent >= 2
    assert report["requests"]["sent"] == expected_sent
    assert report["requests"]["interrupted"] == expected_sent
    assert report["requests"]["not_sent"] == 100 - expected_sent
    assert report["requests"]["by_code"] == {"INTERRUPTED": expected_sent}


def test_closed_loop_ends_at_the_time_bound(slow_server: ServerProcess, tmp_path: Path) -> None:
    """Closed loop, 2 users, 1 s bound, 1000-token requests: 2 sent, both interrupted."""
    spec = {**WORKLOAD, "output": {"len": 1000}, "cancel": {"fraction": 0}}
    out = tmp_path / "r.json"
    wl = str(_write(tmp_path, spec))
    done = _run_cli(["--target", slow_server.target, "--workload", wl, "--users", "2",
                     "--duration-s", "1", "--out", str(out)])  # fmt: skip
    assert done.returncode == 0, done.stderr
    req = json.loads(out.read_text())["requests"]
    assert (req["sent"], req["interrupted"], req["not_sent"]) == (2, 2, 22)
    assert req["by_code"] == {"INTERRUPTED": 2}


def test_openai_backend_drives_kvserves_http_front(server: ServerProcess, tmp_path: Path) -> None:
    """`kvserve loadtest --api openai` against kvserve's own OpenAI-compatible front: 12
    token-id requests (3 cancelled after 2 tokens) all reach it, and the output tokens
    counted from the SSE chunks and usage are exactly the ones asked for."""
    spec = {
        "name": "openai-kvserve", "seed": 3, "num_requests": 12,
        "prompt": {"source": "random", "len": 16},
        "output": {"len": {"type": "uniform", "min": 4, "max": 12}, "ignore_eos": True},
        "sampling": {"temperature": 0.0},
        "cancel": {"fraction": 0.25, "after_tokens": 2},
    }  # fmt: skip
    out = tmp_path / "report.json"
    workload = str(_write(tmp_path, spec))
    argv = ["--api", "openai", "--target", server.http_url, "--workload", workload,
            "--users", "3", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    specs = Workload.from_dict(spec).build(vocab_size=_vocab_size(server.target))
    ok = [s for s in specs if s.cancel_after_tokens is None]
    assert report["requests"]["by_code"] == {"CANCELLED": 3, "OK": 9}
    assert report["input_tokens_total"] == 12 * 16
    assert report["output_tokens_total"] == sum(s.max_tokens for s in ok) + 2 * 3
