"""Async scheduling on and off, side by side: ``kvserve serve --async-scheduling on|off`` on the
embedded model, under the load tester's chat128 workload (closed loop), A B A B on fresh servers.

    python -m benchmarks.bench_async_scheduling [--users 1,8] [--requests 8,16] [--rounds 2]

Every run gets a fresh server (``bench_serving.measure``: no prefix cache carried over, a
two-request warm-up). The runs of one user count alternate on and off, so a machine whose
load drifts over the minutes hits both alike; each pair gives a ratio (on / off) of output
tok/s and of ITL p50 / p99, and the table prints every pair's ratios and their median. On CPU,
``on`` runs the model's steps on a thread of their own (``TorchRunner.use_step_thread``).
Prints a table and the CPU model; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from benchmarks import bench_serving
from benchmarks.bench_models import DEFAULT_CHAT128
from benchmarks.run_all import machine_info


def run(
    users: int, rounds: int, num_requests: int, output_tokens: int, chat128: Path, extra: list[str]
) -> list[dict[str, Any]]:
    """``rounds`` pairs of runs at ``users``, on then off; one row per run."""
    workload = bench_serving.chat128_workload(chat128, num_requests, output_tokens)
    rows = []
    for r in range(rounds):
        for mode in ("on", "off"):
            report = bench_serving.measure(
                ["--async-scheduling", mode, *extra],
                workload,
                users=users,
                num_requests=num_requests,
                duration_s=900,
                desc=f"{users} users, async {mode}, round {r + 1}",
            )
            itl = report["latency_s"]["itl"]
            rows.append(
                {
                    "users": users,
                    "round": r + 1,
                    "async": mode,
                    "tok_s": report["output_token_throughput_tps"],
                    "itl_p50_ms": itl["p50"] * 1e3,
                    "itl_p99_ms": itl["p99"] * 1e3,
                    "ok": report["requests"]["ok"],
                }
            )
    return rows


def ratios(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per pair (same users and round), on / off of each figure."""
    out: dict[str, list[float]] = {"tok_s": [], "itl_p50_ms": [], "itl_p99_ms": []}
    by_key = {(r["users"], r["round"], r["async"]): r for r in rows}
    for (users, rnd, mode), on in by_key.items():
        if mode != "on":
            continue
        off = by_key[(users, rnd, "off")]
        for key in out:
            out[key].append(on[key] / off[key])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", default="1,8", help="comma-separated user counts")
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs per user count")
    parser.add_argument(
        "--requests", default="8,16", help="requests per run, one count per --users entry"
    )
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--chat128", type=Path, default=DEFAULT_CHAT128)
    parser.add_argument("--threads", type=int, default=None, help="--threads of the server")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    extra = ["--threads", str(args.threads)] if args.threads else []
    machine = machine_info(args.threads or 0)
    print(f"CPU: {machine['cpu']} ({machine['logical_cpus']} logical CPUs)", flush=True)
    table: list[dict[str, Any]] = []
    user_counts = [int(u) for u in args.users.split(",")]
    request_counts = [int(n) for n in args.requests.split(",")]
    if len(request_counts) != len(user_counts):
        parser.error("--requests needs one count per --users entry")
    for users, num_requests in zip(user_counts, request_counts, strict=True):
        rows = run(users, args.rounds, num_requests, args.output_tokens, args.chat128, extra)
        table.extend(rows)
        for row in rows:
            print(
                f"users {row['users']:>3}  round {row['round']}  async {row['async']:<3}  "
                f"{row['tok_s']:8.1f} tok/s  ITL p50 {row['itl_p50_ms']:7.1f} ms  "
                f"p99 {row['itl_p99_ms']:7.1f} ms  ({row['ok']} ok)",
                flush=True,
            )
        pairs = ratios(rows)
        print(
            f"users {users}: on/off  tok/s {_fmt(pairs['tok_s'])}  "
            f"ITL p50 {_fmt(pairs['itl_p50_ms'])}  ITL p99 {_fmt(pairs['itl_p99_ms'])}",
            flush=True,
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine, "rows": table}, indent=2))
    return 0


def _fmt(values: list[float]) -> str:
    pairs = " ".join(f"{v:.3f}" for v in values)
    return f"{statistics.median(values):.3f}x (pairs: {pairs})"


if __name__ == "__main__":
    raise SystemExit(main())
