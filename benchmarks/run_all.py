"""``make bench``: the benchmark suite on SmolLM2-135M on this machine, ONE table + JSON.

    python -m benchmarks.run_all                 # the full suite (about 15-25 min on 2 cores)
    python -m benchmarks.run_all --quick         # smoke run: tiny counts, every section
    python -m benchmarks.run_all --sections chat128,paged --workload-file path/to/chat128.json
    python -m benchmarks.run_all --sections chat128 --chat-levels 1:4 --llama-cpp cached

Sections, each comparison measured side by side in the same run:

- ``chat128``: the reference workload (``../shared/workloads/chat128.json``: 64 chat prompts of
  exactly 128 tokens, 128 output tokens with ignore_eos, greedy) in closed loop at 1, 8 and 32
  users: kvserve through gRPC (a ``kvserve serve --runner torch`` subprocess) against Hugging
  Face transformers one request at a time and in static batches of the same size (the GGUF's
  weights dequantized to fp32, same thread count). kvserve serves its defaults: the GGUF's own
  Q4_1/Q8_0 weights on kvserve's kernels (``--weights auto``) and an fp16 KV cache. To fit
  the time budget a level runs fewer than 64 requests (1 user: 4, 8 users: 16, 32 users: 64);
  the table says how many. At each level llama.cpp's
  ``llama-server`` runs right after kvserve on the same GGUF, the same requests and the same
  load generator (``--api openai``): built once from a PyPI source package and cached outside
  the repository (``benchmarks/bench_llama_cpp.py``). When it cannot be built or started, its
  columns say "not measured: <reason>"; no figure is ever quoted from elsewhere.
- ``policy``: prefill-first against stall-free on a mix of long and short prompts (same token
  budget per step): p99 inter-token latency and throughput.
- ``prefix``: prefix caching on against off on a shared-system-prompt workload: TTFT.
- ``paged``: paged KV against contiguous max-length preallocation within the same KV memory
  (scheduler + cache manager + FakeRunner; method in ``benchmarks/bench_paged_kv.py``).
- ``slo``: stall-free at the default token budget against ``--policy slo`` at the same
  latency targets (ITL 150 ms, TTFT 2 s) on bursty mixed traffic: ITL p99 and goodput.
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

``kvcache`` and ``sinks`` run with ``--kv-threads`` (1) torch threads: on a shared machine
a 2-thread OpenMP team waits on a descheduled thread, and the curve shows the neighbours,
not the cache.

The ``kvcache`` and ``sinks`` sections print their own tables under the main one.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CHAT128 = REPO_ROOT.parent / "shared" / "workloads" / "chat128.json"
SECTIONS = ("chat128", "policy", "slo", "prefix", "paged", "spec", "kvcache", "sinks")
EDIT128 = REPO_ROOT / "loadtest" / "workloads" / "edit128.json"
# Issue 13's targets, 1 user, off vs on in the same run: edit128 >= 1.5x output tok/s, and
# chat128 loses at most 5 %.
TARGET_SPEC_EDIT = 1.5
TARGET_SPEC_CHAT = 0.95
F32 = ["--weights", "float32"]

LLAMA_CPP_MODES = ("build", "cached", "off")
# Issue 10's targets, kvserve against llama.cpp measured in the same run: output tok/s ratio by
# users, and kvserve's ITL p99 at most this fraction of llama.cpp's at 32 users.
TARGET_VS_LLAMA_CPP = {1: 1.3, 8: 2.0, 32: 3.0}
TARGET_ITL_P99_VS_LLAMA_CPP_32 = 0.5
# Issue 7's targets for kvserve through gRPC with fp32 weights.
TARGET_TOK_S = {1: 20.0, 8: 100.0, 32: 250.0}
TARGET_ITL_P99_MS_32 = 200.0


@dataclass(frozen=True, slots=True)
class Sizes:
    chat_levels: tuple[tuple[int, int], ...]  # (users, requests)
    chat_output_tokens: int
    hf_serial_requests: int
    policy_requests: int
    policy_users: int
    policy_long_len: int
    policy_long_fraction: float
    policy_output_tokens: int
    policy_step_tokens: int  # max_num_batched_tokens (and the largest chunk), both policies
    slo_requests: int
    slo_users: int
    prefix_requests: int
    prefix_users: int
    prefix_num_prefixes: int
    prefix_len: int
    prefix_output_tokens: int
    paged_requests: int
    paged_budget_tokens: int
    paged_max_model_len: int
    spec_requests: int  # per round and configuration
    spec_rounds: int
    spec_output_tokens: int
    run_duration_s: float
    kvcache_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    kvcache_tokens: int = 4  # measured tokens per length and strategy
    sinks_tokens: int = 4096  # tokens of the text scored
    sinks_cache: int = 256  # visible keys per query (sinks + window, or window alone)


FULL = Sizes(
    chat_levels=((1, 4), (8, 16), (32, 64)),
    chat_output_tokens=128,
    hf_serial_requests=4,
    policy_requests=32,
    policy_users=8,
    policy_long_len=1024,
    policy_long_fraction=0.25,
    policy_output_tokens=64,
    policy_step_tokens=512,
    slo_requests=64,
    slo_users=8,
    prefix_requests=24,
    prefix_users=2,
    prefix_num_prefixes=4,
    prefix_len=512,
    prefix_output_tokens=16,
    paged_requests=64,
    paged_budget_tokens=16_384,
    paged_max_model_len=2048,
    spec_requests=4,
    spec_rounds=2,
    spec_output_tokens=128,
    run_duration_s=900.0,
)
QUICK = Sizes(
    chat_levels=((1, 1), (2, 2)),
    chat_output_tokens=8,
    hf_serial_requests=1,
    policy_requests=4,
    policy_users=2,
    policy_long_len=256,
    policy_long_fraction=0.25,
    policy_output_tokens=8,
    policy_step_tokens=256,
    slo_requests=4,
    slo_users=2,
    prefix_requests=4,
    prefix_users=1,
    prefix_num_prefixes=2,
    prefix_len=64,
    prefix_output_tokens=4,
    paged_requests=16,
    paged_budget_tokens=4096,
    paged_max_model_len=1024,
    spec_requests=1,
    spec_rounds=1,
    spec_output_tokens=8,
    run_duration_s=300.0,
    kvcache_lengths=(64, 128, 256),
    kvcache_tokens=2,
    sinks_tokens=512,
    sinks_cache=128,
)


@dataclass(slots=True)
class Row:
    """One line of the table; None prints as '-'."""

    section: str
    setting: str
    system: str
    requests: int | None = None
    out_tok_s: float | None = None
    itl_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    peak_concurrent: int | None = None
    cache_efficiency: float | None = None
    vs_baseline: str = ""
    llama_cpp_tok_s: float | str | None = None  # a figure, or "not measured: <reason>"
    llama_cpp_itl_p99_ms: float | None = None
    vs_llama_cpp: str = ""
    notes: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _row_from_report(section: str, setting: str, system: str, report: dict[str, Any]) -> Row:
    lat = report["latency_s"]
    return Row(
        section=section,
        setting=setting,
        system=system,
        requests=report["requests"]["ok"],
        out_tok_s=report["output_token_throughput_tps"],
        itl_p99_ms=_ms(lat["itl"]["p99"]),
        ttft_p50_ms=_ms(lat["ttft"]["p50"]),
        ttft_p99_ms=_ms(lat["ttft"]["p99"]),
        raw=report,
    )


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


@dataclass(frozen=True, slots=True)
class LlamaCpp:
    """llama.cpp in this run: a binary to measure, or the reason it is not measured."""

    binary: Path | None
    reason: str = ""
    version: str = ""


def find_llama_cpp(mode: str, cache_dir: Path) -> LlamaCpp:
    """``build``: the cached binary, built first when missing; ``cached``: only a cached one;
    ``off``: none. Never raises: a failure becomes the reason the table prints."""
    from benchmarks import bench_llama_cpp

    if mode == "off":
        return LlamaCpp(None, "--llama-cpp off")
    try:
        binary = bench_llama_cpp.ensure_binary(cache_dir, build=mode == "build", say=_say)
    except bench_llama_cpp.LlamaCppUnavailable as e:
        return LlamaCpp(None, str(e))
    return LlamaCpp(binary, version=bench_llama_cpp.binary_version(binary))


def _llama_cpp_columns(kv: Row, peer: dict[str, Any] | str, users: int, full: bool) -> None:
    """Fill kv's llama.cpp cells from peer's report (or the reason it has none)."""
    if isinstance(peer, str):
        kv.llama_cpp_tok_s = f"not measured: {peer}"
        return
    tok_s = peer["output_token_throughput_tps"]
    itl = _ms(peer["latency_s"]["itl"]["p99"])
    kv.llama_cpp_tok_s, kv.llama_cpp_itl_p99_ms = tok_s, itl
    tok_ratio = _ratio(kv.out_tok_s, tok_s)
    itl_ratio = _ratio(kv.itl_p99_ms, itl)
    text = f"{_fmt(tok_ratio, '.2f')}x tok/s"
    target = TARGET_VS_LLAMA_CPP.get(users)
    if full and target is not None:
        text += f" (target >= {target:g}x: {'met' if (tok_ratio or 0) >= target else 'MISSED'})"
    text += f"; ITL p99 {_fmt(itl_ratio, '.2f')}x"
    if full and users == 32:
        ok = itl_ratio is not None and itl_ratio <= TARGET_ITL_P99_VS_LLAMA_CPP_32
        text += f" (target <= {TARGET_ITL_P99_VS_LLAMA_CPP_32:g}x: {'met' if ok else 'MISSED'})"
    failed = peer["requests"]["failed"] + peer["requests"]["interrupted"]
    if failed:
        text += f"; {failed} llama.cpp requests failed or interrupted"
    kv.vs_llama_cpp = text


# ------------------------------------------------------------------------------ sections


def section_chat128(
    sizes: Sizes, chat_path: Path, threads: int, progress: bool, llama_cpp: LlamaCpp
) -> tuple[list[Row], dict[str, Any]]:
    """The chat128 rows, and llama.cpp's reports by users (or the reason for each level)."""
    import torch

    from benchmarks import bench_llama_cpp, bench_serving, bench_transformers
    from model_runner.gguf_loader import default_model_path
    from model_runner.loader import load_model
    from model_runner.reference import build_hf_model

    prompts_text = json.loads(chat_path.read_text())["prompts"]
    out_tokens = sizes.chat_output_tokens

    # Transformers baselines first (in this process), then free the model for the servers.
    torch.set_num_threads(threads)
    loaded = load_model(None, "float32")
    model = build_hf_model(loaded.config, loaded.state_dict)
    tok_prompts = [loaded.tokenizer.encode(p, add_special_tokens=False) for p in prompts_text]
    pad_id = (loaded.config.eos_token_ids or (0,))[0]
    del loaded
    bench_transformers.warm_up(model, tok_prompts[-1], pad_id)

    def prompts_for(n: int) -> list[list[int]]:
        return [tok_prompts[i % len(tok_prompts)] for i in range(n)]

    _say(f"[chat128] transformers one at a time: {sizes.hf_serial_requests} requests")
    serial = bench_transformers.run_batches(
        model,
        prompts_for(sizes.hf_serial_requests),
        batch_size=1,
        max_new_tokens=out_tokens,
        pad_id=pad_id,
    )
    static: dict[int, bench_transformers.HFRun] = {}
    for users, num_requests in sizes.chat_levels:
        if users == 1:
            continue
        _say(f"[chat128] transformers static batches of {users}: {num_requests} requests")
        static[users] = bench_transformers.run_batches(
            model,
            prompts_for(num_requests),
            batch_size=users,
            max_new_tokens=out_tokens,
            pad_id=pad_id,
        )
    del model
    gc.collect()

    rows: list[Row] = []
    peers: dict[str, Any] = {}
    for users, num_requests in sizes.chat_levels:
        _say(f"[chat128] kvserve via gRPC, {users} users: {num_requests} requests")
        workload = bench_serving.chat128_workload(chat_path, num_requests, out_tokens)
        report = bench_serving.measure(
            ["--threads", str(threads)],
            workload,
            users=users,
            num_requests=num_requests,
            duration_s=sizes.run_duration_s,
            desc=f"kvserve chat128 {users} users",
            progress=progress,
        )
        peer: dict[str, Any] | str = llama_cpp.reason
        if llama_cpp.binary is not None:
            _say(f"[chat128] llama.cpp server via HTTP, {users} users: {num_requests} requests")
            try:
                peer = bench_llama_cpp.measure(
                    llama_cpp.binary,
                    default_model_path(),
                    workload,
                    threads=threads,
                    users=users,
                    num_requests=num_requests,
                    duration_s=sizes.run_duration_s,
                    desc=f"llama.cpp chat128 {users} users",
                    progress=progress,
                )
            except (RuntimeError, TimeoutError, OSError) as e:
                peer = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                _say(f"[chat128] llama.cpp at {users} users failed: {e}")
        peers[str(users)] = peer
        setting = f"{users} user{'s' if users > 1 else ''}, {out_tokens} out"
        kv = _row_from_report("chat128", setting, "kvserve (gRPC, --weights auto)", report)
        _llama_cpp_columns(kv, peer, users, full=out_tokens == FULL.chat_output_tokens)
        hf_serial = _hf_row("chat128", setting, "transformers one-at-a-time", serial)
        hf_serial.notes = f"measured once ({serial.num_requests} req); independent of users"
        baseline = serial if users == 1 else static[users]
        if users == 1:
            hf_static = _hf_row("chat128", setting, "transformers static batch", serial)
            hf_static.notes = "batch of 1 = one-at-a-time"
        else:
            hf_static = _hf_row("chat128", setting, f"transformers static batch {users}", baseline)
        kv.vs_baseline = (
            f"{_fmt(_ratio(kv.out_tok_s, baseline.output_tokens_per_s), '.2f')}x tok/s vs static, "
            f"{_fmt(_ratio(kv.out_tok_s, serial.output_tokens_per_s), '.2f')}x vs 1-at-a-time"
        )
        hf_static.vs_baseline = "baseline"
        target = TARGET_TOK_S.get(users)
        if target is not None and out_tokens == FULL.chat_output_tokens:
            met = kv.out_tok_s is not None and kv.out_tok_s >= target
            text = f"target >= {target:g} tok/s: {'met' if met else 'MISSED'}"
            if users == 32:
                itl_ok = kv.itl_p99_ms is not None and kv.itl_p99_ms < TARGET_ITL_P99_MS_32
                text += f"; ITL p99 < {TARGET_ITL_P99_MS_32:g} ms: {'met' if itl_ok else 'MISSED'}"
            kv.notes = text
        rows += [kv, hf_static, hf_serial]
    return rows, peers


