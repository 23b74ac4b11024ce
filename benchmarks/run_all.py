"""``make bench``: the benchmark suite on SmolLM2-135M on this machine, ONE table + JSON.

    python -m benchmarks.run_all                 # the full suite (about 15-25 min on 2 cores)
    python -m benchmarks.run_all --quick         # smoke run: tiny counts, every section
    python -m benchmarks.run_all --sections chat128,paged --workload-file path/to/chat128.json
    python -m benchmarks.run_all --sections chat128 --chat-levels 1:4 --llama-cpp cached

Sections, each comparison measured side by side in the same run:

- ``chat128``: the reference workload (``loadtest/workloads/prompts/chat128.json``: 64 chat
  prompts of exactly 128 tokens, 128 output tokens with ignore_eos, greedy) in closed loop at 1, 8
  and 32 users: kvserve through gRPC (a ``kvserve serve --runner torch`` subprocess) against
  Hugging Face transformers one request at a time and in static batches of the same size (the
  GGUF's weights dequantized to fp32, same thread count). kvserve serves its defaults: the GGUF's
  own Q4_1/Q8_0 weights on kvserve's kernels (``--weights auto``) and an fp16 KV cache. To fit the
  time budget a level runs fewer than 64 requests (1 user: 4, 8 users: 16, 32 users: 64); the
  table says how many. At each level llama.cpp's ``llama-server`` runs right after kvserve on the
  same GGUF, the same requests and the same load generator (``--api openai``): built once from a
  PyPI source package and cached outside the repository (``benchmarks/bench_llama_cpp.py``). When
  it cannot be built or started, its columns say "not measured: <reason>"; no figure is ever
  quoted from elsewhere.
- ``policy``: prefill-first against stall-free on a mix of long and short prompts (same token
  budget per step): p99 inter-token latency and throughput.
- ``prefix``: prefix caching on against off on a shared-system-prompt workload: TTFT.
- ``paged``: paged KV against contiguous max-length preallocation within the same KV memory
  (scheduler + cache manager + FakeRunner; method in ``benchmarks/bench_paged_kv.py``).
- ``slo``: stall-free at the default token budget against ``--policy slo`` at the same
  latency targets, on bursty mixed traffic (ITL 150 ms, TTFT 2 s) and on the loose-target
  case (chat128 in two waves, ITL 150 ms, TTFT 3 s): goodput, ITL p99 and tok/s, the two
  policies alternating in rounds on fresh servers (issue 25's targets judged on the full run).
- ``spec``: n-gram speculative decoding off against on (``--speculative ngram``), 1 user, on
  an input-grounded workload (``loadtest/workloads/edit128.json``: rewrite code or text with
  a small change) and on chat128, with the default Q4 weights; then edit128 again with
  ``--weights float32``, where a decode step is bound by streaming the weights. Off and on
  alternate in rounds, each on a fresh server, so a drift in the machine's load hits both;
  the figures sum the rounds.
- ``kvcache``: per-token decode latency against sequence length (64 ... 4,096 tokens) with
  the KV cache (``--kv-strategy always``) and recomputing every step (``disabled``), side by
  side; a table and a PNG (``benchmarks/bench_kv_cache.py``).
- ``sinks``: perplexity of a long text under attention sinks + window against the window
  alone and full attention (``benchmarks/bench_sinks.py``).
- ``kernels``: kvserve's quantized matmul against ggml's ``test-backend-ops perf -o MUL_MAT``
  from the same llama.cpp build, op by op at ggml's perf shapes for every native format (both
  activation precisions), and M = 1 against the read bandwidth measured in the same process
  (``benchmarks/bench_kernels.py``).
- ``models``: real GGUF files (the embedded Q4_1, its Q4_K_M, a random 1B Q4_K_M) against
  llama.cpp: prefill 512 / decode against ``llama-bench``, chat128 by users against
  ``llama-server`` (``benchmarks/bench_models.py``).
- ``kvtier``: KV tier 2 as users run it (``benchmarks/bench_kv_tier_served.py``): multi-turn
  conversations, returning turns' TTFT with the tier on a pool that holds only the turns in
  flight, against a pool that holds every conversation and against llama.cpp's
  ``--cache-ram`` on the same conversations; the embedded model and a 1B Q4_K_M.

``kvcache`` and ``sinks`` run with ``--kv-threads`` (1) torch threads: on a shared machine
a 2-thread OpenMP team waits on a descheduled thread, and the curve shows the neighbours,
not the cache.

The ``kvcache`` and ``sinks`` sections print their own tables under the main one. The
sections themselves are in ``benchmarks/cpu/`` (serving, chat128, cache, models), listed in
table order with the GPU ones in ``benchmarks.harness.registry``; their sizes are
``benchmarks.harness.sizes`` (``FULL``, ``--quick``: ``QUICK``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.bench_llama_cpp import LlamaCpp, find_llama_cpp, llama_cpp_note
from benchmarks.harness import registry
from benchmarks.harness.context import Context, say
from benchmarks.harness.report import format_table
from benchmarks.harness.sizes import SIZES
from loadtest.launch import cpu_model
from loadtest.workload import CHAT128_PROMPTS

REPO_ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_MODES = ("build", "cached", "off")
SECTIONS = registry.names("cpu")  # in table order


def parse_levels(text: str) -> tuple[tuple[int, int], ...]:
    """``"1:4,8:16"`` -> ``((1, 4), (8, 16))``: (users, requests) pairs, each >= 1."""
    levels = []
    for item in text.split(","):
        users, sep, requests = item.strip().partition(":")
        if not sep or not users.isdigit() or not requests.isdigit():
            raise ValueError(f"--chat-levels wants USERS:REQUESTS,..., got {text!r}")
        if int(users) < 1 or int(requests) < 1:
            raise ValueError(f"--chat-levels needs users and requests >= 1, got {item!r}")
        levels.append((int(users), int(requests)))
    return tuple(levels)


def machine_info(threads: int) -> dict[str, Any]:
    cpu = cpu_model()
    versions = {}
    for mod in ("torch", "transformers", "grpc"):
        try:
            versions[mod] = __import__(mod).__version__
        except ImportError:
            versions[mod] = None
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        **versions,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run_all", description=__doc__.splitlines()[0]
    )
    p.add_argument("--quick", action="store_true", help="smoke run with tiny counts")
    p.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    p.add_argument(
        "--workload-file",
        type=Path,
        default=CHAT128_PROMPTS,
        help="the chat128 prompt file (default: loadtest/workloads/prompts/chat128.json)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch threads, both sides (2)")
    p.add_argument(
        "--chat-levels",
        default=None,
        help="chat128 levels as USERS:REQUESTS,... (default 1:4,8:16,32:64; --quick 1:1,2:2)",
    )
    p.add_argument(
        "--llama-cpp",
        choices=LLAMA_CPP_MODES,
        default="build",
        help="chat128's llama.cpp peer: build it when not cached (default), use only a cached "
        "build, or leave it out (its columns then say why)",
    )
    p.add_argument(
        "--llama-cpp-cache-dir",
        type=Path,
        default=None,
        help="where llama-server is built and cached "
        "(default: $KVSERVE_CACHE_DIR or ~/.cache/kvserve, then llama.cpp/<version>)",
    )
    p.add_argument(
        "--kv-threads", type=int, default=1, help="torch threads of kvcache and sinks (1)"
    )
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench-results")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        names = registry.parse_names(args.sections, "cpu")
    except ValueError as e:
        p.error(str(e))
    if {"chat128", "spec"} & set(names) and not args.workload_file.is_file():
        p.error(f"chat128 prompt file not found: {args.workload_file}")
    size = "quick" if args.quick else "full"
    sizes = SIZES[size]
    if args.chat_levels:
        try:
            sizes = replace(sizes, chat_levels=parse_levels(args.chat_levels))
        except ValueError as e:
            p.error(str(e))
    t0, load_start = time.perf_counter(), os.getloadavg()
    ctx = Context(
        target="cpu",
        size=size,
        sizes=sizes,
        threads=args.threads,
        kv_threads=args.kv_threads,
        progress=not args.no_progress,
        workload_file=args.workload_file,
        out_dir=args.out_dir,
        stamp=dt.datetime.now().strftime("%Y%m%d-%H%M%S"),
        llama_cpp=LlamaCpp(None, "the chat128 section did not run"),
        llama_cpp_mode=args.llama_cpp,
    )
    if "chat128" in names:
        from benchmarks.bench_llama_cpp import default_cache_dir

        cache_dir = args.llama_cpp_cache_dir or default_cache_dir(os.environ)
        # Built before anything is timed.
        ctx.llama_cpp = find_llama_cpp(args.llama_cpp, cache_dir, say)
        if ctx.llama_cpp.binary is None:
            say(f"[chat128] llama.cpp not measured: {ctx.llama_cpp.reason}")
    report = registry.run(ctx, names)
    rows = report.rows
    peers = report.extra("chat128") or {}  # llama.cpp's reports by users
    elapsed = time.perf_counter() - t0

    machine = machine_info(args.threads)
    # A figure taken while something else ran is void: the 1-minute load when the run began
    # (nothing of the run's yet) and when it ended (the run's own threads count there).
    machine["load_avg_start"] = round(load_start[0], 2)
    machine["load_avg_end"] = round(os.getloadavg()[0], 2)
    quick_note = " (--quick smoke run: tiny counts, not figures)" if args.quick else ""
    title = (
        f"kvserve benchmarks{quick_note}"
        " - SmolLM2-135M-Instruct Q4_1 GGUF (kvserve: its own Q4_1/Q8_0 weights, fp16 KV;"
        f" transformers: dequantized to fp32), {machine['cpu']}, "
        f"{machine['logical_cpus']} logical CPUs, {args.threads} torch threads, load average "
        f"{machine['load_avg_start']:.2f} at the start, {machine['load_avg_end']:.2f} at the end"
    )
    print(title)
    print()
    print(format_table(rows))
    print()
    print(llama_cpp_note(ctx.llama_cpp, args.threads))
    print(
        "Req = requests measured per configuration (the chat128 levels run fewer than 64 "
        "requests to fit the time budget). Out tok/s = output tokens / wall time of the run; "
        "ITL = inter-token latency; percentiles by linear interpolation (numpy's default)."
    )
    for result in report.results.values():
        if result.table:
            print()
            print(result.table)
    print(f"Whole suite: {elapsed / 60:.1f} min.")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"bench-{'quick-' if args.quick else ''}{ctx.stamp}.json"
    report.header = {
        "quick": args.quick,
        "machine": machine,
        "sizes": asdict(sizes),
        "elapsed_s": elapsed,
        "llama_cpp": {
            "binary": None if ctx.llama_cpp.binary is None else str(ctx.llama_cpp.binary),
            "version": ctx.llama_cpp.version or None,
            "reason_not_measured": ctx.llama_cpp.reason or None,
            "reports_by_users": peers,  # a loadtest report, or the reason for that level
        },
    }
    report.write(path, leave_out=("chat128",))  # the header carries chat128's peers
    print(f"JSON: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
