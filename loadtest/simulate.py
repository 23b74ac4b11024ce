"""``kvserve simulate``: replay a workload through the real scheduler on a simulated GPU.

The real ``Scheduler`` and ``KVCacheManager`` run unchanged; the model is a ``SimRunner``
(a roofline cost model of a named GPU + model, ``model_runner/sim.py``) on a virtual clock,
so 1,000 requests on an H100 take seconds on a laptop CPU.

    kvserve simulate                                   # 1,000 requests, H100 x Llama-3-8B
    kvserve simulate --compare --json sim.json         # static vs continuous, both policies
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
their row, costed as padding), and only then admits more. ``--compare`` runs static
batching and continuous batching under ``prefill-first`` and ``stall-free`` on the same
arrivals, in one invocation, and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cache_manager import KVCacheConfig, KVCacheManager
from cluster.routing import ROUTERS, ReplicaLoad, make_router, routing_keys
from loadtest.stats import summarize
from loadtest.workload import RequestSpec, Workload, arrival_offsets
from model_runner.sim import PROFILES, SimProfile, SimRunner, get_profile, roofline_cost_model
from scheduler import (
    OverloadError,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from scheduler.config import POLICIES
from scheduler.cost_model import StepShape
from scheduler.slo import attained, time_per_output_token

# A ShareGPT-like mix: lognormal lengths, a third of requests behind one of 8 system prompts,
# two priority classes.
DEFAULT_WORKLOAD: dict[str, Any] = {
    "name": "sim-mix",
    "description": "lognormal prompts (median 256) and outputs (median 128); 30% share one of "
    "8 system prompts of 512 tokens; priorities 0:1 = 1:3",
    "seed": 0,
    "num_requests": 1000,
    "prompt": {
        "source": "random",
        "len": {"type": "lognormal", "median": 256, "sigma": 0.9, "min": 16, "max": 2048},
    },
    "shared_prefix": {"num_prefixes": 8, "len": 512, "fraction": 0.3},
    "output": {
        "len": {"type": "lognormal", "median": 128, "sigma": 0.8, "min": 4, "max": 1024},
        "ignore_eos": True,
    },
    "priorities": [{"value": 0, "weight": 1}, {"value": 1, "weight": 3}],
}


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One simulated engine configuration."""

    name: str
    config: SchedulerConfig
    static_batching: bool = False


@dataclass(slots=True)
class _Track:
    """What the simulator records for one request."""

    arrival_s: float
    num_prompt_tokens: int
    cancel_after: int | None
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finished_s: float | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0


class _SimEngine:
    """One simulated engine: a fresh scheduler, cache manager, SimRunner and virtual clock,
    and what the simulator records for its requests. ``step()`` is one engine step."""

    def __init__(
        self,
        run: RunSpec,
        profile: SimProfile,
        *,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        max_steps: int,
    ) -> None:
        self.run = run
        self.kv = KVCacheManager(
            KVCacheConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                block_bytes=profile.model.kv_bytes_per_token * block_size,
            )
        )
        # slo: the roofline's least-squares fit as the prior, refitted online from every step
        # (the simulated device's times are the "measurements").
        self.cost_model = roofline_cost_model(profile) if run.config.policy == "slo" else None
        self.sched = Scheduler(run.config, self.kv, self.cost_model)
        self.runner = SimRunner(profile)
        self.clock = self.runner.clock
        self.eos = self.runner.info.eos_token_ids
        self.max_steps = max_steps
        self.tracks: dict[str, _Track] = {}
        self.rejected: Counter[str] = Counter()
        self.static_batch: dict[str, int] = {}  # static batching: the batch, id -> final length
        self.num_steps = 0
        self.usage_time = 0.0  # integral of KV usage over busy time
        self.max_usage = 0.0
        self.decode_rows = 0
        self.to_cancel: set[str] = set()  # requests the client will cancel after some tokens

    @property
    def num_load(self) -> int:
        """Requests queued or running here (what a router balances)."""
        return self.sched.num_waiting + self.sched.num_running

    def admit(self, spec: RequestSpec, arrival_s: float) -> None:
        assert spec.prompt_token_ids is not None
        rid = f"req-{spec.index}"
        request = Request(
            request_id=rid,
            prompt_token_ids=list(spec.prompt_token_ids),
            sampling=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos),
            eos_token_ids=self.eos,
            priority=spec.priority,
            arrival_time_s=arrival_s,
        )
        try:
            self.sched.add_request(request)
        except OverloadError:
            self.rejected["overload"] += 1
            return
        except ValueError:
            self.rejected["invalid"] += 1
            return
        self.tracks[rid] = _Track(arrival_s, len(spec.prompt_token_ids), spec.cancel_after_tokens)
        if spec.cancel_after_tokens is not None:
            self.to_cancel.add(rid)
        if self.run.static_batching:
            self.static_batch[rid] = 0

    def _record(self, out: RequestOutput, now_s: float) -> None:
        track = self.tracks[out.request_id]
        track.token_times_s.extend(now_s for _ in out.new_token_ids)
        if out.finished:
            track.finished_s = now_s
            track.finish_reason = out.finish_reason.value if out.finish_reason else None
            track.num_cached_tokens = out.num_cached_tokens
            if out.request_id in self.static_batch:
                self.static_batch[out.request_id] = track.num_prompt_tokens + out.num_output_tokens

    def step(self) -> None:
        """One step: schedule, execute on the cost model (the clock advances), update."""
        sched, clock, tracks = self.sched, self.clock, self.tracks
        self.num_steps += 1
        if self.num_steps > self.max_steps:
            raise RuntimeError(f"{self.run.name}: no end after {self.max_steps} steps")
        plan = sched.schedule(clock.now_s)
        if plan.is_empty:
            raise RuntimeError(
                f"{self.run.name}: step {plan.step_id} scheduled nothing with "
                f"{sched.num_waiting} waiting and {sched.num_running} running"
            )
        for seq in plan.prefill:
            track = tracks[seq.request_id]
            if track.first_scheduled_s is None:
                track.first_scheduled_s = clock.now_s
        padding = [(1, length) for length in self.static_batch.values() if length]
        start_s = clock.now_s
        result = self.runner.execute(plan, padding=padding)
        now_s = clock.now_s
        if self.cost_model is not None:
            self.cost_model.observe(StepShape.of_plan(plan), now_s - start_s)
        usage = self.kv.usage
        self.usage_time += usage * (now_s - start_s)
        self.max_usage = max(self.max_usage, usage)
        self.decode_rows += len(plan.decode)
        for out in sched.update(plan, result):
            self._record(out, now_s)
        for rid in list(self.to_cancel):
            track = tracks[rid]
            if track.finished_s is not None:
                self.to_cancel.discard(rid)
            elif track.cancel_after is not None and len(track.token_times_s) >= track.cancel_after:
                aborted = sched.abort(rid)
                assert aborted is not None
                self._record(aborted, now_s)
                self.to_cancel.discard(rid)

    def run_until(self, t_s: float) -> None:
        """Step while there is work and the clock is before ``t_s``; then idle up to it."""
        while self.sched.has_unfinished_requests() and self.clock.now_s < t_s:
            self.step()
        if self.clock.now_s < t_s:
            self.clock.advance_to(t_s)

    def finish(self) -> None:
        """Step until every admitted request has ended."""
        while self.sched.has_unfinished_requests():
            self.step()


