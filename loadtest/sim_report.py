"""What a simulated run reports: per-request records, goodput ("met its targets" through
``scheduler.slo``), the JSON report of a run, the tables and the comparison of runs.

``sim_engine`` records into ``Track`` s and calls ``report``; ``simulate`` prints the tables.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cache_manager import KVCacheManager
from loadtest.stats import summarize
from loadtest.table import fixed_width_table
from scheduler import Scheduler, SchedulerConfig
from scheduler.slo import attained, time_per_output_token


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One simulated engine configuration."""

    name: str
    config: SchedulerConfig
    static_batching: bool = False


@dataclass(slots=True)
class Track:
    """What the simulator records for one request."""

    arrival_s: float
    num_prompt_tokens: int
    cancel_after: int | None
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class Recorded(Protocol):
    """What a simulated engine recorded (``sim_engine.SimEngine``)."""

    tracks: dict[str, Track]
    rejected: Counter[str]
    num_steps: int
    decode_rows: int
    usage_time: float
    max_usage: float
    sched: Scheduler
    kv: KVCacheManager


def _tpot(t: Track) -> float | None:
    times = t.token_times_s
    if not times:
        return None
    return time_per_output_token(times[0], times[-1], len(times) - 1)


def _goodput(done: Sequence[Track], ttft_target_s: float, itl_target_s: float) -> dict[str, Any]:
    """The share of finished requests that met both targets (``scheduler.slo.attained``), and
    of each target alone; cancelled requests are not judged."""
    judged = [t for t in done if t.finish_reason != "abort"]
    met = {"ttft": 0, "itl": 0, "both": 0}
    for t in judged:
        ttft = t.token_times_s[0] - t.arrival_s if t.token_times_s else None
        ttft_ok, itl_ok = attained(ttft, _tpot(t), ttft_target_s, itl_target_s)
        met["ttft"] += ttft_ok
        met["itl"] += itl_ok
        met["both"] += ttft_ok and itl_ok
    share = {k: v / len(judged) if judged else 0.0 for k, v in met.items()}
    return {
        "ttft_target_s": ttft_target_s,
        "itl_target_s": itl_target_s,
        "judged": len(judged),
        "attained": share,
        "goodput": share["both"],
    }


def report(run: RunSpec, engines: Sequence[Recorded]) -> dict[str, Any]:
    tracks = {rid: t for e in engines for rid, t in e.tracks.items()}
    rejected: Counter[str] = sum((e.rejected for e in engines), Counter())
    num_steps = sum(e.num_steps for e in engines)
    decode_rows = sum(e.decode_rows for e in engines)
    done = [t for t in tracks.values() if t.finished_s is not None]
    start_s = min((t.arrival_s for t in tracks.values()), default=0.0)
    end_s = max((t.finished_s for t in done if t.finished_s is not None), default=start_s)
    duration_s = end_s - start_s
    num_output = sum(len(t.token_times_s) for t in done)
    num_prompt = sum(t.num_prompt_tokens for t in done)
    ttft = [t.token_times_s[0] - t.arrival_s for t in done if t.token_times_s]
    itl = [b - a for t in done for a, b in zip(t.token_times_s, t.token_times_s[1:], strict=False)]
    tpot = [x for t in done if (x := _tpot(t)) is not None]
    e2e = [t.finished_s - t.arrival_s for t in done if t.finished_s is not None]
    queue = [t.first_scheduled_s - t.arrival_s for t in done if t.first_scheduled_s is not None]
    all_stats = [e.sched.make_stats() for e in engines]
    hits = sum(s.kv.prefix_hits_tokens_total for s in all_stats)
    tier2_hits = sum(s.kv.tier2_hit_tokens_total for s in all_stats)
    queries = sum(s.kv.prefix_queries_tokens_total for s in all_stats)
    goodput = _goodput(done, run.config.ttft_slo_s, run.config.itl_slo_s)

    def per_s(count: int) -> float:
        return count / duration_s if duration_s > 0 else 0.0

    return {
        "name": run.name,
        "mode": "static" if run.static_batching else "continuous",
        "policy": run.config.policy,
        "budget": run.config.max_num_batched_tokens,
        "num_requests": len(tracks) + sum(rejected.values()),
        "num_finished": len(done),
        "num_rejected": dict(rejected),
        "finish_reasons": dict(Counter(t.finish_reason for t in done if t.finish_reason)),
        "duration_s": duration_s,
        "num_prompt_tokens": num_prompt,
        "num_output_tokens": num_output,
        "throughput": {
            "output_tokens_per_s": per_s(num_output),
            "total_tokens_per_s": per_s(num_output + num_prompt),
            "requests_per_s": per_s(len(done)),
        },
        "slo": goodput,
        # Requests per second that met both targets (the share above times the finish rate).
        "goodput_requests_per_s": goodput["goodput"] * per_s(goodput["judged"]),
        "ttft_s": summarize(ttft),
        "itl_s": summarize(itl),
        "tpot_s": summarize(tpot),
        "e2e_s": summarize(e2e),
        "queue_s": summarize(queue),
        "preemptions": sum(s.num_preemptions_total for s in all_stats),
        "recomputed_tokens": sum(s.num_recomputed_tokens_total for s in all_stats),
        "steps": {
            "total": num_steps,
            "with_prefill": sum(s.num_steps_prefill_total for s in all_stats),
            "with_decode": sum(s.num_steps_decode_total for s in all_stats),
            "mean_decode_batch": decode_rows / num_steps if num_steps else 0.0,
        },
        "kv": {
            "num_blocks": engines[0].kv.num_blocks,
            "block_size": engines[0].kv.block_size,
            # Per replica, averaged over replicas.
            "mean_usage": (
                sum(e.usage_time for e in engines) / len(engines) / duration_s
                if duration_s > 0
                else 0.0
            ),
            "max_usage": max(e.max_usage for e in engines),
            "prefix_hit_rate": hits / queries if queries else 0.0,  # tier 1 and tier 2
            "tier2_hit_rate": tier2_hits / queries if queries else 0.0,
            "evictions": sum(s.kv.evictions_total for s in all_stats),
        },
    }