def _hf_row(section: str, setting: str, system: str, run: Any) -> Row:
    s = run.summary()
    return Row(
        section=section,
        setting=setting,
        system=system,
        requests=run.num_requests,
        out_tok_s=run.output_tokens_per_s,
        itl_p99_ms=_ms(s["itl_p99_s"]),
        ttft_p50_ms=_ms(s["ttft_p50_s"]),
        ttft_p99_ms=_ms(s["ttft_p99_s"]),
        notes="TTFT excludes queueing behind earlier batches",
        raw=s,
    )


# The slo section's targets (issue 12's example): ITL 150 ms, TTFT 2 s.
SLO_ITL_MS = 150.0
SLO_TTFT_MS = 2000.0


def section_slo(sizes: Sizes, threads: int, progress: bool) -> list[Row]:
    """stall-free at the default budget (2,048 tokens a step, chunks of 512) against the slo
    policy at the same targets, on bursty mixed traffic: lognormal prompts and outputs, and
    one request in eight with a distinct 1,024-token document in front (a closed loop of
    ``slo_users`` users: arrivals come in waves as answers finish)."""
    from benchmarks import bench_serving
    from loadtest.stats import SLO
    from loadtest.workload import Workload

    workload = Workload.from_dict(
        {
            "name": "slo_mix_cpu",
            "seed": 2,
            "num_requests": sizes.slo_requests,
            "prompt": {
                "source": "random",
                "len": {"type": "lognormal", "median": 96, "sigma": 0.8, "min": 16, "max": 768},
            },
            "shared_prefix": {
                "num_prefixes": sizes.slo_requests,
                "len": 1024,
                "fraction": 0.125,
            },
            "output": {
                "len": {"type": "lognormal", "median": 64, "sigma": 0.6, "min": 8, "max": 192},
                "ignore_eos": True,
            },
            "sampling": {"temperature": 0.0},
        }
    )
    slo = SLO(ttft_s=SLO_TTFT_MS / 1e3, tpot_s=SLO_ITL_MS / 1e3)
    setting = (
        f"{sizes.slo_users} users; lognormal prompts, 1 in 8 +1024 tokens; "
        f"targets ITL {SLO_ITL_MS:g} ms, TTFT {SLO_TTFT_MS / 1e3:g} s"
    )
    rows = []
    for policy in ("stall-free", "slo"):
        _say(f"[slo] kvserve {policy}: {sizes.slo_requests} requests")
        args = ["--threads", str(threads), "--policy", policy]
        args += ["--itl-slo-ms", str(SLO_ITL_MS), "--ttft-slo-ms", str(SLO_TTFT_MS)]
        report = bench_serving.measure(
            args,
            workload,
            users=sizes.slo_users,
            num_requests=sizes.slo_requests,
            duration_s=sizes.run_duration_s,
            desc=f"kvserve {policy}",
            progress=progress,
            slo=slo,
        )
        row = _row_from_report("slo", setting, f"kvserve {policy}", report)
        row.notes = f"goodput {report['goodput']['fraction_within_slo']:.0%}"
        rows.append(row)
    base, ours = rows
    base.vs_baseline = "baseline"
    goodput = [r.raw["goodput"]["fraction_within_slo"] for r in rows]
    ours.vs_baseline = (
        f"{_fmt(_ratio(ours.itl_p99_ms, base.itl_p99_ms), '.2f')}x ITL p99, "
        f"{_fmt(_ratio(goodput[1], goodput[0]), '.2f')}x goodput"
    )
    return rows