def simulate(
    run: RunSpec,
    profile: SimProfile,
    specs: Sequence[RequestSpec],
    arrivals_s: Sequence[float],
    *,
    num_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_steps: int = 2_000_000,
) -> dict[str, Any]:
    """Run one configuration over the workload on a fresh scheduler, cache and clock."""
    engine = _SimEngine(
        run,
        profile,
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        max_steps=max_steps,
    )
    sched, clock = engine.sched, engine.clock
    order = sorted(range(len(specs)), key=lambda i: (arrivals_s[i], i))
    next_arrival = 0
    while next_arrival < len(order) or sched.has_unfinished_requests():
        # Arrivals up to now join the queue; static batching admits a batch only when idle.
        if not run.static_batching or not sched.has_unfinished_requests():
            engine.static_batch.clear()
            cap = run.config.max_num_seqs if run.static_batching else len(order)
            while (
                next_arrival < len(order)
                and arrivals_s[order[next_arrival]] <= clock.now_s
                and len(engine.static_batch) < cap
            ):
                i = order[next_arrival]
                engine.admit(specs[i], arrivals_s[i])
                next_arrival += 1
        if not sched.has_unfinished_requests():
            if next_arrival < len(order):
                clock.advance_to(arrivals_s[order[next_arrival]])
            continue
        engine.step()
    return _report(run, [engine])


def simulate_cluster(
    run: RunSpec,
    profile: SimProfile,
    specs: Sequence[RequestSpec],
    arrivals_s: Sequence[float],
    *,
    num_replicas: int,
    router: str,
    num_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_steps: int = 2_000_000,
    seed: int = 0,
) -> dict[str, Any]:
    """``num_replicas`` engines (each ``num_blocks`` of KV) behind ``cluster.routing``'s router.

    Before each arrival every replica runs up to the arrival time (a replica mid-step
    finishes that step first); the router then sees each replica's queued + running count
    and picks one, as ``kvserve cluster serve`` does with in-flight counts.
    """
    if run.static_batching:
        raise ValueError("--replicas simulates continuous batching only")
    engines = [
        _SimEngine(
            run,
            profile,
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_steps=max_steps,
        )
        for _ in range(num_replicas)
    ]
    chooser = make_router(router, capacity_blocks=num_blocks, seed=seed)
    decisions: Counter[str] = Counter()
    for i in sorted(range(len(specs)), key=lambda i: (arrivals_s[i], i)):
        spec, t_s = specs[i], arrivals_s[i]
        assert spec.prompt_token_ids is not None
        for engine in engines:
            engine.run_until(t_s)
        loads = [ReplicaLoad(f"{k:02d}", e.num_load) for k, e in enumerate(engines)]
        decision = chooser.choose(loads, routing_keys(spec.prompt_token_ids, block_size, None))
        decisions[decision.reason] += 1
        engines[int(decision.replica_id)].admit(spec, t_s)
    for engine in engines:
        engine.finish()
    report = _report(run, engines)
    report["name"] = f"{num_replicas} x {router}"
    report["replicas"] = num_replicas
    report["router"] = router
    report["router_decisions"] = dict(sorted(decisions.items()))
    return report


