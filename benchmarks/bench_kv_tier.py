"""KV tier 2 (``--kv-disk-dir``): the store engines, and multi-turn TTFT with the tier off/on.

    python -m benchmarks.bench_kv_tier                          # the full run (minutes)
    python -m benchmarks.bench_kv_tier --conversations 4 --turns 4 --first-len 256 --quick

Part 1, stores: LMDB against one file per block, on blocks the size of the embedded model's
(SmolLM2-135M, fp16 KV, 16 tokens: 368,640 bytes). Write throughput into an empty store and
into a full one (LRU eviction on every batch), and the median time to read one block back.

Part 2, serving: the multi-turn workload (``loadtest/workloads/multiturn.json``: S
conversations x T turns, each turn the whole history plus a user message; conversations run
concurrently with think time) through the engine ``kvserve serve`` builds (embedded model,
its default weights and KV dtype), in one process, in four configurations of one run:

    small pool, tier off   a pool of about a quarter of the working set: turns recompute
    small pool, tier on    the same pool; evicted prefixes come back from the store
    large pool             every conversation stays in tier 1 (the reference)
    restart                large pool, tier on: half the turns, then a new server on the same
                           store and the rest (each returning prefix comes from tier 2)

It reports TTFT p50 / p99 of turns 2..T, output tokens/s and the prefix hit rate by tier
(hit tokens / looked-up tokens), and for the restart the first returning turn's TTFT p50
against the same turn on the large pool. llama.cpp's ``--cache-ram`` peer is not run here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.multiturn import Conversation, MultiTurnWorkload

WORKLOAD = Path(__file__).resolve().parent.parent / "loadtest" / "workloads" / "multiturn.json"
BLOCK_SIZE = 16
SMOLLM2_BLOCK_BYTES = 2 * 30 * 3 * 64 * BLOCK_SIZE * 2  # K+V, layers, KV heads, dim, fp16


# ---------------------------------------------------------------------------- part 1


@dataclass(frozen=True, slots=True)
class StoreFigures:
    backend: str
    write_mb_s: float  # into an empty store, batches of 8 blocks
    write_evicting_mb_s: float  # into a full store (LRU eviction each batch)
    read_ms_p50: float  # one block, page cache warm
    read_ms_p99: float
    cold_read_ms_p50: float  # one block, after a restart with the files out of the page cache
    cold_read_ms_p99: float


def bench_store(kind: str, num_blocks: int, block_bytes: int, root: str) -> StoreFigures:
    """Raw store throughput on ``num_blocks`` entries of ``block_bytes`` (no model)."""
    from kv_store import open_store

    path = os.path.join(root, kind)
    payload = os.urandom(block_bytes)
    keys = [i.to_bytes(8, "big") + bytes(16) for i in range(2 * num_blocks)]
    store = open_store(kind, path, capacity_bytes=num_blocks * (block_bytes + 256))

    def write(batch_keys: list[bytes]) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(batch_keys), 8):
            store.put_many([(k, payload) for k in batch_keys[i : i + 8]])
        return len(batch_keys) * block_bytes / (time.perf_counter() - t0) / 1e6

    empty = write(keys[:num_blocks])
    reads = []
    for k in keys[: min(num_blocks, 200)]:
        t0 = time.perf_counter()
        assert store.get(k) is not None
        reads.append((time.perf_counter() - t0) * 1e3)
    evicting = write(keys[num_blocks:])
    store.close()
    _drop_from_page_cache(path)
    store = open_store(kind, path, capacity_bytes=num_blocks * (block_bytes + 256))
    cold = []
    cold_keys = keys[-min(num_blocks, 200) :]
    random.Random(0).shuffle(cold_keys)  # no help from read-ahead of the write order
    for k in cold_keys:
        t0 = time.perf_counter()
        assert store.get(k) is not None
        cold.append((time.perf_counter() - t0) * 1e3)
    store.close()
    shutil.rmtree(path, ignore_errors=True)
    reads.sort()
    cold.sort()
    return StoreFigures(
        kind,
        round(empty, 1),
        round(evicting, 1),
        round(_pct(reads, 0.5), 3),
        round(_pct(reads, 0.99), 3),
        round(_pct(cold, 0.5), 3),
        round(_pct(cold, 0.99), 3),
    )


def _drop_from_page_cache(path: str) -> None:
    """Ask the kernel to drop the store's files from the page cache (this process's view of
    a cold start; other processes' pages are untouched)."""
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)  # dirty pages are not dropped
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------------------- part 2