def section_policy(sizes: Sizes, threads: int, progress: bool) -> list[Row]:
    from benchmarks import bench_serving

    workload = bench_serving.long_short_workload(
        sizes.policy_requests,
        sizes.policy_long_len,
        sizes.policy_long_fraction,
        sizes.policy_output_tokens,
    )
    budget = str(sizes.policy_step_tokens)
    setting = (
        f"{sizes.policy_users} users; {round(sizes.policy_long_fraction * 100)}% +"
        f"{sizes.policy_long_len}-token prompts, rest 32-64; {sizes.policy_output_tokens} out; "
        f"{budget} tokens/step"
    )
    rows = []
    for policy in ("prefill-first", "stall-free"):
        _say(f"[policy] kvserve {policy}: {sizes.policy_requests} requests")
        report = bench_serving.measure(
            [
                "--threads",
                str(threads),
                "--policy",
                policy,
                "--max-num-batched-tokens",
                budget,
                "--long-prefill-token-threshold",
                budget,
            ],
            workload,
            users=sizes.policy_users,
            num_requests=sizes.policy_requests,
            duration_s=sizes.run_duration_s,
            desc=f"kvserve {policy}",
            progress=progress,
        )
        rows.append(_row_from_report("policy", setting, f"kvserve {policy}", report))
    base, sf = rows
    base.vs_baseline = "baseline"
    sf.vs_baseline = (
        f"{_fmt(_ratio(base.itl_p99_ms, sf.itl_p99_ms), '.2f')}x lower ITL p99, "
        f"{_fmt(_ratio(sf.out_tok_s, base.out_tok_s), '.2f')}x tok/s"
    )
    return rows


