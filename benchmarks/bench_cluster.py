"""The cluster measured as users run it: a local Ray cluster in this process, kvserve's gRPC API
through Ray Serve's proxy, each comparison on the same requests in one run.

    python -m benchmarks.bench_cluster routing                  # tier-aware routing (minutes)
    python -m benchmarks.bench_cluster pd                       # prefill / decode split
    python -m benchmarks.bench_cluster routing --runner fake --quick

``routing``: the ``tenants`` shape (T tenants, each request its tenant's system prompt then a
user turn), 2 replicas that share a KV tier 2, each pool holding a third of the tenants'
system prompts; open-loop Poisson arrivals, the same for both routers: ``prefix`` (the router
that ignores the tier) and ``cost`` (RAM, shared tier, recompute and backlog priced). TTFT is
the client's, request to first token. ``--runner fake`` emulates the model's costs by
sleeping (``--fake-token-sleep-s`` per prefilled token, ``--fake-step-sleep-s`` per step), so
two replicas run side by side as on two machines; ``--runner torch`` serves the embedded
model (the two replicas then share this machine's cores).

``pd``: chat128's prompts (``loadtest/workloads/prompts/chat128.json``) with 1 request in 8
carrying a 1,024-token document, closed loop, greedy: 2 mixed replicas against 1 prefill + 1
decode replica on the same cores, the embedded model; inter-token latency (every gap the
client sees), output tokens/s, and whether every answer's tokens are the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.workload import CHAT128_PROMPTS

# Acceptance (issue 34), each against its baseline in the same run.
TARGET_ROUTING_TTFT_P50 = 0.7  # cost router's TTFT p50 / prefix router's, at most
TARGET_PD_ITL_P99 = 0.5  # split's ITL p99 / mixed's, at most
TARGET_PD_TOK_S = 0.9  # split's output tok/s / mixed's, at least


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else None


@dataclass(slots=True)
class Run:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    output_tokens: int = 0
    wall_s: float = 0.0
    server: dict[str, float] = field(default_factory=dict)  # summed replica counters

    def summary(self) -> dict[str, Any]:
        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1e3, 1)

        return {
            "config": self.name,
            "requests": len(self.tokens),
            "ttft_p50_ms": ms(pct(self.ttft_s, 0.5)),
            "ttft_p99_ms": ms(pct(self.ttft_s, 0.99)),
            "itl_p50_ms": ms(pct(self.itl_s, 0.5)),
            "itl_p99_ms": ms(pct(self.itl_s, 0.99)),
            "output_tok_s": round(self.output_tokens / self.wall_s, 2) if self.wall_s else None,
            **{k: round(v, 3) for k, v in self.server.items()},
        }


async def one(client: Any, rid: str, prompt: list[int], max_tokens: int, run: Run) -> None:
    """One greedy request; its client-side TTFT, every inter-token gap, its tokens."""
    t0 = time.perf_counter()
    last = None
    tokens: list[int] = []
    async for r in client.generate(prompt, request_id=rid, max_tokens=max_tokens, ignore_eos=True):
        if not r.token_ids:
            continue
        now = time.perf_counter()
        if last is None:
            run.ttft_s.append(now - t0)
        else:
            run.itl_s.append(now - last)
        last = now
        tokens += r.token_ids
    run.tokens[rid] = tokens
    run.output_tokens += len(tokens)


def server_counters(metrics_port: int, num_replicas: int) -> dict[str, float]:
    """Prefix-hit tokens by tier and prompt tokens looked up, over every replica."""
    from tests.cluster.helpers import replica_targets, scrape, total

    samples = [scrape(u) for u in replica_targets(metrics_port, num_replicas)]
    queried = total(samples, "kvserve_prefix_cache_queries_tokens_total")
    out = {
        "hit_rate_tier1": total(samples, "kvserve_kv_tier_hits_tokens_total", tier="1"),
        "hit_rate_tier2": total(samples, "kvserve_kv_tier_hits_tokens_total", tier="2"),
    }
    out = {k: v / queried if queried else 0.0 for k, v in out.items()}
    out["transfers_ok"] = total(samples, "kvserve_kv_transfers_total", outcome="ok")
    waits = total(samples, "kvserve_kv_transfer_seconds_count")
    out["transfer_wait_mean_s"] = (
        total(samples, "kvserve_kv_transfer_seconds_sum") / waits if waits else 0.0
    )
    out["transfer_fallbacks"] = sum(
        total(samples, "kvserve_kv_transfers_total", outcome=o)
        for o in ("prefill_failed", "timeout")
    )
    return out


# ---------------------------------------------------------------------------- routing


def tenants_requests(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    """Each request: its tenant's system prompt, then a fresh user turn (random ids)."""
    rng = random.Random(args.seed)
    low, high = vocab // 8, 7 * vocab // 8
    systems = [[rng.randrange(low, high) for _ in range(args.system_len)]
               for _ in range(args.tenants)]  # fmt: skip
    out = []
    for _ in range(args.requests):
        user = [rng.randrange(low, high) for _ in range(rng.randint(*args.user_len))]
        out.append(systems[rng.randrange(args.tenants)] + user)
    return out


