"""kvserve simulate: the JSON report, request accounting, static vs continuous semantics."""

from __future__ import annotations

import json
import math
from pathlib import Path

from loadtest.simulate import (
    DEFAULT_WORKLOAD,
    RunSpec,
    main,
    simulate,
)
from loadtest.stats import percentile
from loadtest.workload import RequestSpec, Workload, arrival_offsets
from model_runner.sim import get_profile
from scheduler import SchedulerConfig

SUMMARY_KEYS = {"count", "mean", "p50", "p90", "p99", "min", "max"}
RUN_KEYS = {
    "name",
    "mode",
    "policy",
    "budget",
    "slo",
    "num_requests",
    "num_finished",
    "num_rejected",
    "finish_reasons",
    "duration_s",
    "goodput_requests_per_s",
    "num_prompt_tokens",
    "num_output_tokens",
    "throughput",
    "ttft_s",
    "itl_s",
    "tpot_s",
    "e2e_s",
    "queue_s",
    "preemptions",
    "recomputed_tokens",
    "steps",
    "kv",
}


def test_compare_writes_a_json_report_for_every_run(tmp_path: Path) -> None:
    """--compare on 12 requests: five runs (static, both continuous policies, stall-free at
    the other budget, slo), each finishing all 12 with every output token (ignore_eos:
    max_tokens each) and one ITL sample per token after the first."""
    path = tmp_path / "sim.json"
    argv = [
        "--profile=cpu-smollm2-135m-fp32",
        "--num-requests=12",
        "--rate=4",
        "--compare",
        "--max-num-seqs=4",
        "--max-num-batched-tokens=256",
        "--budgets=512",
        f"--json={path}",
    ]
    assert main(argv) == 0
    report = json.loads(path.read_text())
    assert set(report) == {
        "profile",
        "workload",
        "num_requests",
        "arrivals",
        "kv",
        "config",
        "runs",
        "comparison",
    }
    assert report["num_requests"] == 12 and report["arrivals"]["rate"] == 4.0
    specs = Workload.from_dict(DEFAULT_WORKLOAD).build(12, vocab_size=49152)
    num_output = sum(s.max_tokens for s in specs)
    assert [r["name"] for r in report["runs"]] == [
        "static",
        "continuous prefill-first",
        "continuous stall-free",
        "stall-free budget 512",
        "continuous slo",
    ]
    budgets = {r["name"]: r["budget"] for r in report["runs"]}
    assert budgets["stall-free budget 512"] == 512 and budgets["continuous slo"] == 512
    for run in report["runs"]:
        assert set(run) == RUN_KEYS
        assert (run["num_requests"], run["num_finished"], run["num_rejected"]) == (12, 12, {})
        assert run["finish_reasons"] == {"length": 12}
        assert run["num_output_tokens"] == num_output
        assert run["num_prompt_tokens"] == sum(s.num_prompt_tokens or 0 for s in specs)
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s", "queue_s"):
            assert set(run[key]) == SUMMARY_KEYS
        assert run["ttft_s"]["count"] == 12 and run["itl_s"]["count"] == num_output - 12
        assert run["steps"]["total"] >= run["steps"]["with_decode"] > 0
        goodput = run["slo"]
        assert goodput["judged"] == 12 and 0.0 <= goodput["goodput"] <= 1.0
        assert goodput["goodput"] <= min(goodput["attained"]["ttft"], goodput["attained"]["itl"])
    assert set(report["comparison"]) == {
        "continuous_over_static_throughput",
        "prefill_first_over_static_throughput",
        "stall_free_over_prefill_first_itl_p99",
        "slo_minus_stall_free_256_goodput",
        "slo_minus_stall_free_512_goodput",
    }


def test_cancelled_requests_are_aborted_after_their_tokens(tmp_path: Path) -> None:
    """The priority_cancel workload cancels round(0.1 * 20) = 2 of 20 requests mid-stream."""
    path = tmp_path / "sim.json"
    workload = Path(__file__).parents[2] / "loadtest" / "workloads" / "priority_cancel.json"
    argv = [
        f"--workload={workload}",
        "--num-requests=20",
        "--queue-order=priority",
        f"--json={path}",
    ]
    assert main(argv) == 0
    (run,) = json.loads(path.read_text())["runs"]
    assert run["finish_reasons"] == {"length": 18, "abort": 2}


def test_static_batching_admits_nothing_while_a_batch_runs() -> None:
    """Two seats; a (10 tokens), b and c (2 tokens each) arrive together. Static: c starts
    only after a ends, so its TTFT (the largest) exceeds a's e2e (the median). Continuous:
    c takes b's seat at once, so every TTFT is below a's e2e."""
    profile = get_profile("h100-llama3-8b-bf16")
    specs = [
        RequestSpec(i, None, tuple(range(100 * i, 100 * i + 32)), max_tokens=n, ignore_eos=True)
        for i, n in enumerate([10, 2, 2])
    ]
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=256)
    reports = {
        static: simulate(
            RunSpec("run", config, static_batching=static),
            profile,
            specs,
            [0.0, 0.0, 0.0],
            num_blocks=64,
        )
        for static in (True, False)
    }
    static, continuous = reports[True], reports[False]
    assert static["ttft_s"]["max"] > static["e2e_s"]["p50"]
    assert continuous["ttft_s"]["max"] < continuous["e2e_s"]["p50"]
    assert static["num_output_tokens"] == continuous["num_output_tokens"] == 14


def test_arrivals_and_percentiles() -> None:
    """Infinite rate: all at 0; finite: seeded, increasing; percentiles interpolate."""
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    times = arrival_offsets(50, 10.0, 0.5, 7)
    assert times == arrival_offsets(50, 10.0, 0.5, 7) and times == sorted(times)
    assert times[0] == 0.0 and times != arrival_offsets(50, 10.0, 0.5, 8)
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == 4.6
    assert percentile([], 50) is None


def test_acceptance_on_1000_requests_with_the_h100_profile(tmp_path: Path) -> None:
    """Issue 3's acceptance, in one --compare run (virtual time, so deterministic):
    continuous batching >= 2x static throughput; stall-free has a lower p99 ITL."""
    path = tmp_path / "sim.json"
    assert main(["--compare", "--num-requests=1000", f"--json={path}"]) == 0
    ratios = json.loads(path.read_text())["comparison"]
    assert ratios["continuous_over_static_throughput"] >= 2.0
    assert ratios["prefill_first_over_static_throughput"] >= 2.0
    assert ratios["stall_free_over_prefill_first_itl_p99"] < 1.0