def section_prefix(sizes: Sizes, threads: int, progress: bool) -> list[Row]:
    from benchmarks import bench_serving

    workload = bench_serving.shared_prefix_workload(
        sizes.prefix_requests,
        sizes.prefix_num_prefixes,
        sizes.prefix_len,
        sizes.prefix_output_tokens,
    )
    setting = (
        f"{sizes.prefix_users} users; {sizes.prefix_num_prefixes} system prompts x "
        f"{sizes.prefix_len} tokens + 32-64; {sizes.prefix_output_tokens} out"
    )
    rows = []
    for enabled in (False, True):
        flag = "--enable-prefix-caching" if enabled else "--no-enable-prefix-caching"
        name = f"kvserve prefix caching {'on' if enabled else 'off'}"
        _say(f"[prefix] {name}: {sizes.prefix_requests} requests")
        report = bench_serving.measure(
            ["--threads", str(threads), flag],
            workload,
            users=sizes.prefix_users,
            num_requests=sizes.prefix_requests,
            duration_s=sizes.run_duration_s,
            desc=name,
            progress=progress,
        )
        row = _row_from_report("prefix", setting, name, report)
        srv = report.get("server") or {}
        hit = srv.get("prefix_hit_rate")
        row.notes = f"server prefix hit rate {'-' if hit is None else f'{hit:.0%}'}"
        rows.append(row)
    off, on = rows
    off.vs_baseline = "baseline"
    on.vs_baseline = (
        f"{_fmt(_ratio(off.ttft_p50_ms, on.ttft_p50_ms), '.2f')}x lower TTFT p50, "
        f"{_fmt(_ratio(off.ttft_p99_ms, on.ttft_p99_ms), '.2f')}x p99"
    )
    return rows


