"""The benchmark suite's sections: each a function of a ``Context`` returning its rows (and
any JSON and table of its own). A comparison of kvserve configurations on one workload is a
short ``Comparison`` entry; ``run_all.SECTIONS`` lists the sections in table order.

To add a section: write ``def name(ctx: Context) -> SectionResult`` here (or a
``Comparison`` and ``run_comparison``) and add it to ``run_all.SECTIONS``.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.bench_llama_cpp import LlamaCpp
from benchmarks.sizes import Sizes
from benchmarks.table import Row, fmt, ms, pooled_row, ratio, row_from_report, times, verdict
from loadtest.stats import SLO
from loadtest.workload import Workload

REPO_ROOT = Path(__file__).resolve().parents[1]
EDIT128 = REPO_ROOT / "loadtest" / "workloads" / "edit128.json"
F32 = ["--weights", "float32"]
# Issue 7's targets for kvserve through gRPC with fp32 weights.
TARGET_TOK_S = {1: 20.0, 8: 100.0, 32: 250.0}
TARGET_ITL_P99_MS_32 = 200.0
# Issue 10's targets, kvserve against llama.cpp measured in the same run: output tok/s ratio by
# users, and kvserve's ITL p99 at most this fraction of llama.cpp's at 32 users.
TARGET_VS_LLAMA_CPP = {1: 1.3, 8: 2.0, 32: 3.0}
TARGET_ITL_P99_VS_LLAMA_CPP_32 = 0.5
# Issue 13's targets, 1 user, off vs on in the same run: edit128 >= 1.5x output tok/s, and
# chat128 loses at most 5 %.
TARGET_SPEC_EDIT = 1.5
TARGET_SPEC_CHAT = 0.95
# The slo section's targets (issue 12's example): ITL 150 ms, TTFT 2 s.
SLO_ITL_MS = 150.0
SLO_TTFT_MS = 2000.0
# Issue 25's loose-target case (TTFT 3 s) and its targets, slo against stall-free in the same
# run: the mixed traffic goodput >= 1.1x, ITL p99 <= 0.5x, tok/s >= 0.95x; the loose case
# tok/s >= 0.97x and ITL p99 no worse.
SLO_LOOSE_TTFT_MS = 3000.0
TARGET_SLO_MIX = {"goodput": 1.1, "itl_p99": 0.5, "tok_s": 0.95}
TARGET_SLO_LOOSE = {"tok_s": 0.97, "itl_p99": 1.0}


@dataclass(slots=True)
class Context:
    """What every section may read: the sizes and the run's settings."""

    sizes: Sizes
    threads: int  # torch threads, both sides of a comparison
    kv_threads: int  # torch threads of kvcache and sinks
    progress: bool
    workload_file: Path  # chat128's prompts
    out_dir: Path
    stamp: str  # names this run's files
    quick: bool
    llama_cpp: LlamaCpp = field(default_factory=lambda: LlamaCpp(None, "not looked for"))
    llama_cpp_mode: str = "build"  # --llama-cpp: build, cached or off

    @property
    def full(self) -> bool:
        """The full sizes: only then are the issues' targets judged."""
        return not self.quick


@dataclass(slots=True)
class SectionResult:
    """A section's rows of the main table; ``extra``: its JSON beyond the rows; ``table``:
    a table of its own, printed under the main one."""

    rows: list[Row] = field(default_factory=list)
    extra: Any = None
    table: str = ""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ------------------------------------------------------------------ comparisons as data


@dataclass(frozen=True, slots=True)
class Comparison:
    """kvserve configurations side by side on one workload; the first system is the
    baseline. ``verdict(baseline, row)`` words each other row against it; ``notes(report)``
    fills a row's notes."""

    section: str
    setting: str
    workload: Workload
    systems: Sequence[tuple[str, list[str]]]  # (system name, serve flags)
    users: int
    num_requests: int
    verdict: Callable[[Row, Row], str]
    notes: Callable[[dict[str, Any]], str] | None = None
    slo: SLO | None = None