def bench_routing(cluster: Any, args: argparse.Namespace, root: str) -> list[Run]:
    from loadtest.workload import arrival_offsets
    from server.client import KVServeClient

    engine: dict[str, Any] = {"runner": args.runner, "block_size": 16, "max_num_seqs": 8}
    vocab = 258
    if args.runner == "fake":
        engine |= {"fake_step_sleep_s": args.fake_step_sleep_s,
                   "fake_token_sleep_s": args.fake_token_sleep_s}  # fmt: skip
    else:
        from model_runner.loader import load_tokenizer

        vocab = load_tokenizer(None).vocab_size
        engine |= {"threads": 1}
    per_tenant = -(-args.system_len // 16)
    pool = max(args.tenants // 3, 1) * per_tenant + 8 * (-(-(args.user_len[1] + 64) // 16))
    requests = tenants_requests(args, vocab)
    arrivals = arrival_offsets(len(requests), args.rate, 1.0, args.seed)
    say(
        f"[routing] {args.tenants} tenants x {args.system_len}-token system prompts, "
        f"{len(requests)} requests at {args.rate:g}/s, 2 replicas of {pool} blocks "
        f"({args.runner}), a shared tier 2"
    )
    runs = []
    for router in args.routers:
        run = Run(f"{router} router")
        metrics_port = cluster.deploy(
            f"route-{router}",
            engine={**engine, "num_blocks": pool, "kv_disk_dir": os.path.join(root, router)},
            num_replicas=2,
            router=router,
        )

        async def drive(run: Run = run) -> None:
            async with KVServeClient(cluster.address) as client:
                await one(client, "warm-up", requests[0][:8], 2, Run("warm-up"))
                t0 = time.perf_counter()

                async def at(i: int, prompt: list[int]) -> None:
                    await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
                    await one(client, f"r-{i}", prompt, args.output_len, run)

                await asyncio.gather(*(at(i, p) for i, p in enumerate(requests)))
                run.wall_s = time.perf_counter() - t0

        asyncio.run(drive())
        run.server = server_counters(metrics_port, 2)
        runs.append(run)
        say(f"  {json.dumps(run.summary())}")
    return runs


# ---------------------------------------------------------------------------- pd


def pd_requests(args: argparse.Namespace) -> list[list[int]]:
    """chat128's prompts; every 8th carries a 1,024-token document before its question."""
    from model_runner.loader import load_tokenizer

    tok = load_tokenizer(None)
    prompts = json.loads(args.workload_file.read_text())["prompts"]
    rng = random.Random(args.seed)
    low, high = tok.vocab_size // 8, 7 * tok.vocab_size // 8
    out = []
    for i in range(args.requests):
        ids = list(tok.encode(prompts[i % len(prompts)]))
        if i % 8 == 7:
            ids = [rng.randrange(low, high) for _ in range(args.document_len)] + ids
        out.append(ids)
    return out


def bench_pd(cluster: Any, args: argparse.Namespace, root: str) -> list[Run]:
    from server.client import KVServeClient

    requests = pd_requests(args)
    engine = {"runner": "torch", "threads": 1, "kv_memory": "256MiB", "max_num_seqs": 16}
    configs = (
        ("2 mixed replicas", {"num_replicas": 2}),
        (
            "1 prefill + 1 decode",
            {
                "num_replicas": 1,
                "num_prefill_replicas": 1,
                "transfer_min_tokens": args.pd_min_transfer_tokens,
            },
        ),
    )
    say(
        f"[pd] {len(requests)} requests (chat128, 1 in 8 with a {args.document_len}-token "
        f"document), {args.users} users, {args.output_len} tokens out, the embedded model"
    )
    runs = []
    for name, shape in configs:
        run = Run(name)
        tier = os.path.join(root, name.replace(" ", "-"))
        metrics_port = cluster.deploy(
            f"pd-{len(runs)}", engine={**engine, "kv_disk_dir": tier}, router="cost", **shape
        )

        async def drive(run: Run = run) -> None:
            async with KVServeClient(cluster.address) as client:
                await one(client, "warm-up", requests[0][:16], 2, Run("warm-up"))
                queue = list(enumerate(requests))
                t0 = time.perf_counter()

                async def user() -> None:
                    while queue:
                        i, prompt = queue.pop(0)
                        await one(client, f"r-{i}", prompt, args.output_len, run)

                await asyncio.gather(*(user() for _ in range(args.users)))
                run.wall_s = time.perf_counter() - t0

        asyncio.run(drive())
        run.server = server_counters(metrics_port, 2)
        runs.append(run)
        say(f"  {json.dumps(run.summary())}")
    return runs


# ---------------------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def format_table(runs: list[Run]) -> str:
    rows = [r.summary() for r in runs]
    keys = [k for k in rows[0] if k != "config"]
    lines = ["| config | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for row in rows:
        lines.append(f"| {row['config']} | " + " | ".join(str(row[k]) for k in keys) + " |")
    return "\n".join(lines)


def verdict(part: str, runs: list[Run]) -> dict[str, Any]:
    base, other = runs[0].summary(), runs[1].summary()
    if part == "routing":
        r = ratio(other["ttft_p50_ms"], base["ttft_p50_ms"])
        return {"ttft_p50_cost_vs_prefix": r,
                "holds": r is not None and r <= TARGET_ROUTING_TTFT_P50}  # fmt: skip
    itl = ratio(other["itl_p99_ms"], base["itl_p99_ms"])
    tok_s = ratio(other["output_tok_s"], base["output_tok_s"])
    same = runs[0].tokens == runs[1].tokens
    return {
        "itl_p99_split_vs_mixed": itl,
        "output_tok_s_split_vs_mixed": tok_s,
        "greedy_tokens_identical": same,
        "holds": itl is not None and itl <= TARGET_PD_ITL_P99 and tok_s is not None
        and tok_s >= TARGET_PD_TOK_S and same,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=["routing", "pd"])
    p.add_argument("--runner", choices=["fake", "torch"], default="torch", help="routing")
    p.add_argument("--routers", default="prefix,cost", help="routing: the routers, baseline first")
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--user-len", type=lambda s: tuple(int(x) for x in s.split(":")),
                   default=(16, 64), help="MIN:MAX tokens")  # fmt: skip
    p.add_argument("--rate", type=float, default=2.0, help="routing: requests/s")
    p.add_argument("--fake-token-sleep-s", type=float, default=0.002)
    p.add_argument("--fake-step-sleep-s", type=float, default=0.01)
    p.add_argument("--requests", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--users", type=int, default=4, help="pd: closed-loop users")
    p.add_argument("--document-len", type=int, default=1024)
    p.add_argument("--pd-min-transfer-tokens", type=int, default=32)
    p.add_argument("--workload-file", type=Path, default=CHAT128_PROMPTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny counts (wiring, not figures)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    args.routers = args.routers.split(",")
    if args.part == "routing":
        args.requests = args.requests or (12 if args.quick else 160)
        args.output_len = args.output_len or (2 if args.quick else 16)
    else:
        args.requests = args.requests or (8 if args.quick else 32)
        args.output_len = args.output_len or (4 if args.quick else 64)
    if args.quick:
        args.tenants, args.system_len, args.document_len = 6, 64, 128

    from tests.cluster.helpers import start_local_cluster

    root = tempfile.mkdtemp(prefix="kvserve-bench-cluster-")
    started = start_local_cluster()
    cluster = next(started)
    load0 = os.getloadavg()
    try:
        runs = (bench_routing if args.part == "routing" else bench_pd)(cluster, args, root)
    finally:
        started.close()
        shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()
    print(format_table(runs))
    result = verdict(args.part, runs)
    result["load_average_1m_before_after"] = [round(load0[0], 2), round(load1[0], 2)]
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(
            json.dumps({"part": args.part, "args": {k: str(v) for k, v in vars(args).items()},
                        "runs": [r.summary() for r in runs], "verdict": result}, indent=2)
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