def section_spec(sizes: Sizes, chat_path: Path, threads: int, progress: bool) -> list[Row]:
    from benchmarks import bench_serving
    from loadtest.workload import LengthDist, Workload

    n, out = sizes.spec_requests, sizes.spec_output_tokens
    edit = Workload.load(EDIT128)
    edit = replace(edit, num_requests=n, output_len=LengthDist(value=out))
    chat = bench_serving.chat128_workload(chat_path, n, out)
    # (name, workload, serve flags of both sides): the defaults (Q4 weights, fused decode),
    # then fp32 weights, where a decode step is bound by streaming the weights.
    runs = [("edit128", edit, []), ("chat128", chat, []), ("edit128", edit, F32)]
    configs = {"off": ["--speculative", "off"], "on": ["--speculative", "ngram"]}
    rows = []
    for name, workload, extra in runs:
        reports: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for r in range(sizes.spec_rounds):
            for config, flags in configs.items():
                _say(f"[spec] {name} speculation {config}, round {r + 1}: {n} requests")
                reports[config].append(
                    bench_serving.measure(
                        ["--threads", str(threads), *extra, *flags],
                        workload,
                        users=1,
                        num_requests=n,
                        duration_s=sizes.run_duration_s,
                        desc=f"kvserve {name} spec {config}",
                        progress=progress,
                    )
                )
        setting = f"1 user, {name}, {out} out, {sizes.spec_rounds} x {n} req alternating"
        if extra:
            setting += ", " + " ".join(extra)
        pair = [_spec_row(name, setting, config, reports[config]) for config in configs]
        off, on = pair
        off.vs_baseline = "baseline"
        ratio = _ratio(on.out_tok_s, off.out_tok_s)
        target = TARGET_SPEC_EDIT if name == "edit128" else TARGET_SPEC_CHAT
        on.vs_baseline = f"{_fmt(ratio, '.2f')}x tok/s"
        if out == FULL.spec_output_tokens and not extra:  # the targets are for the defaults
            met = ratio is not None and ratio >= target
            on.vs_baseline += f" (target >= {target:g}x: {'met' if met else 'MISSED'})"
        rows += pair
    return rows