def run_comparison(ctx: Context, c: Comparison) -> SectionResult:
    from benchmarks import bench_serving

    rows = []
    for system, flags in c.systems:
        say(f"[{c.section}] {system}: {c.num_requests} requests")
        report = bench_serving.measure(
            ["--threads", str(ctx.threads), *flags],
            c.workload,
            users=c.users,
            num_requests=c.num_requests,
            duration_s=ctx.sizes.run_duration_s,
            desc=system,
            progress=ctx.progress,
            slo=c.slo,
        )
        row = row_from_report(c.section, c.setting, system, report)
        if c.notes is not None:
            row.notes = c.notes(report)
        rows.append(row)
    base = rows[0]
    base.vs_baseline = "baseline"
    for row in rows[1:]:
        row.vs_baseline = c.verdict(base, row)
    return SectionResult(rows)


def policy(ctx: Context) -> SectionResult:
    """prefill-first against stall-free on long and short prompts, same token budget."""
    from benchmarks import bench_serving

    s = ctx.sizes
    budget = str(s.policy_step_tokens)
    flags = ["--max-num-batched-tokens", budget, "--long-prefill-token-threshold", budget]
    return run_comparison(ctx, Comparison(
        "policy",
        f"{s.policy_users} users; {round(s.policy_long_fraction * 100)}% +{s.policy_long_len}"
        f"-token prompts, rest 32-64; {s.policy_output_tokens} out; {budget} tokens/step",
        bench_serving.long_short_workload(s.policy_requests, s.policy_long_len,
                                          s.policy_long_fraction, s.policy_output_tokens),
        [(f"kvserve {p}", ["--policy", p, *flags]) for p in ("prefill-first", "stall-free")],
        s.policy_users, s.policy_requests,
        lambda base, sf: f"{times(ratio(base.itl_p99_ms, sf.itl_p99_ms), 'lower ITL p99')}, "
                         f"{times(ratio(sf.out_tok_s, base.out_tok_s), 'tok/s')}",
    ))  # fmt: skip


def prefix(ctx: Context) -> SectionResult:
    """Prefix caching off against on, on shared system prompts: TTFT."""
    from benchmarks import bench_serving

    s = ctx.sizes

    def hit_rate(report: dict[str, Any]) -> str:
        hit = (report.get("server") or {}).get("prefix_hit_rate")
        return f"server prefix hit rate {'-' if hit is None else f'{hit:.0%}'}"

    return run_comparison(ctx, Comparison(
        "prefix",
        f"{s.prefix_users} users; {s.prefix_num_prefixes} system prompts x {s.prefix_len} "
        f"tokens + 32-64; {s.prefix_output_tokens} out",
        bench_serving.shared_prefix_workload(s.prefix_requests, s.prefix_num_prefixes,
                                             s.prefix_len, s.prefix_output_tokens),
        [("kvserve prefix caching off", ["--no-enable-prefix-caching"]),
         ("kvserve prefix caching on", ["--enable-prefix-caching"])],
        s.prefix_users, s.prefix_requests,
        lambda off, on: f"{times(ratio(off.ttft_p50_ms, on.ttft_p50_ms), 'lower TTFT p50')}, "
                        f"{times(ratio(off.ttft_p99_ms, on.ttft_p99_ms), 'p99')}",
        hit_rate,
    ))  # fmt: skip