@dataclass(slots=True)
class RunFigures:
    name: str
    num_blocks: int
    ttft_s: dict[int, list[float]] = field(default_factory=dict)  # turn -> TTFT of each conv
    queue_s: dict[int, list[float]] = field(default_factory=dict)  # turn -> arrival to scheduled
    output_tokens: int = 0
    wall_s: float = 0.0
    queried_tokens: int = 0
    tier1_hit_tokens: int = 0
    tier2_hit_tokens: int = 0
    tier2_errors: dict[str, int] = field(default_factory=dict)

    def later_turns(self, first: int = 1, queue: bool = False) -> list[float]:
        series = self.queue_s if queue else self.ttft_s
        return sorted(x for t, xs in series.items() if t >= first for x in xs)

    def summary(self) -> dict[str, Any]:
        later = self.later_turns()
        q = max(self.queried_tokens, 1)
        return {
            "config": self.name,
            "num_blocks": self.num_blocks,
            "ttft_p50_s": round(_pct(later, 0.5), 3),
            "ttft_p99_s": round(_pct(later, 0.99), 3),
            # Arrival to first scheduled (tier 2's read while held included): the part of
            # TTFT spent waiting, for blocks or for the reader.
            "queue_p50_s": round(_pct(self.later_turns(queue=True), 0.5), 3),
            "output_tok_s": round(self.output_tokens / self.wall_s, 1) if self.wall_s else 0.0,
            "hit_rate_tier1": round(self.tier1_hit_tokens / q, 3),
            "hit_rate_tier2": round(self.tier2_hit_tokens / q, 3),
            "tier2_errors": self.tier2_errors,
        }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def build(num_blocks: int, disk_dir: str | None, threads: int) -> Any:
    from server.build import build_engine
    from server.config import ServerConfig

    cfg = ServerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        threads=threads,
        kv_disk_dir=disk_dir,
        kv_disk_bytes="8GiB",
        metrics=False,
        max_num_seqs=8,
    )
    return build_engine(cfg)


async def _drive(
    engine: Any, conversations: list[Conversation], turns: range, output_len: int, fig: RunFigures
) -> None:
    from scheduler import Request, SamplingParams
    from server.engine_client import EngineClient

    client = EngineClient(engine)

    async def conversation(conv: Conversation) -> None:
        for turn in turns:
            # Think time before every turn but the first (also right after a restart, so
            # the returning turns arrive as they do on the warm server).
            await asyncio.sleep(conv.think_time_s[turn])
            req = Request(
                request_id=f"{conv.name}-t{turn}-{fig.name}",
                prompt_token_ids=conv.prompt(turn),
                sampling=SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
            )
            tokens: list[int] = []
            async for out in client.generate(req):
                tokens += out.token_ids
                if out.finished:
                    fig.ttft_s.setdefault(turn, []).append(out.time_to_first_token_s or 0.0)
                    fig.queue_s.setdefault(turn, []).append(out.queue_time_s or 0.0)
            fig.output_tokens += len(tokens)
            if len(conv.answers) == turn:
                conv.answers.append(tokens)

    await asyncio.gather(*(conversation(c) for c in conversations))