def _spec_row(name: str, setting: str, config: str, reports: list[dict[str, Any]]) -> Row:
    """One configuration's rounds summed: tokens / time; latencies: mean TTFT p50, max ITL
    p99 over the rounds; the acceptance rate from the server's counters."""
    tokens = sum(r["output_tokens_total"] for r in reports)
    duration = sum(r["duration_s"] for r in reports)
    deltas: dict[str, float] = {}
    for r in reports:
        for key, value in ((r.get("server") or {}).get("counter_deltas") or {}).items():
            deltas[key] = deltas.get(key, 0.0) + value
    drafts = deltas.get("kvserve_spec_draft_tokens_total", 0.0)
    accepted = deltas.get("kvserve_spec_accepted_tokens_total", 0.0)
    ttft = [r["latency_s"]["ttft"]["p50"] for r in reports]
    itl = [r["latency_s"]["itl"]["p99"] for r in reports]
    notes = "no drafts"
    if drafts:
        notes = f"{drafts:.0f} drafts, {accepted / drafts:.0%} accepted"
    return Row(
        section="spec",
        setting=setting,
        system=f"kvserve speculation {config}",
        requests=sum(r["requests"]["ok"] for r in reports),
        out_tok_s=tokens / duration if duration else None,
        itl_p99_ms=_ms(max(itl)) if None not in itl else None,
        ttft_p50_ms=_ms(sum(ttft) / len(ttft)) if None not in ttft else None,
        notes=notes,
        raw={"rounds": reports},
    )


def section_paged(sizes: Sizes, kv_bytes_per_token: int | None) -> list[Row]:
    from benchmarks import bench_paged_kv

    results = bench_paged_kv.run(
        num_requests=sizes.paged_requests,
        budget_tokens=sizes.paged_budget_tokens,
        max_model_len=sizes.paged_max_model_len,
    )
    memory = (
        f", {sizes.paged_budget_tokens * kv_bytes_per_token / 2**20:.0f} MiB fp32"
        if kv_bytes_per_token
        else ""
    )
    names = {
        "contiguous": f"contiguous ({sizes.paged_max_model_len}-token prealloc)",
        "paged-reserve": "paged 16, reserve full length",
        "paged-optimistic": "paged 16, on demand (kvserve)",
    }
    shapes = {"chat128": "128 in/128 out", "mixed": "lognormal in/out"}
    rows = []
    baseline: dict[str, int] = {}
    for r in results:
        row = Row(
            section="paged",
            setting=f"{r.num_requests} req {shapes[r.workload]}; {r.budget_tokens} slots{memory}",
            system=names[r.layout],
            requests=r.num_requests,
            peak_concurrent=r.peak_concurrent,
            cache_efficiency=r.mean_cache_efficiency,
            notes=f"mean {r.mean_concurrent:.1f} running; {r.num_steps} steps; "
            f"{r.preemptions} preemptions",
            raw=r.as_dict(),
        )
        if r.layout == "contiguous":
            baseline[r.workload] = r.peak_concurrent
            row.vs_baseline = "baseline"
        else:
            row.vs_baseline = (
                f"{_fmt(_ratio(r.peak_concurrent, baseline[r.workload]), '.1f')}x concurrency"
            )
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ output