def slo(ctx: Context) -> SectionResult:
    """stall-free at the default budget (2,048 tokens a step, chunks of 512) against the slo
    policy at the same targets, on two workloads:

    - mixed traffic: lognormal prompts and outputs, one request in eight with a distinct
      1,024-token document in front (a closed loop of ``slo_users`` users: arrivals come in
      waves as answers finish); targets ITL 150 ms, TTFT 2 s;
    - the loose-target case: chat128 (128 tokens in, 128 out) in two waves of
      ``slo_users``; targets ITL 150 ms, TTFT 3 s, which stall-free meets by a wide margin,
      so the slo policy has nothing to win and must not throttle.

    The two policies alternate in rounds (stall-free, slo, slo, stall-free, ...), each on a
    fresh server, so a drift in the machine's load hits both; the rows pool the rounds."""
    from benchmarks import bench_serving

    s = ctx.sizes
    mixed = Workload.from_dict({
        "name": "slo_mix_cpu", "seed": 2, "num_requests": s.slo_requests,
        "prompt": {"source": "random", "len": {"type": "lognormal", "median": 96, "sigma": 0.8,
                                               "min": 16, "max": 768}},
        "shared_prefix": {"num_prefixes": s.slo_requests, "len": 1024, "fraction": 0.125},
        "output": {"len": {"type": "lognormal", "median": 64, "sigma": 0.6, "min": 8,
                           "max": 192}, "ignore_eos": True},
        "sampling": {"temperature": 0.0},
    })  # fmt: skip
    loose = bench_serving.chat128_workload(
        ctx.workload_file, s.slo_loose_requests, s.chat_output_tokens
    )
    cases = [
        ("mixed", mixed, s.slo_requests, SLO_TTFT_MS, TARGET_SLO_MIX,
         "lognormal prompts, 1 in 8 +1024 tokens"),
        ("loose", loose, s.slo_loose_requests, SLO_LOOSE_TTFT_MS, TARGET_SLO_LOOSE,
         f"chat128 in two waves, {s.chat_output_tokens} out"),
    ]  # fmt: skip
    policies = ("stall-free", "slo")
    rows = []
    for name, workload, n, ttft_ms, targets, what in cases:
        flags = ["--itl-slo-ms", f"{SLO_ITL_MS:g}", "--ttft-slo-ms", f"{ttft_ms:g}"]
        reports: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for r in range(s.slo_rounds):
            for policy in policies if r % 2 == 0 else policies[::-1]:
                say(f"[slo] {name}, {policy}, round {r + 1}: {n} requests")
                reports[policy].append(
                    bench_serving.measure(
                        ["--threads", str(ctx.threads), "--policy", policy, *flags],
                        workload,
                        users=s.slo_users,
                        num_requests=n,
                        duration_s=s.run_duration_s,
                        desc=f"kvserve {policy} ({name})",
                        progress=ctx.progress,
                        slo=SLO(ttft_s=ttft_ms / 1e3, tpot_s=SLO_ITL_MS / 1e3),
                    )
                )
        setting = (
            f"{s.slo_users} users; {what}; targets ITL {SLO_ITL_MS:g} ms, TTFT "
            f"{ttft_ms / 1e3:g} s; {s.slo_rounds} x {n} req alternating"
        )
        base, ours = (pooled_row("slo", setting, f"kvserve {p}", reports[p]) for p in policies)
        for row in (base, ours):
            goodput = row.raw["goodput"]
            itl_max = [r["latency_s"]["itl"]["max"] for r in row.raw["rounds"]]
            row.notes = f"goodput {goodput['fraction_within_slo']:.0%} of {goodput['sent']}"
            if None not in itl_max:  # p99 hides a few long gaps: stall-free's big steps
                row.notes += f", ITL max {max(itl_max) * 1e3:,.0f} ms"
        good = ratio(*(r.raw["goodput"]["fraction_within_slo"] for r in (ours, base)))
        found = {
            "goodput": good,
            "itl_p99": ratio(ours.itl_p99_ms, base.itl_p99_ms),
            "tok_s": ratio(ours.out_tok_s, base.out_tok_s),
        }
        words = {"goodput": "goodput", "itl_p99": "ITL p99", "tok_s": "tok/s"}
        base.vs_baseline = "baseline"
        ours.vs_baseline = ", ".join(
            times(found[key], words[key])
            + (f" ({verdict(found[key], '<=' if key == 'itl_p99' else '>=', targets[key])})"
               if ctx.full and key in targets else "")
            for key in words
        )  # fmt: skip
        rows += [base, ours]
    return SectionResult(rows)


