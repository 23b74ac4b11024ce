"""KV tier 2 as users run it: ``kvserve serve`` and llama.cpp's ``llama-server`` on the same
multi-turn conversations, the embedded model and a 1B Q4_K_M, one run.

    python -m benchmarks.bench_kv_tier_served                       # both models (minutes)
    python -m benchmarks.bench_kv_tier_served --models embedded --quick

S conversations x T turns (``loadtest/workloads/multiturn.json``: each turn is the whole
history plus a user message), at most ``--users`` turns in flight (the rest think or wait
for a user), greedy, ``ignore_eos``. Per model, each server fresh, one after the other:

    kvserve, pool holds all     ``--num-blocks`` = every conversation at its longest: the
                                reference, nothing ever leaves tier 1
    kvserve, tier on            a pool that holds the turns in flight (``--users`` of them at
                                their longest, so no turn waits for blocks: the queue is not
                                the bottleneck) but not every history; ``--kv-disk-dir``
    kvserve, tier off           the same pool without the tier: returning turns recompute
    llama.cpp --cache-ram       ``--parallel`` = ``--users`` slots of one conversation each;
                                ``--cache-ram`` keeps the prompts of slots it reassigns in host
                                memory and loads a returning prompt from there (llama.cpp's
                                counterpart of a tier 2)

Each client sends token ids and reads token ids back (kvserve: gRPC ``Generate``; llama.cpp:
``POST /completion`` with ``return_tokens``), streaming; TTFT is measured by the client, from
the request to the first token, over the returning turns (2..T). Each server gets one
warm-up request first. The models' answers differ (their numerics differ), the lengths do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.multiturn import Conversation, MultiTurnWorkload

WORKLOAD = Path(__file__).resolve().parent.parent / "loadtest" / "workloads" / "multiturn.json"
MODELS = ("embedded", "random-1b-q4km")
BLOCK_SIZE = 16
CONFIGS = ("kvserve, pool holds all", "kvserve, tier on", "kvserve, tier off",
           "llama.cpp --cache-ram")  # fmt: skip
CACHE_RAM_MIB = 2048  # llama.cpp's prompt cache: room for every conversation of these runs
# Acceptance (issue 34): returning turns' TTFT p50 with the tier at most this multiple of the
# pool that holds everything, and at most llama.cpp's with --cache-ram.
TARGET_VS_ALL_IN_POOL = 1.3
TARGET_VS_LLAMA_CPP = 1.0

# (prompt token ids, max tokens) -> (seconds to the first token, every token id)
Generate = Callable[[list[int], int], Awaitable[tuple[float, list[int]]]]


@dataclass(slots=True)
class ServedFigures:
    model: str
    config: str
    pool_blocks: int | None  # kvserve's --num-blocks; None for llama.cpp
    ttft_s: dict[int, list[float]] = field(default_factory=dict)  # turn -> each conversation's
    output_tokens: int = 0
    wall_s: float = 0.0
    note: str = ""  # why it was not measured, or the server's own figures

    def returning(self) -> list[float]:
        return sorted(x for turn, xs in self.ttft_s.items() if turn >= 1 for x in xs)

    def summary(self) -> dict[str, Any]:
        later = self.returning()
        return {
            "model": self.model,
            "config": self.config,
            "pool_blocks": self.pool_blocks,
            "ttft_p50_s": round(pct(later, 0.5), 3) if later else None,
            "ttft_p99_s": round(pct(later, 0.99), 3) if later else None,
            "output_tok_s": round(self.output_tokens / self.wall_s, 1) if self.wall_s else None,
            "note": self.note,
        }


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


@dataclass(frozen=True, slots=True)
class Pools:
    """Blocks per conversation at its longest, the pool that holds all of them, and the
    pool that holds only the turns in flight."""

    per_conversation: int
    all_conversations: int
    in_flight: int
    max_tokens: int  # a conversation's longest prompt + answer

    @classmethod
    def of(cls, workload: MultiTurnWorkload, users: int) -> Pools:
        longest_turn = workload.turn_len.high or workload.turn_len.value
        max_tokens = (
            workload.first_len
            + (workload.num_turns - 1) * (longest_turn + workload.output_len)
            + workload.output_len
            + 1  # a BOS, should a server add one
        )
        per_conv = -(-max_tokens // BLOCK_SIZE) + 1
        return cls(
            per_conv,
            workload.num_conversations * per_conv + 16,
            min(users, workload.num_conversations) * per_conv + 16,
            max_tokens,
        )


async def drive(
    generate: Generate,
    conversations: list[Conversation],
    output_len: int,
    users: int,
    fig: ServedFigures,
) -> None:
    """Every conversation turn by turn, with its think time, at most ``users`` turns in flight."""
    seats = asyncio.Semaphore(users)

    async def conversation(conv: Conversation) -> None:
        for turn in range(len(conv.user)):
            await asyncio.sleep(conv.think_time_s[turn])
            async with seats:
                ttft, tokens = await generate(conv.prompt(turn), output_len)
            if len(tokens) != output_len:
                raise RuntimeError(f"{conv.name} turn {turn}: {len(tokens)} of {output_len} tokens")
            fig.ttft_s.setdefault(turn, []).append(ttft)
            fig.output_tokens += len(tokens)
            conv.answers.append(tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(c) for c in conversations))
    fig.wall_s += time.perf_counter() - t0


def kvserve_generate(client: Any) -> Generate:
    async def generate(prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        first, tokens = 0.0, []
        async for r in client.generate(prompt, max_tokens=max_tokens, ignore_eos=True):
            if r.token_ids and not tokens:
                first = time.perf_counter() - t0
            tokens += r.token_ids
        return first, tokens

    return generate


def llama_cpp_generate(http: Any) -> Generate:
    """llama-server's native ``/completion``, streamed, token ids in and out."""

    async def generate(prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        body = {
            "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": True, "return_tokens": True, "stream": True,
        }  # fmt: skip
        t0 = time.perf_counter()
        first, tokens = 0.0, []
        async with http.stream("POST", "/completion", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"llama-server: {reply.status_code} {await reply.aread()!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[len("data: ") :])
                new = list(chunk.get("tokens") or [])
                if chunk.get("stop"):  # the final message may repeat what was streamed
                    predicted = int(chunk.get("tokens_predicted", len(tokens)))
                    missing = predicted - len(tokens)
                    new = new[len(new) - missing :] if missing > 0 else []
                    # A last token whose text is an incomplete UTF-8 character is never
                    # streamed (nor in the final message): its id stands in as the previous
                    # one. The next turn's prompt then differs from llama.cpp's cached state
                    # at that one token, which it recomputes with the new user message.
                    new += tokens[-1:] * (missing - len(new))
                if new and not tokens:
                    first = time.perf_counter() - t0
                tokens += new
        return first, tokens

    return generate


def run_kvserve(
    model: str, path: Path, config: str, pool: int, workload: MultiTurnWorkload, vocab: int,
    users: int, threads: int, disk_dir: str | None,
) -> ServedFigures:  # fmt: skip
    from loadtest.launch import ServerProcess
    from server.client import KVServeClient

    fig = ServedFigures(model, config, pool)
    args = [
        "--runner", "torch", "--model", str(path), "--threads", str(threads),
        "--num-blocks", str(pool), "--block-size", str(BLOCK_SIZE),
        "--max-num-seqs", str(users),
    ]  # fmt: skip
    if disk_dir is not None:
        args += ["--kv-disk-dir", disk_dir, "--kv-disk-bytes", "8GiB"]

    async def main(target: str) -> None:
        async with KVServeClient(target) as client:
            generate = kvserve_generate(client)
            await generate(list(range(1000, 1100)), 2)  # warm-up
            await drive(generate, workload.build(vocab), workload.output_len, users, fig)

    with ServerProcess(args, metrics=False) as server:
        asyncio.run(main(server.target))
    return fig


def run_llama_cpp(
    model: str, path: Path, binary: Path | None, workload: MultiTurnWorkload, vocab: int,
    users: int, threads: int, pools: Pools,
) -> ServedFigures:  # fmt: skip
    import httpx

    from benchmarks.bench_llama_cpp import LlamaServer

    fig = ServedFigures(model, "llama.cpp --cache-ram", None)
    if binary is None:
        fig.note = "not measured: no llama-server build"
        return fig
    ctx_per_slot = -(-pools.max_tokens // 256) * 256
    server = LlamaServer(
        binary, path, threads, slots=users, ctx_per_slot=ctx_per_slot,
        extra=["--cache-ram", str(CACHE_RAM_MIB)],
    )  # fmt: skip

    async def main(target: str) -> None:
        async with httpx.AsyncClient(base_url=target, timeout=1800) as http:
            generate = llama_cpp_generate(http)
            await generate(list(range(1000, 1100)), 2)  # warm-up
            await drive(generate, workload.build(vocab), workload.output_len, users, fig)

    try:
        with server:
            try:
                asyncio.run(main(server.target))
            except httpx.HTTPError as exc:  # the server went away mid-run: say how it ended
                tail = server.log()[-600:]
                raise RuntimeError(f"{exc!r}; llama-server's log ends: {tail}") from exc
    except (RuntimeError, TimeoutError, OSError) as exc:
        fig.note = f"not measured: {type(exc).__name__}: {exc}"
        fig.ttft_s.clear()
    return fig


def model_vocab(path: Path) -> int:
    """The vocabulary of a GGUF file (its tokenizer's token count): prompts stay inside it."""
    from model_runner.gguf_loader import read_metadata

    tokens = read_metadata(str(path)).get("tokenizer.ggml.tokens")
    return len(tokens) if tokens else 32_000


def run(
    models: dict[str, Path],
    workload: MultiTurnWorkload,
    users: int,
    threads: int,
    llama_server: Path | None,
    root: str,
    say: Callable[[str], None] = print,
) -> list[ServedFigures]:
    """Every model x configuration (``CONFIGS``), in that order, each on a fresh server."""
    pools = Pools.of(workload, users)
    out: list[ServedFigures] = []
    for model, path in models.items():
        vocab = model_vocab(path)
        say(
            f"[kvtier] {model}: {workload.num_conversations} conversations x "
            f"{workload.num_turns} turns, {users} users; pools {pools.all_conversations} "
            f"(all) / {pools.in_flight} (in flight) blocks"
        )
        common = (workload, vocab, users, threads)
        tier_dir = os.path.join(root, f"tier-{model}")
        kvserve = (
            (CONFIGS[0], pools.all_conversations, None),
            (CONFIGS[1], pools.in_flight, tier_dir),
            (CONFIGS[2], pools.in_flight, None),
        )
        for config, pool, disk_dir in kvserve:
            out.append(run_kvserve(model, path, config, pool, *common, disk_dir))
            say(f"  {json.dumps(out[-1].summary())}")
        out.append(run_llama_cpp(model, path, llama_server, *common, pools))
        say(f"  {json.dumps(out[-1].summary())}")
    return out


def verdicts(figures: list[ServedFigures]) -> dict[str, dict[str, Any]]:
    """Per model: the tier's TTFT p50 against the full pool's and against llama.cpp's."""
    out: dict[str, dict[str, Any]] = {}
    for model in dict.fromkeys(f.model for f in figures):
        p50 = {f.config: f.summary()["ttft_p50_s"] for f in figures if f.model == model}
        tier, full, peer = p50.get(CONFIGS[1]), p50.get(CONFIGS[0]), p50.get(CONFIGS[3])
        vs_full = tier / full if tier and full else None
        vs_peer = tier / peer if tier and peer else None
        out[model] = {
            "tier_vs_pool_holds_all": round(vs_full, 2) if vs_full is not None else None,
            "holds_vs_pool": vs_full is not None and vs_full <= TARGET_VS_ALL_IN_POOL,
            "tier_vs_llama_cpp": round(vs_peer, 2) if vs_peer is not None else None,
            "holds_vs_llama_cpp": vs_peer is not None and vs_peer <= TARGET_VS_LLAMA_CPP,
        }
    return out


def format_table(figures: list[ServedFigures]) -> str:
    lines = [
        "| model | config | pool blocks | returning TTFT p50 s | p99 s | vs pool holds all "
        "| vs llama.cpp | output tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        s = f.summary()
        same = {g.config: g.summary()["ttft_p50_s"] for g in figures if g.model == f.model}
        full, peer = same.get(CONFIGS[0]), same.get(CONFIGS[3])
        p50, p99, tok_s = s["ttft_p50_s"], s["ttft_p99_s"], s["output_tok_s"]
        lines.append(
            f"| {f.model} | {f.config} | {f.pool_blocks or '-'} | {_or_dash(p50)} "
            f"| {_or_dash(p99)} | {f'{p50 / full:.2f}x' if p50 and full else '-'} "
            f"| {f'{p50 / peer:.2f}x' if p50 and peer else (f.note or '-')} "
            f"| {_or_dash(tok_s)} |"
        )
    return "\n".join(lines)


def _or_dash(value: float | None) -> str:
    return "-" if value is None else str(value)


def workload_for(quick: bool, **changes: Any) -> MultiTurnWorkload:
    workload = MultiTurnWorkload.load(WORKLOAD)
    changes = {k: v for k, v in changes.items() if v is not None}
    if quick:
        changes = {"num_conversations": 3, "num_turns": 2, "first_len": 64, "output_len": 4,
                   "think_max_s": 0.0, **changes}  # fmt: skip
    return workload.scaled(**changes)


def main(argv: list[str] | None = None) -> int:
    from benchmarks import bench_llama_cpp, bench_models

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--conversations", type=int)
    p.add_argument("--turns", type=int)
    p.add_argument("--first-len", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--users", type=int, default=2, help="turns in flight at most")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp", choices=["build", "cached", "off"], default="cached")
    p.add_argument("--quick", action="store_true", help="tiny counts (wiring, not figures)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    workload = workload_for(
        args.quick,
        num_conversations=args.conversations,
        num_turns=args.turns,
        first_len=args.first_len,
        output_len=args.output_len,
    )
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    if args.llama_cpp == "off":
        tools: dict[str, Path] = {}
    else:
        tools = bench_llama_cpp.ensure_tools(cache_dir, build=args.llama_cpp == "build")
    names = args.models.split(",")
    paths = bench_models.build_models(
        names,
        cache_dir.parent.parent / "models",
        tools.get("llama-quantize", Path("/nonexistent")),
    )
    root = tempfile.mkdtemp(prefix="kvserve-kv-tier-served-")
    try:
        figures = run(
            {n: p for n, (p, _) in paths.items()}, workload, args.users, args.threads,
            tools.get("llama-server"), root,
            say=lambda m: print(m, file=sys.stderr, flush=True),
        )  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(format_table(figures))
    print(json.dumps(verdicts(figures), indent=2))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "workload": asdict(workload),
                    "users": args.users,
                    "runs": [f.summary() for f in figures],
                    "verdicts": verdicts(figures),
                },
                indent=2,
                default=str,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