def run_config(
    name: str,
    workload: MultiTurnWorkload,
    conversations: list[Conversation],
    turns: range,
    num_blocks: int,
    disk_dir: str | None,
    threads: int,
    fig: RunFigures | None = None,
) -> RunFigures:
    """One server (engine), ``turns`` of every conversation, then a graceful stop."""
    fig = fig if fig is not None else RunFigures(name, num_blocks)
    built = build(num_blocks, disk_dir, threads)
    engine = built.engine
    engine.start()
    try:
        asyncio.run(_warm_up(engine))
        stats0 = engine.latest_stats.kv
        t0 = time.perf_counter()
        asyncio.run(_drive(engine, conversations, turns, workload.output_len, fig))
        fig.wall_s += time.perf_counter() - t0
        stats = engine.latest_stats.kv
    finally:
        engine.stop(60)
    fig.queried_tokens += stats.prefix_queries_tokens_total - stats0.prefix_queries_tokens_total
    t2 = stats.tier2_hit_tokens_total - stats0.tier2_hit_tokens_total
    all_hits = stats.prefix_hits_tokens_total - stats0.prefix_hits_tokens_total
    fig.tier2_hit_tokens += t2
    fig.tier1_hit_tokens += all_hits - t2
    if stats.tier2 is not None:
        for kind, n in stats.tier2.errors_total.items():
            fig.tier2_errors[kind] = fig.tier2_errors.get(kind, 0) + n
    return fig


async def _warm_up(engine: Any) -> None:
    """One short request first: one-time costs (kernels, allocations) off the figures."""
    from scheduler import Request, SamplingParams
    from server.engine_client import EngineClient

    req = Request(
        request_id="warm-up",
        prompt_token_ids=list(range(1000, 1100)),
        sampling=SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
    )
    async for _ in EngineClient(engine).generate(req):
        pass


