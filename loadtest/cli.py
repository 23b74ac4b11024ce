"""``kvserve loadtest`` / ``python -m loadtest``: drive a kvserve gRPC server with a workload.

Examples::

    kvserve loadtest --address 127.0.0.1:50051 --workload chat128 --users 8 --num-requests 64
    kvserve loadtest --workload shared_prefix --mode open --rate 4 --burstiness 0.5 \\
        --metrics-url http://127.0.0.1:9400/metrics --out run.json
    kvserve loadtest --workload random_128_128 --sweep-rates 0.5,1,2 --num-requests 16 \\
        --ttft-slo-ms 1000 --itl-slo-ms 150 --plot-dir plots/ --out sweep.json

Every run and every point of a sweep sends its own ``cache_salt``, so no run hits prefix-cache
entries that another left (``--reuse-cache`` turns this off). The workload file schema is in
``loadtest/workload.py``; the JSON report's in ``loadtest/report.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    from server.client import CONNECT_TIMEOUT_S

    p = argparse.ArgumentParser(
        prog="kvserve loadtest",
        description="Load-test a kvserve gRPC server (open or closed loop) and report latency, "
        "throughput and goodput.",
    )
    p.add_argument(
        "--address",
        "--target",
        dest="target",
        metavar="HOST:PORT",
        default=None,
        help="server address: host:port, or http://HOST:PORT with --api openai "
        "(default: $KVSERVE_ADDRESS, else 127.0.0.1:50051)",
    )
    p.add_argument(
        "--api",
        choices=("grpc", "openai"),
        default="grpc",
        help="grpc: kvserve's gRPC service; openai: streaming POST /v1/completions on any "
        "OpenAI-compatible server, with --target http://HOST:PORT (default: grpc)",
    )
    p.add_argument(
        "--workload",
        default="random_128_128",
        help="workload JSON file, or the name of a shipped one in loadtest/workloads/ "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--mode",
        choices=("open", "closed"),
        default="closed",
        help="closed: --users requests in flight; open: arrivals at --rate (default: %(default)s)",
    )
    p.add_argument(
        "--rate", type=float, default=math.inf, help="open loop: requests/s (default: %(default)s)"
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="open loop: gamma shape of inter-arrival gaps; 1 = Poisson, < 1 burstier "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--users", type=int, default=1, help="closed loop: concurrent users (default: %(default)s)"
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="count bound of a run, per rate in a sweep (default: the workload's num_requests)",
    )
    p.add_argument(
        "--duration-s",
        type=float,
        default=600.0,
        help="time bound of a run, per rate in a sweep (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="override the workload's seed (default: its own)"
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=None,
        help="gRPC deadline per request (default: none)",
    )
    p.add_argument(
        "--connect-timeout-s",
        type=float,
        default=CONNECT_TIMEOUT_S,
        help="how long to wait for the server to answer before giving up (default: %(default)s)",
    )
    p.add_argument(
        "--ttft-slo-ms",
        "--slo-ttft-ms",
        dest="ttft_slo_ms",
        type=float,
        default=None,
        help="goodput: TTFT target, as the server's --ttft-slo-ms; --slo-ttft-ms is its old "
        "name (default: none)",
    )
    p.add_argument(
        "--itl-slo-ms",
        "--slo-tpot-ms",
        dest="itl_slo_ms",
        type=float,
        default=None,
        help="goodput: ITL target, as the server's --itl-slo-ms, judged on the time per output "
        "token after the first (TPOT); --slo-tpot-ms is its old name (default: none)",
    )
    p.add_argument(
        "--metrics-url",
        default=None,
        help="the server's /metrics URL for deltas (default: none; GetKVCacheStats instead)",
    )
    p.add_argument(
        "--sample-interval-s",
        type=float,
        default=1.0,
        help="KV usage sampling period (default: %(default)s)",
    )
    p.add_argument(
        "--sweep-rates",
        default=None,
        help="comma-separated offered rates (req/s): one open-loop run per rate (default: none)",
    )
    p.add_argument(
        "--reuse-cache",
        action="store_true",
        help="send no cache_salt, so a run may hit what earlier runs and sweep points left in "
        "the prefix cache (default: a fresh salt per run and per rate)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path("loadtest-results/report.json"),
        help="JSON report path (default: %(default)s)",
    )
    p.add_argument(
        "--plot-dir", type=Path, default=None, help="write PNG plots here (default: no plots)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_once(
    args: argparse.Namespace, workload: Any, rate: float | None, cache_salt: str | None
) -> tuple[Any, dict[str, Any]]:
    """One run; returns (RunResult, report dict)."""
    from loadtest.generator import LoadConfig, LoadGenerator
    from loadtest.report import build_report
    from loadtest.stats import SLO

    num_requests = args.num_requests or workload.num_requests
    open_loop = rate is not None or args.mode == "open"
    config = LoadConfig(
        target=args.target,
        mode="open" if open_loop else "closed",
        rate=rate if rate is not None else args.rate,
        burstiness=args.burstiness,
        users=args.users,
        num_requests=num_requests,
        duration_s=args.duration_s,
        seed=workload.seed,
        request_timeout_s=args.request_timeout_s,
        slo=SLO(
            ttft_s=None if args.ttft_slo_ms is None else args.ttft_slo_ms / 1000,
            tpot_s=None if args.itl_slo_ms is None else args.itl_slo_ms / 1000,
        ),
        metrics_url=args.metrics_url,
        sample_interval_s=args.sample_interval_s,
        progress=not args.no_progress,
        progress_desc=f"{workload.name} @ {rate:g} req/s" if rate is not None else workload.name,
        cache_salt=cache_salt,
        connect_timeout_s=args.connect_timeout_s,
        api=args.api,
    )
    run = asyncio.run(LoadGenerator(config, workload).run())
    return run, build_report(run, workload)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import grpc

    from loadtest.generator import new_cache_salt
    from loadtest.report import SWEEP_SCHEMA, format_summary, format_sweep
    from loadtest.workload import Workload, resolve_workload
    from server.client import NoServerError
    from server.config import client_address

    if args.api == "grpc":
        args.target = client_address(args.target)
    elif args.target is None:
        print("kvserve loadtest: --api openai needs --target http://HOST:PORT", file=sys.stderr)
        return 2

    try:
        workload = Workload.load(resolve_workload(args.workload))
        if args.seed is not None:
            workload = dataclasses.replace(workload, seed=args.seed)
        rates = (
            [float(x) for x in args.sweep_rates.split(",") if x.strip()]
            if args.sweep_rates
            else None
        )
        if rates is not None and (not rates or any(not r > 0 for r in rates)):
            raise ValueError(f"--sweep-rates needs rates > 0, got {args.sweep_rates!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"kvserve loadtest: {e}", file=sys.stderr)
        return 2

    runs = []
    reports = []
    # One salt per invocation and rate: "loadtest-<run>-<i>" names the sweep in the server.
    run_salt = None if args.reuse_cache else new_cache_salt()
    try:
        planned: list[float | None] = list(rates) if rates else [None]
        for i, rate in enumerate(planned):
            salt = None if run_salt is None else f"{run_salt}-{i}"
            run, report = run_once(args, workload, rate, salt)
            runs.append(run)
            reports.append(report)
            print(format_summary(report), flush=True)
            print(flush=True)
    except NoServerError as e:
        print(f"kvserve loadtest: {e}", file=sys.stderr)
        return 1
    except (TimeoutError, OSError, ValueError, grpc.RpcError) as e:
        print(f"kvserve loadtest: {type(e).__name__}: {e}", file=sys.stderr)
        return 1

    document: dict[str, Any] = (
        {"schema": SWEEP_SCHEMA, "runs": reports} if rates is not None else reports[0]
    )
    if rates is not None:
        print(format_sweep(reports))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    paths = [args.out]
    if args.plot_dir is not None:
        from loadtest.plots import plot_cdf, plot_sweep

        args.plot_dir.mkdir(parents=True, exist_ok=True)
        paths.append(plot_cdf(runs, reports, args.plot_dir / "latency_cdf.png"))
        if rates is not None:
            paths += plot_sweep(reports, args.plot_dir)
    for path in paths:
        print(f"wrote {path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
