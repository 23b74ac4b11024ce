"""Structured outputs at serving time: chat128 against chat128_json (the same prompts, every
answer constrained to a JSON schema: an array of 32 integers, about 128 tokens) on ONE
``kvserve serve --runner torch`` subprocess, closed loop at ``--users`` users, the two
workloads interleaved A B B A ... so load drift hits both alike. Prefix caching is off, so no
run reuses another's prompts.

Reports each run's output tok/s, the constrained / unconstrained ratio of the summed
throughputs, and the mask time per step that had constrained rows (from the server's
``kvserve_step_constraint_mask_seconds``) next to the mean decode step time.

    python -m benchmarks.bench_structured [--users 8] [--num-requests 16] [--rounds 2]

``--in-process`` measures the step itself instead, free of the serving stack's noise: the
embedded model as ``kvserve serve`` builds it, ``--users`` chat128 prompts constrained to the
chat128_json schema, driven by the scheduler; every decode step's plan is executed twice,
with and without the constraints (alternating which goes first; the KV written is the same),
and the two step times are compared.
"""

from __future__ import annotations

import argparse
import os
import re

import httpx

from benchmarks.bench_serving import run_load, warm_and_run
from loadtest.launch import ServerProcess
from loadtest.workload import Workload, resolve_workload


def scrape(url: str) -> dict[str, float]:
    """Unlabelled (and kind="decode") samples of the server's exposition."""
    text = httpx.get(url, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(kvserve_[a-z_]+)(\{kind="decode"\})?\s+(\S+)$', line)
        if m:
            out[m.group(1) + ("_decode" if m.group(2) else "")] = float(m.group(3))
    return out


def in_process(users: int, max_steps: int) -> None:
    """The interleaved per-step comparison (see the module docstring)."""
    import dataclasses
    import json
    import time

    from scheduler.request import Constraint, Request, SamplingParams
    from server.build import build_engine
    from server.config import build_config

    built = build_engine(build_config({"threads": 2}, environ={}))
    scheduler, runner, tok = built.scheduler, built.runner, built.tokenizer
    workload = Workload.load(resolve_workload("chat128_json"))
    assert workload.constraint is not None
    schema = json.dumps(workload.constraint["json_schema"])
    sampling = SamplingParams(
        temperature=0.0, max_tokens=128, constraint=Constraint("json_schema", schema)
    )
    prompts = workload.prompt_texts[:users]
    for i, text in enumerate(prompts):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), False)
        scheduler.add_request(Request(f"r{i}", ids, sampling, eos_token_ids=(2,)))
    times: dict[str, list[float]] = {"plain": [], "constrained": []}
    mask_s: list[float] = []
    step = 0
    while scheduler.has_unfinished_requests() and step < max_steps:
        plan = scheduler.schedule()
        if plan.prefill or len(plan.decode) < users:
            result = runner.execute(plan)  # prefill steps and a shrinking batch: not timed
        else:
            free = dataclasses.replace(
                plan,
                decode=[
                    dataclasses.replace(
                        s, sampling=dataclasses.replace(s.sampling, constraint=None)
                    )
                    for s in plan.decode
                ],
            )
            order = [("plain", free), ("constrained", plan)]
            if step % 2:
                order.reverse()
            for name, p in order:
                t0 = time.perf_counter()
                out = runner.execute(p)
                times[name].append(time.perf_counter() - t0)
                if name == "constrained":
                    result = out
                    mask_s.append(out.constraint_mask_time_s)
            step += 1
        scheduler.update(plan, result)
    plain = sum(times["plain"]) / len(times["plain"])
    constrained = sum(times["constrained"]) / len(times["constrained"])
    print(
        "| users | decode steps | step plain (ms) | step constrained (ms) | tok/s ratio "
        "(constrained / plain) | mask per step (ms, overlapped) | load avg |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {users} | {len(times['plain'])} | {plain * 1e3:.1f} | {constrained * 1e3:.1f} | "
        f"{plain / constrained:.3f}x | {sum(mask_s) / len(mask_s) * 1e3:.2f} | "
        f"{os.getloadavg()[0]:.1f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="A B B A pairs per round")
    parser.add_argument("--in-process", action="store_true", help="time the step (see above)")
    parser.add_argument("--max-steps", type=int, default=100, help="--in-process decode steps")
    args = parser.parse_args()
    if args.in_process:
        in_process(args.users, args.max_steps)
        return
    plain = Workload.load(resolve_workload("chat128"))
    constrained = Workload.load(resolve_workload("chat128_json"))
    tps: dict[str, list[float]] = {"chat128": [], "chat128_json": []}
    load = {"users": args.users, "num_requests": args.num_requests, "duration_s": 3600.0}
    with ServerProcess(["--runner", "torch", "--no-enable-prefix-caching"]) as server:
        assert server.metrics_url is not None
        warm = {**load, "num_requests": args.users}
        warm_and_run(server, plain, desc="warm-up", progress=False, **warm)  # type: ignore[arg-type]
        before = scrape(server.metrics_url)
        order = [plain, constrained, constrained, plain] * args.rounds
        for workload in order:
            report = run_load(server, workload, desc=workload.name, progress=False, **load)  # type: ignore[arg-type]
            tps[workload.name].append(report["output_token_throughput_tps"])
            per_request = report["output_tokens_total"] / max(report["requests"]["ok"], 1)
            print(
                f"{workload.name:>13}: {report['output_token_throughput_tps']:.1f} output tok/s, "
                f"{per_request:.0f} tokens per request",
                flush=True,
            )
        after = scrape(server.metrics_url)
    mask_sum = after["kvserve_step_constraint_mask_seconds_sum"] - before.get(
        "kvserve_step_constraint_mask_seconds_sum", 0.0
    )
    mask_n = after["kvserve_step_constraint_mask_seconds_count"] - before.get(
        "kvserve_step_constraint_mask_seconds_count", 0.0
    )
    step_sum = after["kvserve_step_duration_seconds_sum_decode"] - before.get(
        "kvserve_step_duration_seconds_sum_decode", 0.0
    )
    step_n = after["kvserve_step_duration_seconds_count_decode"] - before.get(
        "kvserve_step_duration_seconds_count_decode", 0.0
    )
    mean = {k: sum(v) / len(v) for k, v in tps.items()}
    ratio = mean["chat128_json"] / mean["chat128"]
    load_avg = os.getloadavg()
    print()
    print(
        "| users | chat128 tok/s | chat128_json tok/s | ratio | mask per constrained step "
        "(ms) | decode step (ms) | load avg |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {args.users} | {mean['chat128']:.1f} | {mean['chat128_json']:.1f} | {ratio:.2f}x | "
        f"{mask_sum / max(mask_n, 1) * 1e3:.2f} ({int(mask_n)} steps) | "
        f"{step_sum / max(step_n, 1) * 1e3:.1f} | {load_avg[0]:.1f} |"
    )


if __name__ == "__main__":
    main()