def bench_serving(workload: MultiTurnWorkload, threads: int, root: str) -> dict[str, Any]:
    from model_runner.loader import load_tokenizer

    vocab = load_tokenizer(None).vocab_size
    turns = range(workload.num_turns)
    max_tokens = workload.first_len + (workload.num_turns - 1) * (
        (workload.turn_len.high or workload.turn_len.value) + workload.output_len
    )
    per_conv = -(-(max_tokens + workload.output_len) // BLOCK_SIZE) + 1
    working_set = workload.num_conversations * per_conv
    small = max(per_conv + 8, working_set // 4)
    large = working_set + 64

    def fresh() -> list[Conversation]:
        return workload.build(vocab)

    results: dict[str, RunFigures] = {}
    results["small, tier off"] = run_config(
        "small, tier off", workload, fresh(), turns, small, None, threads
    )
    results["small, tier on"] = run_config(
        "small, tier on", workload, fresh(), turns, small, os.path.join(root, "on"), threads
    )
    results["large pool"] = run_config("large pool", workload, fresh(), turns, large, None, threads)
    half = workload.num_turns // 2
    convs = fresh()
    # The restart isolates the restart: the large pool, so tier 1 is only empty because the
    # server started again, and every returning prefix comes from tier 2.
    restart = RunFigures("restart, large pool, tier on", large)
    restart_dir = os.path.join(root, "restart")
    run_config(
        "restart (tier on)", workload, convs, range(half), large, restart_dir, threads, restart
    )
    run_config(
        "restart (tier on)",
        workload,
        convs,
        range(half, workload.num_turns),
        large,
        restart_dir,
        threads,
        restart,
    )
    results["restart"] = restart
    returning = sorted(restart.ttft_s[half])
    warm = sorted(results["large pool"].ttft_s[half])
    return {
        "working_set_blocks": working_set,
        "small_pool_blocks": small,
        "large_pool_blocks": large,
        "configs": [r.summary() for r in results.values()],
        "restart_first_returning_turn": {
            "turn": half + 1,
            "ttft_p50_s_after_restart": round(_pct(returning, 0.5), 3),
            "ttft_p50_s_large_pool": round(_pct(warm, 0.5), 3),
        },
    }


def print_tables(stores: list[StoreFigures], serving: dict[str, Any] | None) -> None:
    print("\nStores (blocks of", SMOLLM2_BLOCK_BYTES, "bytes)")
    print(
        f"{'backend':8} {'write MB/s':>11} {'write+evict MB/s':>17} {'read p50 ms':>12} "
        f"{'read p99 ms':>12} {'cold p50 ms':>12} {'cold p99 ms':>12}"
    )
    for s in stores:
        print(
            f"{s.backend:8} {s.write_mb_s:>11} {s.write_evicting_mb_s:>17} "
            f"{s.read_ms_p50:>12} {s.read_ms_p99:>12} {s.cold_read_ms_p50:>12} "
            f"{s.cold_read_ms_p99:>12}"
        )
    if serving is None:
        return
    print(
        f"\nMulti-turn serving (turns 2..T; working set {serving['working_set_blocks']} blocks, "
        f"small pool {serving['small_pool_blocks']}, large {serving['large_pool_blocks']})"
    )
    base = next(c for c in serving["configs"] if c["config"] == "small, tier off")
    ref = next(c for c in serving["configs"] if c["config"] == "large pool")
    print(
        f"{'config':30} {'TTFT p50 s':>10} {'p99 s':>7} {'vs off':>7} {'vs large':>8} "
        f"{'queue p50 s':>11} {'out tok/s':>9} {'hit t1':>7} {'hit t2':>7}"
    )
    for c in serving["configs"]:
        print(
            f"{c['config']:30} {c['ttft_p50_s']:>10} {c['ttft_p99_s']:>7} "
            f"{c['ttft_p50_s'] / base['ttft_p50_s']:>7.2f} "
            f"{c['ttft_p50_s'] / ref['ttft_p50_s']:>8.2f} {c['queue_p50_s']:>11} "
            f"{c['output_tok_s']:>9} {c['hit_rate_tier1']:>7} {c['hit_rate_tier2']:>7}"
        )
    r = serving["restart_first_returning_turn"]
    print(
        f"\nRestart: turn {r['turn']} TTFT p50 {r['ttft_p50_s_after_restart']} s after the "
        f"restart vs {r['ttft_p50_s_large_pool']} s on the warm large pool "
        f"({r['ttft_p50_s_after_restart'] / r['ttft_p50_s_large_pool']:.2f}x)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default=str(WORKLOAD))
    parser.add_argument("--conversations", type=int, help="override the workload's count")
    parser.add_argument("--turns", type=int, help="override the workload's turns")
    parser.add_argument("--first-len", type=int, help="override the first message's tokens")
    parser.add_argument("--output-len", type=int, help="override the answer tokens")
    parser.add_argument("--store-blocks", type=int, default=512, help="blocks per store run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", help="where the stores go (default: a temporary directory)")
    parser.add_argument("--stores-only", action="store_true", help="skip the serving part")
    parser.add_argument("--quick", action="store_true", help="tiny counts (wiring, not figures)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    workload = MultiTurnWorkload.load(args.workload)
    changes = {
        k: v
        for k, v in (
            ("num_conversations", args.conversations),
            ("num_turns", args.turns),
            ("first_len", args.first_len),
            ("output_len", args.output_len),
        )
        if v is not None
    }
    if args.quick:
        changes = {
            "num_conversations": 2,
            "num_turns": 2,
            "first_len": 64,
            "output_len": 4,
            "think_max_s": 0.0,
            **changes,
        }
        args.store_blocks = 32
    workload = workload.scaled(**changes)
    root = args.dir or tempfile.mkdtemp(prefix="kvserve-kv-tier-")
    try:
        stores = [
            bench_store(k, args.store_blocks, SMOLLM2_BLOCK_BYTES, root) for k in ("lmdb", "file")
        ]
        serving = None if args.stores_only else bench_serving(workload, args.threads, root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print_tables(stores, serving)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "workload": asdict(workload),
                    "stores": [asdict(s) for s in stores],
                    "serving": serving,
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
