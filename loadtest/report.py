"""The report of a run: a JSON document (schema below) and a plain-text summary table.

JSON schema ``kvserve.loadtest/v1`` (one run; every key always present, null when unknown)::

    {
      "schema": "kvserve.loadtest/v1",
      "workload": {...Workload.describe()...},
      "load": {"api", "target", "mode", "rate", "burstiness", "users", "num_requests",
               "duration_s", "seed", "request_timeout_s", "metrics_url", "reuse_cache",
               "cache_salt"},
      "requests": {"planned", "sent", "ok", "cancelled", "failed", "interrupted",
                   "not_sent", "by_code": {"OK": n, "RESOURCE_EXHAUSTED": n, ...}},
      "duration_s": float,                 # first send to last stream end
      "request_throughput_rps": float,     # ok requests / duration
      "output_token_throughput_tps": float,  # every output token received / duration
      "input_tokens_total": int, "output_tokens_total": int, "cached_prompt_tokens_total": int,
      "latency_s": {"ttft"|"itl"|"tpot"|"e2e":
                    {"count", "mean", "p50", "p90", "p99", "min", "max"}},
      "goodput": {"slo_ttft_s", "slo_tpot_s", "num_ok_within_slo", "fraction_within_slo",
                  "goodput_rps"},
      "by_priority": {"<priority>": {"count", "ok", "ttft_p50_s", "ttft_p99_s",
                                     "num_ok_within_slo", "fraction_within_slo"}},
      "server": null | {"source", "prefix_queries_tokens", "prefix_hits_tokens",
                        "prefix_hit_rate", "preemptions", "kv_usage_peak",
                        "num_usage_samples", "counter_deltas"}
    }

``by_code`` counts every request sent by how it ended: ``OK``, a gRPC status code name,
``CANCELLED`` (cancelled by the load generator on purpose), ``INTERRUPTED`` (cut by the time
bound), ``FINISH_REASON_ERROR`` / ``FINISH_REASON_ABORT`` (the stream ended with that finish
reason) or ``INCOMPLETE_STREAM`` (ended without a finish message); with ``api`` "openai"
also ``HTTP_<status>``, ``SERVER_ERROR``, ``DEADLINE_EXCEEDED``, ``UNAVAILABLE`` or
``BAD_STREAM`` (``loadtest/openai_backend.py``).
``reuse_cache`` is false when every request of the run carried ``cache_salt`` (the default: a
salt of its own per run and per sweep point, so no run hits what another cached) and true
with ``--reuse-cache`` (no salt; ``cache_salt`` null). ``goodput`` counts every OK request
when neither SLO is set (both limits null); the summary then says "no SLO set".
A rate sweep writes ``{"schema": "kvserve.loadtest.sweep/v1", "runs": [<run>, ...]}``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from loadtest.generator import RunResult
from loadtest.stats import Outcome, latency_summary, percentile
from loadtest.workload import Workload

SCHEMA = "kvserve.loadtest/v1"
SWEEP_SCHEMA = "kvserve.loadtest.sweep/v1"


def build_report(run: RunResult, workload: Workload) -> dict[str, Any]:
    results = run.results
    outcomes = Counter(r.outcome for r in results)
    duration = run.end_s - run.start_s
    ok = [r for r in results if r.outcome == Outcome.OK]
    slo = run.config.slo
    within = sum(1 for r in ok if slo.met_by(r))
    output_tokens = sum(r.num_output_tokens for r in results)
    by_priority: dict[str, dict[str, Any]] = {}
    for prio in sorted({r.priority for r in results}):
        group = [r for r in results if r.priority == prio]
        ttfts = [t for r in group if r.outcome == Outcome.OK and (t := r.ttft_s) is not None]
        group_within = sum(1 for r in group if slo.met_by(r))
        by_priority[str(prio)] = {
            "count": len(group),
            "ok": sum(1 for r in group if r.outcome == Outcome.OK),
            "ttft_p50_s": percentile(ttfts, 50.0),
            "ttft_p99_s": percentile(ttfts, 99.0),
            "num_ok_within_slo": group_within,
            "fraction_within_slo": group_within / len(group),
        }
    return {
        "schema": SCHEMA,
        "workload": workload.describe(),
        "load": run.config.describe(),
        "requests": {
            "planned": run.num_planned,
            "sent": len(results),
            "ok": outcomes[Outcome.OK],
            "cancelled": outcomes[Outcome.CANCELLED],
            "failed": outcomes[Outcome.FAILED],
            "interrupted": outcomes[Outcome.INTERRUPTED],
            "not_sent": run.num_planned - len(results),
            "by_code": dict(sorted(Counter(r.code for r in results).items())),
        },
        "duration_s": duration,
        "request_throughput_rps": len(ok) / duration if duration > 0 else 0.0,
        "output_token_throughput_tps": output_tokens / duration if duration > 0 else 0.0,
        "input_tokens_total": sum(r.num_prompt_tokens for r in results),
        "output_tokens_total": output_tokens,
        "cached_prompt_tokens_total": sum(r.num_cached_tokens for r in results),
        "latency_s": latency_summary(results),
        "goodput": {
            "slo_ttft_s": slo.ttft_s,
            "slo_tpot_s": slo.tpot_s,
            "num_ok_within_slo": within,
            "fraction_within_slo": within / len(results) if results else 0.0,
            "goodput_rps": within / duration if duration > 0 else 0.0,
        },
        "by_priority": by_priority,
        "server": run.server,
    }


def _ms(x: float | int | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f}"


def slo_text(goodput: dict[str, Any]) -> str | None:
    """The SLO limits that are set, e.g. "TTFT <= 500.0 ms, TPOT <= 50.0 ms"; None if none."""
    limits = [
        f"{label} <= {_ms(goodput[key])} ms"
        for key, label in (("slo_ttft_s", "TTFT"), ("slo_tpot_s", "TPOT"))
        if goodput[key] is not None
    ]
    return ", ".join(limits) if limits else None


def cache_text(load: dict[str, Any]) -> str:
    """Whether the run could hit prefix-cache entries that earlier runs left."""
    if load["reuse_cache"]:
        return "prefix cache: shared with earlier runs (--reuse-cache: no cache_salt)"
    return f"prefix cache: isolated from other runs (cache_salt {load['cache_salt']})"


def format_summary(report: dict[str, Any]) -> str:
    """A fixed-width summary of one run (what the CLI prints at the end)."""
    req = report["requests"]
    load = report["load"]
    shape = (
        f"closed loop, {load['users']} users"
        if load["mode"] == "closed"
        else f"open loop, {load['rate'] or 'inf'} req/s (burstiness {load['burstiness']})"
    )
    codes = ", ".join(f"{k}={v}" for k, v in req["by_code"].items())
    lines = [
        f"workload {report['workload']['name']} -> {load['target']} ({shape})",
        f"requests: {req['sent']}/{req['planned']} sent, ok {req['ok']}, cancelled "
        f"{req['cancelled']}, failed {req['failed']}, interrupted {req['interrupted']} [{codes}]",
        f"duration {report['duration_s']:.2f} s | {report['request_throughput_rps']:.2f} req/s | "
        f"{report['output_token_throughput_tps']:.1f} output tok/s",
        "",
        f"{'latency (ms)':<14}{'count':>7}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    for name, label in (("ttft", "TTFT"), ("itl", "inter-token"), ("tpot", "TPOT"), ("e2e", "e2e")):
        s = report["latency_s"][name]
        lines.append(
            f"{label:<14}{s['count']:>7}{_ms(s['mean']):>10}{_ms(s['p50']):>10}"
            f"{_ms(s['p90']):>10}{_ms(s['p99']):>10}{_ms(s['max']):>10}"
        )
    g = report["goodput"]
    slo = slo_text(g)
    lines.append("")
    if slo is None:
        lines.append("goodput: no SLO set (--ttft-slo-ms, --itl-slo-ms)")
    else:
        lines.append(
            f"goodput ({slo}): {g['goodput_rps']:.2f} req/s, "
            f"{g['num_ok_within_slo']}/{req['sent']} within SLO"
        )
        by_priority = report["by_priority"]
        if len(by_priority) > 1:
            lines.append(
                "  by priority: "
                + ", ".join(
                    f"{prio}: {e['num_ok_within_slo']}/{e['count']}"
                    for prio, e in by_priority.items()
                )
            )
    lines.append(cache_text(load))
    srv = report["server"]
    if srv is not None:
        rate = srv["prefix_hit_rate"]
        peak = srv["kv_usage_peak"]
        lines.append(
            f"server ({srv['source']}): prefix hit rate "
            f"{'-' if rate is None else f'{rate:.1%}'}, preemptions "
            f"{'-' if srv['preemptions'] is None else int(srv['preemptions'])}, KV usage peak "
            f"{'-' if peak is None else f'{peak:.1%}'}"
        )
    return "\n".join(lines)


def format_sweep(reports: list[dict[str, Any]]) -> str:
    """One line per offered rate; the goodput column only when an SLO is set."""
    slo = slo_text(reports[0]["goodput"])
    lines = [
        f"{'rate':>8}{'req/s':>9}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}{'e2e p99':>10}{'goodput':>9}{'failed':>8}"
    ]
    for r in reports:
        lat = r["latency_s"]
        rate = r["load"]["rate"]
        goodput = "-" if slo is None else f"{r['goodput']['goodput_rps']:.2f}"
        lines.append(
            f"{'inf' if rate is None else f'{rate:g}':>8}{r['request_throughput_rps']:>9.2f}"
            f"{r['output_token_throughput_tps']:>9.1f}{_ms(lat['ttft']['p50']):>10}"
            f"{_ms(lat['ttft']['p99']):>10}{_ms(lat['tpot']['p50']):>10}"
            f"{_ms(lat['tpot']['p99']):>10}{_ms(lat['e2e']['p99']):>10}"
            f"{goodput:>9}{r['requests']['failed']:>8}"
        )
    note = "no SLO set, no goodput" if slo is None else f"goodput: req/s within {slo}"
    lines.append(f"(latencies in ms; {note})")
    if reports[0]["load"]["reuse_cache"]:
        lines.append("(prefix cache shared across rates: --reuse-cache)")
    else:
        lines.append("(prefix cache isolated: a cache_salt of its own per rate)")
    return "\n".join(lines)
