"""CPU cost of the scheduler per engine step: ``schedule()`` + ``update()`` with N running decodes.

Run: ``.venv/bin/python -m benchmarks.bench_scheduler [--steps 300] [--batch 256 1024]``

Setup per batch size N: a KVCacheManager (blocks of 16, prefix caching on, room for every
request), ``max_num_seqs = N``; N requests with prompts of 128..143 tokens (staggered, so
block boundaries are crossed on different steps, as in a real server) are prefilled, then
every measured step decodes all N. The runner is replaced by a prebuilt ``ModelOutput`` (one
token per request), so the figures are the scheduler + cache manager alone. Targets (issue
3): median <= 1 ms at N=256 and <= 4 ms at N=1024. The machine may be shared: min shows the
undisturbed cost, median the typical one.

Each size runs twice: with Python's default GC, and with the GC set up as a server would
after start-up (``gc.freeze()`` of the long-lived heap: the KV block pool alone is tens of
thousands of objects, and ``gc.set_threshold(20_000, 50, 100)``): every step allocates a few
objects per request (the plan and outputs are plain data by contract), and with the default
thresholds full collections over the whole heap land every few steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from cache_manager import KVCacheConfig, KVCacheManager
from scheduler import ModelOutput, Request, SamplingParams, Scheduler, SchedulerConfig

TARGET_MEDIAN_MS = {256: 1.0, 1024: 4.0}


def build(num_seqs: int, num_steps: int) -> tuple[Scheduler, ModelOutput]:
    max_len = 144 + num_steps + 256
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_seqs * (max_len // 16 + 2), block_size=16))
    config = SchedulerConfig(
        max_num_seqs=num_seqs,
        max_num_batched_tokens=max(8192, num_seqs),
        max_model_len=max_len + 8,
        long_prefill_token_threshold=0,
        max_waiting_requests=num_seqs,
    )
    sched = Scheduler(config, kv)
    sampling = SamplingParams(max_tokens=num_steps + 256, ignore_eos=True)
    for i in range(num_seqs):
        prompt = [1000 + i] + [7] * (127 + i % 16)
        sched.add_request(Request(f"req-{i}", prompt, sampling, eos_token_ids=(2,)))
    result = ModelOutput(sampled_token_ids={f"req-{i}": 5 + i % 100 for i in range(num_seqs)})
    while sched.num_waiting or any(
        r is not None and r.num_output_tokens == 0
        for r in (sched.get_request(f"req-{i}") for i in range(num_seqs))
    ):
        plan = sched.schedule()
        sched.update(plan, result)
    return sched, result


def measure(num_seqs: int, num_steps: int, tuned_gc: bool) -> dict[str, float]:
    default_threshold = gc.get_threshold()
    sched, result = build(num_seqs, num_steps)
    schedule_ms: list[float] = []
    update_ms: list[float] = []
    total_ms: list[float] = []
    gc.collect()
    if tuned_gc:
        gc.freeze()
        gc.set_threshold(20_000, 50, 100)
    for _ in range(num_steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        outs = sched.update(plan, result)
        t2 = time.perf_counter()
        assert len(plan.decode) == num_seqs and len(outs) == num_seqs
        schedule_ms.append((t1 - t0) * 1e3)
        update_ms.append((t2 - t1) * 1e3)
        total_ms.append((t2 - t0) * 1e3)
    gc.set_threshold(*default_threshold)
    gc.unfreeze()
    del sched, result, plan, outs
    gc.collect()
    return {
        "schedule_median": statistics.median(schedule_ms),
        "update_median": statistics.median(update_ms),
        "median": statistics.median(total_ms),
        "p90": statistics.quantiles(total_ms, n=10)[-1],
        "min": min(total_ms),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="measured decode steps per size")
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args(argv)
    header = (
        f"{'running decodes':>15} {'gc':>7} {'schedule med':>12} {'update med':>10} "
        f"{'total med':>9} {'p90':>7} {'min':>7} {'target med':>10}  ok"
    )
    print(f"schedule() + update() CPU time per step, ms ({args.steps} steps each)")
    print(header)
    ok = True
    for n in args.batch:
        for tuned_gc in (False, True):
            r = measure(n, args.steps, tuned_gc)
            target = TARGET_MEDIAN_MS.get(n)
            passed = target is None or r["median"] <= target
            ok &= passed
            print(
                f"{n:>15} {'tuned' if tuned_gc else 'default':>7} {r['schedule_median']:>12.3f} "
                f"{r['update_median']:>10.3f} {r['median']:>9.3f} {r['p90']:>7.3f} "
                f"{r['min']:>7.3f} {'-' if target is None else f'{target:.1f}':>10}  "
                f"{'yes' if passed else 'NO'}"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