def _fmt_ms(summary: dict[str, float | int | None], key: str) -> str:
    value = summary.get(key)
    return "-" if value is None else f"{float(value) * 1e3:.1f}"


Column = tuple[str, Callable[[dict[str, Any]], str]]  # a header and how to show a run


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    columns: list[Column] = [
        ("run", lambda r: str(r["name"])),
        ("done", lambda r: str(r["num_finished"])),
        ("tok/s", lambda r: f"{r['throughput']['output_tokens_per_s']:.0f}"),
        ("req/s", lambda r: f"{r['throughput']['requests_per_s']:.2f}"),
        ("TTFT p50", lambda r: _fmt_ms(r["ttft_s"], "p50")),
        ("TTFT p99", lambda r: _fmt_ms(r["ttft_s"], "p99")),
        ("ITL p50", lambda r: _fmt_ms(r["itl_s"], "p50")),
        ("ITL p99", lambda r: _fmt_ms(r["itl_s"], "p99")),
        ("e2e p50", lambda r: _fmt_ms(r["e2e_s"], "p50")),
        ("e2e p99", lambda r: _fmt_ms(r["e2e_s"], "p99")),
        ("preempt", lambda r: str(r["preemptions"])),
        ("KV mean", lambda r: f"{r['kv']['mean_usage']:.0%}"),
        ("KV max", lambda r: f"{r['kv']['max_usage']:.0%}"),
        ("hit", lambda r: f"{r['kv']['prefix_hit_rate']:.0%}"),
        ("goodput", lambda r: f"{r['slo']['goodput']:.1%}"),
    ]
    return _render(columns, runs, 1) + "\n(latencies in ms; tok/s = output tokens per second)"


def _render(columns: Sequence[Column], runs: Sequence[dict[str, Any]], num_left: int) -> str:
    return fixed_width_table(
        [name for name, _ in columns], [[get(r) for _, get in columns] for r in runs], num_left
    )


def compare(runs: Sequence[dict[str, Any]]) -> dict[str, float | None]:
    """Continuous/static throughput ratio and stall-free/prefill-first p99 ITL ratio."""
    by_name = {r["name"]: r for r in runs}
    static = by_name.get("static")
    pf = by_name.get("continuous prefill-first")
    sf = by_name.get("continuous stall-free")
    out: dict[str, float | None] = {}
    if static and sf and static["throughput"]["output_tokens_per_s"]:
        out["continuous_over_static_throughput"] = (
            sf["throughput"]["output_tokens_per_s"] / static["throughput"]["output_tokens_per_s"]
        )
    if static and pf and static["throughput"]["output_tokens_per_s"]:
        out["prefill_first_over_static_throughput"] = (
            pf["throughput"]["output_tokens_per_s"] / static["throughput"]["output_tokens_per_s"]
        )
    if pf and sf and pf["itl_s"]["p99"]:
        out["stall_free_over_prefill_first_itl_p99"] = sf["itl_s"]["p99"] / pf["itl_s"]["p99"]
    slo = by_name.get("continuous slo")
    if slo:
        for r in runs:
            if r["policy"] == "stall-free" and r["mode"] == "continuous":
                budget = r["budget"]
                out[f"slo_minus_stall_free_{budget}_goodput"] = (
                    slo["slo"]["goodput"] - r["slo"]["goodput"]
                )
    return out


def format_cluster_table(runs: Sequence[dict[str, Any]]) -> str:
    """One row per (replicas, router): goodput, TTFT, prefix-hit rate, throughput."""
    columns: list[Column] = [
        ("replicas", lambda r: str(r["replicas"])),
        ("router", lambda r: str(r["router"])),
        ("goodput req/s", lambda r: f"{r['goodput_requests_per_s']:.2f}"),
        ("req/s", lambda r: f"{r['throughput']['requests_per_s']:.2f}"),
        ("TTFT p50", lambda r: _fmt_ms(r["ttft_s"], "p50")),
        ("TTFT p99", lambda r: _fmt_ms(r["ttft_s"], "p99")),
        ("TPOT p50", lambda r: _fmt_ms(r["tpot_s"], "p50")),
        ("hit", lambda r: f"{r['kv']['prefix_hit_rate']:.0%}"),
        ("tier 2", lambda r: f"{r['kv']['tier2_hit_rate']:.0%}"),
        ("evictions", lambda r: str(r["kv"]["evictions"])),
    ]
    note = (
        "\n(latencies in ms; hit = prefix-cache hit rate over all replicas, of which tier 2 "
        "= restored from the shared tier)"
    )
    return _render(columns, runs, 2) + note