def _tpot(t: _Track) -> float | None:
    times = t.token_times_s
    if not times:
        return None
    return time_per_output_token(times[0], times[-1], len(times) - 1)


def _goodput(done: Sequence[_Track], ttft_target_s: float, itl_target_s: float) -> dict[str, Any]:
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


def _report(run: RunSpec, engines: Sequence[_SimEngine]) -> dict[str, Any]:
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
            "prefix_hit_rate": hits / queries if queries else 0.0,
            "evictions": sum(s.kv.evictions_total for s in all_stats),
        },
    }


# -- CLI ---------------------------------------------------------------------------------------


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
        help="static vs continuous (prefill-first, stall-free) on the same arrivals",
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
    if path is None:
        return Workload.from_dict(DEFAULT_WORKLOAD)
    from loadtest.cli import resolve_workload  # a shipped name ("tenants") or a path

    workload = Workload.load(resolve_workload(path))
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
        return SchedulerConfig(**{**_fields(base), "policy": policy, **changes})

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


def _fields(config: SchedulerConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in SchedulerConfig.__dataclass_fields__}


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
    """A fixed-width table: a header, a rule, a row per run; the first ``num_left`` columns
    left-aligned, the rest right-aligned."""
    rows = [[name for name, _ in columns]] + [[get(r) for _, get in columns] for r in runs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = []
    for j, row in enumerate(rows):
        cells = [
            c.ljust(w) if i < num_left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
        ("evictions", lambda r: str(r["kv"]["evictions"])),
    ]
    note = "\n(latencies in ms; hit = prefix-cache hit rate over all replicas)"
    return _render(columns, runs, 2) + note


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
    if args.kv_gib is not None:
        num_blocks = int(args.kv_gib * 2**30) // (
            profile.model.kv_bytes_per_token * args.block_size
        )
    else:
        num_blocks = profile.kv_budget_bytes // (profile.model.kv_bytes_per_token * args.block_size)
    if args.replicas:
        return _main_cluster(args, workload, profile, runs[0], num_requests, num_blocks)
    specs = workload.build(num_requests, vocab_size=profile.model.vocab_size)
    arrivals = arrival_offsets(num_requests, args.rate, args.burstiness, args.seed)
    results = [
        simulate(
            run,
            profile,
            specs,
            arrivals,
            num_blocks=num_blocks,
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
        )
        for run in runs
    ]
    print(
        f"profile {profile.name}: {profile.model.name} on {profile.hardware.name}, "
        f"{num_blocks} KV blocks of {args.block_size} tokens; workload {workload.name}, "
        f"{num_requests} requests, rate {args.rate:g}/s, burstiness {args.burstiness:g}"
    )
    print(format_table(results))
    ratios = compare(results)
    for key, value in ratios.items():
        print(f"{key}: {value:.2f}" if value is not None else f"{key}: -")
    report = {
        "profile": profile.name,
        "workload": workload.describe(),
        "num_requests": num_requests,
        "arrivals": {
            "rate": None if math.isinf(args.rate) else args.rate,  # None: all at time 0
            "burstiness": args.burstiness,
            "seed": args.seed,
        },
        "kv": {"num_blocks": num_blocks, "block_size": args.block_size},
        "config": _fields(runs[0].config),
        "runs": results,
        "comparison": ratios,
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return 0


def _main_cluster(
    args: argparse.Namespace,
    workload: Workload,
    profile: SimProfile,
    run: RunSpec,
    num_requests: int,
    num_blocks: int,
) -> int:
    """``--replicas``: every (replica count, router) on the same arrivals per count."""
    print(
        f"profile {profile.name}: {profile.model.name} on {profile.hardware.name}, "
        f"{num_blocks} KV blocks of {args.block_size} tokens per replica; workload "
        f"{workload.name}, {num_requests} requests and rate {args.rate:g}/s per replica; "
        f"goodput: TTFT <= {args.ttft_slo_ms:g} ms and TPOT <= {args.itl_slo_ms:g} ms",
        flush=True,
    )
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
                )
            )
    print(format_cluster_table(results))
    if args.json_path:
        report = {
            "profile": profile.name,
            "workload": workload.describe(),
            "num_requests_per_replica": num_requests,
            "rate_per_replica": None if math.isinf(args.rate) else args.rate,
            "kv": {"num_blocks_per_replica": num_blocks, "block_size": args.block_size},
            "config": _fields(run.config),
            "runs": results,
        }
        Path(args.json_path).write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