# ------------------------------------------------------------------ chat128 and llama.cpp


def chat128(ctx: Context) -> SectionResult:
    """kvserve against transformers (one at a time, static batches) and llama.cpp on the
    reference workload; ``extra``: llama.cpp's reports by users (or the reason for each)."""
    sizes, chat_path, threads, progress = ctx.sizes, ctx.workload_file, ctx.threads, ctx.progress
    llama_cpp = ctx.llama_cpp
    import torch

    from benchmarks import bench_llama_cpp, bench_serving, bench_transformers
    from benchmarks.tools.reference import build_hf_model
    from model_runner.gguf_loader import default_model_path
    from model_runner.loader import load_model

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

    say(f"[chat128] transformers one at a time: {sizes.hf_serial_requests} requests")
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
        say(f"[chat128] transformers static batches of {users}: {num_requests} requests")
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
        say(f"[chat128] kvserve via gRPC, {users} users: {num_requests} requests")
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
            say(f"[chat128] llama.cpp server via HTTP, {users} users: {num_requests} requests")
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
                say(f"[chat128] llama.cpp at {users} users failed: {e}")
        peers[str(users)] = peer
        setting = f"{users} user{'s' if users > 1 else ''}, {out_tokens} out"
        kv = row_from_report("chat128", setting, "kvserve (gRPC, --weights auto)", report)
        _llama_cpp_columns(kv, peer, users, full=ctx.full)
        hf_serial = _hf_row("chat128", setting, "transformers one-at-a-time", serial)
        hf_serial.notes = f"measured once ({serial.num_requests} req); independent of users"
        baseline = serial if users == 1 else static[users]
        if users == 1:
            hf_static = _hf_row("chat128", setting, "transformers static batch", serial)
            hf_static.notes = "batch of 1 = one-at-a-time"
        else:
            hf_static = _hf_row("chat128", setting, f"transformers static batch {users}", baseline)
        kv.vs_baseline = (
            f"{times(ratio(kv.out_tok_s, baseline.output_tokens_per_s), 'tok/s vs static')}, "
            f"{times(ratio(kv.out_tok_s, serial.output_tokens_per_s), 'vs 1-at-a-time')}"
        )
        hf_static.vs_baseline = "baseline"
        target = TARGET_TOK_S.get(users)
        if target is not None and ctx.full:
            kv.notes = verdict(kv.out_tok_s, ">=", target, " tok/s")
            if users == 32:
                itl = verdict(kv.itl_p99_ms, "<", TARGET_ITL_P99_MS_32, " ms", "ITL p99")
                kv.notes += f"; {itl}"
        rows += [kv, hf_static, hf_serial]
    return SectionResult(rows, peers)


def _hf_row(section: str, setting: str, system: str, run: Any) -> Row:
    s = run.summary()
    return Row(
        section=section,
        setting=setting,
        system=system,
        requests=run.num_requests,
        out_tok_s=run.output_tokens_per_s,
        itl_p99_ms=ms(s["itl_p99_s"]),
        ttft_p50_ms=ms(s["ttft_p50_s"]),
        ttft_p99_ms=ms(s["ttft_p99_s"]),
        notes="TTFT excludes queueing behind earlier batches",
        raw=s,
    )