COLUMNS = (
    ("Section", "section"),
    ("Setting", "setting"),
    ("System", "system"),
    ("Req", "requests"),
    ("Out tok/s", "out_tok_s"),
    ("ITL p99 ms", "itl_p99_ms"),
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p99 ms", "ttft_p99_ms"),
    ("Peak running", "peak_concurrent"),
    ("Cache eff.", "cache_efficiency"),
    ("vs baseline", "vs_baseline"),
    ("llama.cpp tok/s", "llama_cpp_tok_s"),
    ("llama.cpp ITL p99 ms", "llama_cpp_itl_p99_ms"),
    ("kvserve / llama.cpp", "vs_llama_cpp"),
    ("Notes", "notes"),
)


def _fmt(value: Any, spec: str = "") -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return format(value, spec or ".1f")
    return str(value)


def format_table(rows: list[Row]) -> str:
    """A Markdown table (pastes into the README as is)."""
    cells = [[h for h, _ in COLUMNS]]
    for r in rows:
        line = []
        for _, attr in COLUMNS:
            value = getattr(r, attr)
            line.append(_fmt(value, ".2f" if attr == "cache_efficiency" else ".1f"))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    out = []
    for k, line in enumerate(cells):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
        if k == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def machine_info(threads: int) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
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


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
        default=DEFAULT_CHAT128,
        help="the chat128 prompt file (default: ../shared/workloads/chat128.json)",
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
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if {"chat128", "spec"} & set(sections) and not args.workload_file.is_file():
        p.error(f"chat128 prompt file not found: {args.workload_file}")
    sizes = QUICK if args.quick else FULL
    if args.chat_levels:
        try:
            sizes = replace(sizes, chat_levels=parse_levels(args.chat_levels))
        except ValueError as e:
            p.error(str(e))
    progress = not args.no_progress
    t0 = time.perf_counter()
    llama_cpp = LlamaCpp(None, "the chat128 section did not run")
    if "chat128" in sections:
        from benchmarks.bench_llama_cpp import default_cache_dir

        cache_dir = args.llama_cpp_cache_dir or default_cache_dir(os.environ)
        llama_cpp = find_llama_cpp(args.llama_cpp, cache_dir)  # builds before anything is timed
        if llama_cpp.binary is None:
            _say(f"[chat128] llama.cpp not measured: {llama_cpp.reason}")
    rows: list[Row] = []
    peers: dict[str, Any] = {}
    if "paged" in sections:
        rows += section_paged(sizes, _smollm2_kv_bytes_per_token())
    if "chat128" in sections:
        chat_rows, peers = section_chat128(
            sizes, args.workload_file, args.threads, progress, llama_cpp
        )
        rows += chat_rows
    if "policy" in sections:
        rows += section_policy(sizes, args.threads, progress)
    if "slo" in sections:
        rows += section_slo(sizes, args.threads, progress)
    if "prefix" in sections:
        rows += section_prefix(sizes, args.threads, progress)
    if "spec" in sections:
        rows += section_spec(sizes, args.workload_file, args.threads, progress)
    order = {s: i for i, s in enumerate(SECTIONS)}
    rows.sort(key=lambda r: order[r.section])  # stable: keeps the order within a section
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    extra: dict[str, Any] = {}
    extra_tables: list[str] = []
    if "kvcache" in sections:
        from benchmarks import bench_kv_cache

        _say(f"[kvcache] lengths {sizes.kvcache_lengths}, {args.kv_threads} thread(s)")
        points = bench_kv_cache.run(sizes.kvcache_lengths, sizes.kvcache_tokens, args.kv_threads)
        png = args.out_dir / f"kv-cache-{'quick-' if args.quick else ''}{stamp}.png"
        bench_kv_cache.plot(
            points,
            png,
            f"SmolLM2-135M Q4_1 GGUF on kvserve's kernels, fp16 KV, "
            f"{args.kv_threads} thread(s); median of {sizes.kvcache_tokens} tokens",
        )
        extra["kvcache"] = {"points": bench_kv_cache.as_dicts(points), "png": str(png)}
        extra_tables.append(
            "KV cache against recompute (kvcache), per generated token, median of "
            f"{sizes.kvcache_tokens} tokens:\n\n{bench_kv_cache.format_table(points)}\n\n"
            f"PNG: {png}"
        )
    if "sinks" in sections:
        from benchmarks import bench_sinks

        _say(f"[sinks] {sizes.sinks_tokens} tokens, cache {sizes.sinks_cache}")
        results = bench_sinks.run(
            bench_sinks.DEFAULT_TEXT, sizes.sinks_tokens, sizes.sinks_cache, 4, 64, args.kv_threads
        )
        extra["sinks"] = bench_sinks.as_dicts(results)
        extra_tables.append(
            f"Attention sinks (sinks), perplexity of {sizes.sinks_tokens} tokens of "
            f"{bench_sinks.DEFAULT_TEXT.name}:\n\n"
            f"{bench_sinks.format_table(results, sizes.sinks_cache)}"
        )
    elapsed = time.perf_counter() - t0

    machine = machine_info(args.threads)
    quick_note = " (--quick smoke run: tiny counts, not figures)" if args.quick else ""
    title = (
        f"kvserve benchmarks{quick_note}"
        " - SmolLM2-135M-Instruct Q4_1 GGUF (kvserve: its own Q4_1/Q8_0 weights, fp16 KV;"
        f" transformers: dequantized to fp32), {machine['cpu']}, "
        f"{machine['logical_cpus']} logical CPUs, {args.threads} torch threads"
    )
    print(title)
    print()
    print(format_table(rows))
    print()
    print(llama_cpp_note(llama_cpp, args.threads))
    print(
        "Req = requests measured per configuration (the chat128 levels run fewer than 64 "
        "requests to fit the time budget). Out tok/s = output tokens / wall time of the run; "
        "ITL = inter-token latency; percentiles by linear interpolation (numpy's default)."
    )
    for table in extra_tables:
        print()
        print(table)
    print(f"Whole suite: {elapsed / 60:.1f} min.")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"bench-{'quick-' if args.quick else ''}{stamp}.json"
    doc = {
        "schema": "kvserve.bench/v1",
        "quick": args.quick,
        "machine": machine,
        "sizes": asdict(sizes),
        "elapsed_s": elapsed,
        "llama_cpp": {
            "binary": None if llama_cpp.binary is None else str(llama_cpp.binary),
            "version": llama_cpp.version or None,
            "reason_not_measured": llama_cpp.reason or None,
            "reports_by_users": peers,  # a loadtest report, or the reason for that level
        },
        "rows": [asdict(r) for r in rows],
        **extra,
    }
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"JSON: {path}")
    return 0


