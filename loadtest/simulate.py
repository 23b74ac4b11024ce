"""``kvserve simulate``: replay a workload through the real scheduler on a simulated GPU.

The real ``Scheduler`` and ``KVCacheManager`` run unchanged; the model is a ``SimRunner``
(a roofline cost model of a named GPU + model, ``model_runner/sim.py``) on a virtual clock,
so 1,000 requests on an H100 take seconds on a laptop CPU.

    kvserve simulate                                   # 1,000 requests, H100 x Llama-3-8B
    kvserve simulate --compare --json sim.json         # static, continuous, budgets, slo
    kvserve simulate --workload loadtest/workloads/shared_prefix.json --rate 20 --burstiness 0.5

Arrivals are open-loop: Poisson at ``--rate`` requests/s, or bursty (gamma inter-arrival
times with shape ``--burstiness`` < 1; 1 is Poisson), or all at once (``--rate inf``).
Prompt/output lengths, shared prefixes, priorities and cancellations come from a workload
file (``loadtest/workload.py`` schema, random-token prompts) or the built-in mix.

Reported per run: throughput (output tokens/s, requests/s), TTFT, inter-token latency (ITL,
every gap between two tokens of a request), time per output token, end-to-end latency and
queueing time percentiles, preemptions and recomputed tokens, steps by kind, KV usage (mean
over time, max) and the prefix-cache hit rate; as a table and as JSON (``--json``).

``--static-batching`` is the baseline continuous batching replaced: the engine takes up to
``max_num_seqs`` waiting requests, runs them until the longest ends (finished ones keep
their row, costed as padding), and only then admits more. ``--compare`` runs, on the same
arrivals and in one invocation: static batching; continuous batching under
``prefill-first`` and ``stall-free``; ``stall-free`` at each other token budget of
``--budgets``; and the ``slo`` policy; then prints the ratios.

The engine and its drivers are ``loadtest.sim_engine``; the report, tables and comparison
``loadtest.sim_report``; this module is the CLI. The built-in workload is
``loadtest/workloads/sim_mix.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from cluster.routing import ROUTERS
from loadtest.sim_engine import RunSpec, simulate, simulate_cluster
from loadtest.sim_report import compare, format_cluster_table, format_table
from loadtest.workload import Workload, arrival_offsets, resolve_workload
from model_runner.sim import PROFILES, SimProfile, get_profile
from scheduler import SchedulerConfig
from scheduler.config import POLICIES

DEFAULT_WORKLOAD: dict[str, Any] = json.loads(resolve_workload("sim_mix").read_text())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvserve simulate",
        description="Replay a workload through the real scheduler + KV cache manager on a "
        "simulated GPU (roofline cost model, virtual clock).",
    )
    parser.add_argument("--profile", default="h100-llama3-8b-bf16", choices=sorted(PROFILES))
    parser.add_argument(
        "--workload",
        help="workload JSON (loadtest schema) or a shipped name (tenants, shared_prefix, ...); "
        "default: built-in",
    )
    parser.add_argument("--num-requests", type=int, help="default: the workload's count")
    parser.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf = all at 0)")
    parser.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times"
    )
    parser.add_argument("--seed", type=int, default=0, help="arrival-time seed")
    parser.add_argument("--policy", default="stall-free", choices=list(POLICIES))
    parser.add_argument("--itl-slo-ms", type=float, default=150.0, help="ITL target (goodput)")
    parser.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="TTFT target")
    parser.add_argument(
        "--budgets",
        default="512,2048,8192",
        help="--compare: the stall-free token budgets the slo policy is held against",
    )
    parser.add_argument("--queue-order", default="fcfs", choices=["fcfs", "priority"])
    parser.add_argument("--memory-mode", default="optimistic", choices=["optimistic", "reserve"])
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--long-prefill-token-threshold", type=int, default=512)
    parser.add_argument("--max-decode-starvation-steps", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-gib", type=float, help="KV pool size; default: the profile's")
    parser.add_argument("--no-prefix-caching", action="store_true")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--static-batching", action="store_true", help="the static baseline")
    mode.add_argument(
        "--compare",
        action="store_true",
        help="static, continuous prefill-first and stall-free, stall-free at each --budgets "
        "budget, and slo, on the same arrivals",
    )
    parser.add_argument("--json", dest="json_path", help="write the full report here")
    cluster = parser.add_argument_group(
        "replicas", "many engines behind a router (kvserve cluster serve's routers)"
    )
    cluster.add_argument(
        "--replicas",
        type=_int_list,
        help="replica counts to simulate, e.g. 1,2,4,8,16; --rate and --num-requests are then "
        "per replica (the offered load grows with the replicas)",
    )
    cluster.add_argument(
        "--router",
        type=_router_list,
        default=list(ROUTERS),
        help=f"routers to compare, comma-separated (default: {','.join(ROUTERS)})",
    )
    cluster.add_argument(
        "--kv-tier-gib",
        type=float,
        default=0.0,
        help="a KV tier 2 of this size shared by the replicas (0: none)",
    )
    cluster.add_argument(
        "--kv-tier-gbps",
        type=float,
        default=6.0,
        help="tier 2 read bandwidth, GB/s, to the KV pool (default %(default)s: an NVMe "
        "drive; ~25 for host memory over PCIe)",
    )
    return parser


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts like 1,2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"replica counts must be >= 1, got {text!r}")
    return values


def _router_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in ROUTERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown router {', '.join(unknown) or text!r}; choose from {', '.join(ROUTERS)}"
        )
    return names


def _load_workload(path: str | None) -> Workload:
    workload = Workload.load(resolve_workload(path or "sim_mix"))  # a shipped name or a path
    if workload.prompt_source != "random":
        raise ValueError(
            f"workload {path}: the simulator needs token prompts (prompt.source 'random'); "
            f"text prompts need a tokenizer"
        )
    return workload


def _run_specs(args: argparse.Namespace) -> list[RunSpec]:
    base = SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=get_profile(args.profile).model.max_model_len,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        policy=args.policy,
        max_decode_starvation_steps=args.max_decode_starvation_steps,
        queue_order=args.queue_order,
        memory_mode=args.memory_mode,
        max_waiting_requests=1_000_000,
        max_waiting_tokens=1_000_000_000,
        itl_slo_ms=args.itl_slo_ms,
        ttft_slo_ms=args.ttft_slo_ms,
    )

    def with_policy(policy: str, **changes: Any) -> SchedulerConfig:
        return replace(base, policy=policy, **changes)

    if args.compare:
        budgets = [int(b) for b in str(args.budgets).split(",") if b]
        # The budget is the slo policy's ceiling only: give it the largest.
        ceiling = max([base.max_num_batched_tokens, *budgets])
        return [
            RunSpec("static", base, static_batching=True),
            RunSpec("continuous prefill-first", with_policy("prefill-first")),
            RunSpec("continuous stall-free", with_policy("stall-free")),
            *(
                RunSpec(
                    f"stall-free budget {b}",
                    with_policy(
                        "stall-free",
                        max_num_batched_tokens=b,
                        long_prefill_token_threshold=min(b, base.long_prefill_token_threshold)
                        if base.long_prefill_token_threshold
                        else 0,
                    ),
                )
                for b in budgets
                if b != base.max_num_batched_tokens
            ),
            RunSpec(
                "continuous slo",
                with_policy("slo", max_num_batched_tokens=ceiling, long_prefill_token_threshold=0),
            ),
        ]
    if args.static_batching:
        return [RunSpec("static", base, static_batching=True)]
    return [RunSpec(f"continuous {base.policy}", base)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        workload = _load_workload(args.workload)
        profile = get_profile(args.profile)
        runs = _run_specs(args)
        if args.replicas and (args.compare or args.static_batching):
            raise ValueError("--replicas simulates continuous batching: drop --compare/--static")
    except (OSError, ValueError) as exc:
        print(f"kvserve simulate: {exc}", file=sys.stderr)
        return 2
    num_requests = args.num_requests or workload.num_requests
    kv_bytes = int(args.kv_gib * 2**30) if args.kv_gib is not None else profile.kv_budget_bytes
    num_blocks = kv_bytes // (profile.model.kv_bytes_per_token * args.block_size)
    rate = None if math.isinf(args.rate) else args.rate  # None: all at time 0
    geometry = (
        f"profile {profile.name}: {profile.model.name} on {profile.hardware.name}, "
        f"{num_blocks} KV blocks of {args.block_size} tokens"
    )
    report: dict[str, Any] = {"profile": profile.name, "workload": workload.describe()}
    if args.replicas:
        tier = ""
        if args.kv_tier_gib > 0:
            tier = (
                f"; a shared KV tier 2 of {args.kv_tier_gib:g} GiB read at "
                f"{args.kv_tier_gbps:g} GB/s"
            )
        print(
            f"{geometry} per replica{tier}; workload {workload.name}, {num_requests} requests "
            f"and rate {args.rate:g}/s per replica; goodput: TTFT <= {args.ttft_slo_ms:g} ms "
            f"and TPOT <= {args.itl_slo_ms:g} ms",
            flush=True,
        )
        results = _simulate_replicas(args, workload, profile, runs[0], num_requests, num_blocks)
        print(format_cluster_table(results))
        report |= {
            "num_requests_per_replica": num_requests,
            "rate_per_replica": rate,
            "kv": {"num_blocks_per_replica": num_blocks, "block_size": args.block_size},
            "config": asdict(runs[0].config),
            "runs": results,
        }
    else:
        specs = workload.build(num_requests, vocab_size=profile.model.vocab_size)
        arrivals = arrival_offsets(num_requests, args.rate, args.burstiness, args.seed)
        results = [
            simulate(run, profile, specs, arrivals, num_blocks=num_blocks,
                     block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching)
            for run in runs
        ]  # fmt: skip
        print(
            f"{geometry}; workload {workload.name}, {num_requests} requests, rate "
            f"{args.rate:g}/s, burstiness {args.burstiness:g}"
        )
        print(format_table(results))
        ratios = compare(results)
        for key, value in ratios.items():
            print(f"{key}: {value:.2f}" if value is not None else f"{key}: -")
        report |= {
            "num_requests": num_requests,
            "arrivals": {"rate": rate, "burstiness": args.burstiness, "seed": args.seed},
            "kv": {"num_blocks": num_blocks, "block_size": args.block_size},
            "config": asdict(runs[0].config),
            "runs": results,
            "comparison": ratios,
        }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return 0


def _simulate_replicas(
    args: argparse.Namespace,
    workload: Workload,
    profile: SimProfile,
    run: RunSpec,
    num_requests: int,
    num_blocks: int,
) -> list[dict[str, Any]]:
    """``--replicas``: every (replica count, router) on the same arrivals per count."""
    block_bytes = profile.model.kv_bytes_per_token * args.block_size
    tier_blocks = int(args.kv_tier_gib * 2**30) // block_bytes if args.kv_tier_gib > 0 else None
    if args.kv_tier_gbps <= 0:
        raise ValueError(f"--kv-tier-gbps must be > 0, got {args.kv_tier_gbps}")
    results = []
    for n in args.replicas:
        total = num_requests * n
        specs = workload.build(total, vocab_size=profile.model.vocab_size)
        arrivals = arrival_offsets(total, args.rate * n, args.burstiness, args.seed)
        for router in args.router:
            results.append(
                simulate_cluster(
                    run,
                    profile,
                    specs,
                    arrivals,
                    num_replicas=n,
                    router=router,
                    num_blocks=num_blocks,
                    block_size=args.block_size,
                    enable_prefix_caching=not args.no_prefix_caching,
                    seed=args.seed,
                    tier_capacity_blocks=tier_blocks,
                    restore_s_per_block=block_bytes / (args.kv_tier_gbps * 1e9),
                )
            )
    return results


if __name__ == "__main__":
    raise SystemExit(main())