def _llama_cpp_columns(kv: Row, peer: dict[str, Any] | str, users: int, full: bool) -> None:
    """Fill kv's llama.cpp cells from peer's report (or the reason it has none)."""
    if isinstance(peer, str):
        kv.llama_cpp_tok_s = f"not measured: {peer}"
        return
    tok_s = peer["output_token_throughput_tps"]
    itl = ms(peer["latency_s"]["itl"]["p99"])
    kv.llama_cpp_tok_s, kv.llama_cpp_itl_p99_ms = tok_s, itl
    tok_ratio = ratio(kv.out_tok_s, tok_s)
    itl_ratio = ratio(kv.itl_p99_ms, itl)
    text = times(tok_ratio, "tok/s")
    target = TARGET_VS_LLAMA_CPP.get(users)
    if full and target is not None:
        text += f" ({verdict(tok_ratio, '>=', target)})"
    text += f"; ITL p99 {fmt(itl_ratio, '.2f')}x"
    if full and users == 32:
        text += f" ({verdict(itl_ratio, '<=', TARGET_ITL_P99_VS_LLAMA_CPP_32)})"
    failed = peer["requests"]["failed"] + peer["requests"]["interrupted"]
    if failed:
        text += f"; {failed} llama.cpp requests failed or interrupted"
    kv.vs_llama_cpp = text


# ------------------------------------------------------------------ speculative decoding


def spec(ctx: Context) -> SectionResult:
    """n-gram speculation off against on, 1 user, alternating in rounds on fresh servers."""
    from benchmarks import bench_serving
    from loadtest.workload import LengthDist

    sizes = ctx.sizes
    n, out = sizes.spec_requests, sizes.spec_output_tokens
    edit = Workload.load(EDIT128)
    edit = replace(edit, num_requests=n, output_len=LengthDist(value=out))
    chat = bench_serving.chat128_workload(ctx.workload_file, n, out)
    # (name, workload, serve flags of every side, drafts per step compared): the defaults (Q4
    # weights, fused step) at k = 3 and 4, then fp32 weights, where a decode step is bound by
    # streaming the weights.
    runs = [
        ("edit128", edit, [], (3, 4)),
        ("chat128", chat, [], (3, 4)),
        ("edit128", edit, F32, (3,)),
    ]
    rows = []
    for name, workload, extra, ks in runs:
        configs = {"off": ["--speculative", "off"]}
        for k in ks:
            configs[f"on k={k}"] = ["--speculative", "ngram", "--num-speculative-tokens", str(k)]
        reports: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
        for r in range(sizes.spec_rounds):
            for config, flags in configs.items():
                say(f"[spec] {name} speculation {config}, round {r + 1}: {n} requests")
                reports[config].append(
                    bench_serving.measure(
                        ["--threads", str(ctx.threads), *extra, *flags],
                        workload,
                        users=1,
                        num_requests=n,
                        duration_s=sizes.run_duration_s,
                        desc=f"kvserve {name} spec {config}",
                        progress=ctx.progress,
                    )
                )
        setting = f"1 user, {name}, {out} out, {sizes.spec_rounds} x {n} req alternating"
        if extra:
            setting += ", " + " ".join(extra)
        off, *ons = (_spec_row(setting, config, reports[config]) for config in configs)
        off.vs_baseline = "baseline"
        for on in ons:
            tok_ratio = ratio(on.out_tok_s, off.out_tok_s)
            on.vs_baseline = times(tok_ratio, "tok/s")
            if ctx.full and not extra:  # the targets are for the defaults
                target = TARGET_SPEC_EDIT if name == "edit128" else TARGET_SPEC_CHAT
                on.vs_baseline += f" ({verdict(tok_ratio, '>=', target)})"
        rows += [off, *ons]
    return SectionResult(rows)


def _spec_row(setting: str, config: str, reports: list[dict[str, Any]]) -> Row:
    """One configuration's rounds pooled (``pooled_row``); the notes give the acceptance
    rate from the server's counters."""
    deltas: dict[str, float] = {}
    for r in reports:
        for key, value in ((r.get("server") or {}).get("counter_deltas") or {}).items():
            deltas[key] = deltas.get(key, 0.0) + value
    drafts = deltas.get("kvserve_spec_draft_tokens_total", 0.0)
    accepted = deltas.get("kvserve_spec_accepted_tokens_total", 0.0)
    row = pooled_row("spec", setting, f"kvserve speculation {config}", reports)
    row.ttft_p99_ms = None  # the spec table never showed it: 1 user, a handful of requests
    row.notes = f"{drafts:.0f} drafts, {accepted / drafts:.0%} accepted" if drafts else "no drafts"
    return row