def llama_cpp_note(llama_cpp: LlamaCpp, threads: int) -> str:
    """The line under the table saying what the llama.cpp columns are."""
    from benchmarks.bench_llama_cpp import CTX_PER_SLOT, LLAMA_CPP_PYTHON_VERSION, SLOTS

    if llama_cpp.binary is None:
        return f"llama.cpp: not measured in this run ({llama_cpp.reason})."
    return (
        f"llama.cpp = llama-server {llama_cpp.version or '(version unknown)'}, built from the "
        f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist ({llama_cpp.binary}); same GGUF, "
        f"{threads} threads, -fa on, continuous batching, {SLOTS} slots x {CTX_PER_SLOT} tokens; "
        "the same requests through the same load generator (kvserve loadtest --api openai), "
        "measured right after kvserve at each level of this run."
    )


def _smollm2_kv_bytes_per_token() -> int | None:
    """fp32 KV bytes per token of the embedded model, from its GGUF metadata (no weights)."""
    try:
        from model_runner.gguf_loader import default_model_path, read_metadata

        md = read_metadata(str(default_model_path()))
        arch = md["general.architecture"]
        heads = int(md[f"{arch}.attention.head_count"])
        head_dim = int(
            md.get(f"{arch}.attention.key_length") or md[f"{arch}.embedding_length"] // heads
        )
        kv_heads = int(md.get(f"{arch}.attention.head_count_kv") or heads)
        layers = int(md[f"{arch}.block_count"])
    except Exception:  # only a label in the table depends on it
        return None
    return 2 * layers * kv_heads * head_dim * 4


if __name__ == "__main__":
    sys.exit(main())
