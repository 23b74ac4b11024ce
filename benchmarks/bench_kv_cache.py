"""Per-token decode latency against sequence length, with the KV cache and without it.

    python -m benchmarks.bench_kv_cache                       # 64 ... 4,096 tokens, PNG + table
    python -m benchmarks.bench_kv_cache --lengths 64,256 --tokens 2 --png /tmp/kv.png

One SmolLM2-135M runner as ``kvserve serve`` runs it by default (the GGUF's Q4_1/Q8_0 weights
on kvserve's kernels, fp16 KV, 2 threads), driven by the real Scheduler and KVCacheManager.
For every sequence length L, one request with an L-token prompt generates ``tokens + 1``
greedy tokens under ``--kv-strategy always`` and then under ``disabled``, side by side. The
first token (the prompt's prefill) is not counted; each later token's step time is one
sample: with the cache that step is a decode of one token against L keys; with ``disabled``
it is a prefill of the whole sequence from position 0 (the step budget holds it in one
chunk). The figure is the median step time.

With the cache a token costs the weights plus O(L) attention: nearly flat. Without it a
token costs O(L) matmul work plus O(L^2) attention, and producing all L tokens of a sequence
costs O(L^2) against O(L) (or O(L^3) against O(L^2) counting the attention): the second
panel integrates the measured per-token curve over the lengths to show that.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.table import markdown_table

DEFAULT_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)
STRATEGIES = ("always", "disabled")
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Point:
    """The median step time of one generated token at one sequence length, one strategy."""

    strategy: str
    length: int  # prompt tokens: the sequence length at the first measured token
    ms_per_token: float
    samples_ms: tuple[float, ...]
    token_ids: tuple[int, ...]  # the greedy tokens generated (both strategies should agree)


def load_runner(max_len: int, threads: int) -> Any:
    """The default serving runner (native GGUF weights, fused step, fp16 KV)."""
    import torch

    from model_runner.config import RunnerOptions
    from model_runner.loader import load_model
    from model_runner.runner import TorchRunner

    torch.set_num_threads(threads)
    loaded = load_model(None, weights="native")
    num_blocks = -(-max_len // BLOCK_SIZE) + 2
    options = RunnerOptions(num_blocks, BLOCK_SIZE, dtype=torch.float32)
    return TorchRunner(loaded.config, loaded.state_dict, options)


def measure(runner: Any, strategy: str, length: int, tokens: int) -> Point:
    """Step times of ``tokens`` generated tokens after the first, at sequence ``length``."""
    from cache_manager import KVCacheConfig, KVCacheManager
    from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

    total = length + tokens + 1
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=runner.num_blocks,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=False,
            kv_strategy=strategy,
        )
    )
    budget = max(2048, total)  # one chunk for the whole recomputation
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=1,
            max_num_batched_tokens=budget,
            max_model_len=max(total, runner.max_model_len),
            long_prefill_token_threshold=0,
        ),
        kv,
    )
    vocab = runner.info.vocab_size
    prompt = [(7919 * i + 13) % (vocab - 100) + 50 for i in range(length)]
    sampling = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    scheduler.add_request(Request(f"{strategy}-{length}", prompt, sampling=sampling))
    samples: list[float] = []
    token_ids: list[int] = []
    first = True
    while scheduler.has_unfinished_requests():
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        result = runner.execute(plan)
        outs = scheduler.update(plan, result)
        elapsed = time.perf_counter() - t0
        if not any(o.new_token_ids for o in outs):
            raise RuntimeError(f"{strategy} at {length}: a step produced no token")
        token_ids.extend(t for o in outs for t in o.new_token_ids)
        if not first:
            samples.append(elapsed * 1e3)
        first = False
    return Point(strategy, length, statistics.median(samples), tuple(samples), tuple(token_ids))


def run(lengths: tuple[int, ...], tokens: int, threads: int) -> list[Point]:
    """Both strategies at each length, interleaved (always, then disabled, per length)."""
    runner = load_runner(max(lengths) + tokens + 2, threads)
    measure(runner, "always", min(lengths), 2)  # warm-up: kernels, allocator
    points = []
    for length in lengths:
        for strategy in STRATEGIES:
            points.append(measure(runner, strategy, length, tokens))
    return points


def format_table(points: list[Point]) -> str:
    """Markdown: one row per length, both strategies, their ratio, and whether both
    generated the same greedy tokens."""
    by = {(p.strategy, p.length): p for p in points}
    rows = []
    for n in sorted({p.length for p in points}):
        a, d = by[("always", n)], by[("disabled", n)]
        same = "yes" if a.token_ids == d.token_ids else "no"
        ratio = d.ms_per_token / a.ms_per_token
        ms = (f"{a.ms_per_token:.1f}", f"{d.ms_per_token:.1f}")
        rows.append([f"{n:,}", *ms, f"{ratio:.1f}x", same])
    header = ["Sequence length (tokens)", "With KV cache (ms/token)",
              "Recompute, `disabled` (ms/token)", "disabled / cache", "Same tokens"]  # fmt: skip
    return markdown_table(header, rows, pad=False)


def _integrated_s(lengths: list[int], ms: list[float]) -> list[float]:
    """Seconds to generate every token up to each length: the trapezoid rule over the
    measured per-token times, from 0 tokens (the first length's time held below it)."""
    out = []
    total = ms[0] * lengths[0]
    out.append(total / 1e3)
    for i in range(1, len(lengths)):
        total += (ms[i] + ms[i - 1]) / 2 * (lengths[i] - lengths[i - 1])
        out.append(total / 1e3)
    return out


def plot(points: list[Point], path: Path, title: str) -> None:
    """Two panels: per-token latency (linear axes) and the integrated time to generate a
    whole sequence (log-log, with slope-1 and slope-2 guides)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    labels = {"always": "with KV cache (always)", "disabled": "recompute every step (disabled)"}
    colors = {"always": "tab:blue", "disabled": "tab:red"}
    series = {}
    for strategy in STRATEGIES:
        pts = sorted((p for p in points if p.strategy == strategy), key=lambda p: p.length)
        xs, ys = [p.length for p in pts], [p.ms_per_token for p in pts]
        series[strategy] = (xs, ys)
        ax1.plot(xs, ys, "o-", color=colors[strategy], label=labels[strategy])
        ax2.loglog(xs, _integrated_s(xs, ys), "o-", color=colors[strategy], label=labels[strategy])
    ax1.set_xlabel("sequence length (tokens)")
    ax1.set_ylabel("decode latency per token (ms)")
    ax1.set_title("Per-token latency")
    ax1.grid(True, alpha=0.3)
    ax1.legend()
    xs, _ = series["always"]
    for strategy, slope, style in (("always", 1, ":"), ("disabled", 2, "--")):
        sx, sy = series[strategy]
        y0 = _integrated_s(sx, sy)[0]
        guide = [y0 * (x / xs[0]) ** slope for x in xs]
        ax2.loglog(xs, guide, style, color="gray", label=f"slope {slope} (O(L^{slope}))")
    ax2.set_xlabel("sequence length L (tokens)")
    ax2.set_ylabel("time to generate L tokens (s)")
    ax2.set_title("Whole sequence (integrated from the left panel)")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def as_dicts(points: list[Point]) -> list[dict[str, Any]]:
    return [asdict(p) for p in points]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default=",".join(str(n) for n in DEFAULT_LENGTHS))
    p.add_argument("--tokens", type=int, default=4, help="measured tokens per point (4)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--png", type=Path, default=Path("bench-results/kv-cache.png"))
    args = p.parse_args()
    lengths = tuple(int(n) for n in args.lengths.split(","))
    points = run(lengths, args.tokens, args.threads)
    print(format_table(points))
    plot(points, args.png, f"SmolLM2-135M Q4_1, fp16 KV, {args.threads} threads")
    print(f"PNG: {args.png}")


if __name__ == "__main__":
    main()