# ------------------------------------------------------------------ without a server


def kernels(ctx: Context) -> SectionResult:
    """kvserve's quantized matmul against ggml's test-backend-ops, op by op, and M = 1 against
    the read bandwidth (bench_kernels; --quick: two types, two shapes, kvserve only when
    llama.cpp is off)."""
    from benchmarks import bench_kernels

    ggml = "off" if ctx.llama_cpp_mode == "off" else "cached"
    if ctx.quick:
        report = bench_kernels.run(("q4_0", "q4_K"), (1, 8), 0.05, ggml, False, 1, say)
    else:
        report = bench_kernels.run(ggml=ggml, say=say)
    return SectionResult(
        extra=report,
        table="Quantized matmul against ggml (kernels), in this run:\n\n"
        + bench_kernels.format_tables(report),
    )


def models(ctx: Context) -> SectionResult:
    """Real GGUF files against llama.cpp (bench_models): the embedded Q4_1, its Q4_K_M, a
    random 1B Q4_K_M; bandwidth probe, llama-bench, chat128 by users, RSS."""
    from dataclasses import asdict

    from benchmarks import bench_llama_cpp, bench_models

    sizes = ctx.sizes
    say(f"[models] {', '.join(sizes.models)}: chat128 at {sizes.models_levels}")
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    rows = bench_models.run(
        list(sizes.models),
        list(sizes.models_levels),
        ctx.threads,
        sizes.models_output_tokens,
        ctx.workload_file,
        cache_dir.parent.parent / "models",
        cache_dir,
        ctx.llama_cpp_mode,
    )
    return SectionResult(
        extra=[asdict(r) for r in rows],
        table="Real GGUF files (models), kvserve against llama.cpp in this run:\n\n"
        + bench_models.format_table(rows),
    )


def kvtier(ctx: Context) -> SectionResult:
    """KV tier 2 as users run it (bench_kv_tier_served): returning turns' TTFT with the tier
    against a pool that holds every conversation, and against llama.cpp's --cache-ram on the
    same conversations, per model."""
    import shutil
    import tempfile

    from benchmarks import bench_kv_tier_served, bench_llama_cpp, bench_models

    sizes = ctx.sizes
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    quantize = Path("/nonexistent")
    if ctx.llama_cpp_mode != "off":
        tools = bench_llama_cpp.ensure_tools(cache_dir, build=False)
        quantize = tools.get("llama-quantize", quantize)
    paths = bench_models.build_models(
        list(sizes.kvtier_models), cache_dir.parent.parent / "models", quantize
    )
    workload = bench_kv_tier_served.workload_for(sizes.kvtier_quick)
    root = tempfile.mkdtemp(prefix="kvserve-kvtier-")
    try:
        figures = bench_kv_tier_served.run(
            {name: path for name, (path, _) in paths.items()},
            workload,
            sizes.kvtier_users,
            ctx.threads,
            ctx.llama_cpp.binary,
            root,
            say=say,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    verdicts = bench_kv_tier_served.verdicts(figures)
    pools = bench_kv_tier_served.Pools.of(workload, sizes.kvtier_users)
    return SectionResult(
        extra={
            "workload": {
                "conversations": workload.num_conversations,
                "turns": workload.num_turns,
                "first_len": workload.first_len,
                "output_len": workload.output_len,
                "users": sizes.kvtier_users,
            },
            "runs": [f.summary() for f in figures],
            "verdicts": verdicts if ctx.full else None,
        },
        table=f"KV tier 2 as users run it (kvtier): {workload.num_conversations} conversations x "
        f"{workload.num_turns} turns, {sizes.kvtier_users} users; the tier's pool "
        f"({pools.in_flight} blocks) holds the turns in flight, not every history "
        f"({pools.all_conversations} blocks):\n\n" + bench_kv_tier_served.format_table(figures),
    )
