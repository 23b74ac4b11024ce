"""The GPU sections (``bench_gpu``), each a function of a ``Context`` like the CPU ones:
it prints its table's lines as it measures them (``ctx.emit``) and returns its figures as
``extra``, which the report keeps under the section's name. The others are measured against
the probes' figures (``needs=("probes",)`` in the registry), read from the report so far.

The model and the runner are the run's ``GpuModels`` (``ctx.gpu``), built when a section
first needs them.
"""

from __future__ import annotations

import gc
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_transformers import run_batches
from benchmarks.gpu.attention import measure_attention
from benchmarks.gpu.models import (
    GpuModels,
    best_s,
    copy_bandwidth,
    decode_step_bytes,
    decode_step_flops,
    matmul_peak,
    prefill_flops,
    shape_config,
)
from benchmarks.gpu.server import ServerLoad, serve_http, write_checkpoint
from benchmarks.gpu.step import (
    greedy_seq,
    measure_decode,
    profile_decode,
    serve_closed_loop,
    step_plan,
)
from benchmarks.harness.context import Context
from benchmarks.harness.report import SectionResult
from benchmarks.harness.sizes import Sizes
from model_runner.device import dtype_name
from model_runner.runner import TorchRunner


def gpu(ctx: Context) -> GpuModels:
    """The run's models (built on first use); the report's header names the runner's
    attention backend once it is built."""
    if ctx.gpu is None:

        def on_runner(runner: TorchRunner) -> None:
            ctx.report.header["attention_backend"] = runner.attention.name
            ctx.emit(f"attention backend: {runner.attention.name}")

        ctx.gpu = GpuModels(ctx.sizes, torch.device(ctx.device), ctx.attention_backend, on_runner)
    return ctx.gpu


def _probe(ctx: Context, key: str) -> float:
    """A figure of the probes (bytes/s or FLOP/s), which every other section needs."""
    probes = ctx.report.extra("probes")
    return float(probes[key]) * (1e9 if key == "copy_bandwidth_gb_s" else 1e12)


def probes(ctx: Context) -> SectionResult:
    """Device copy bandwidth (read + write bytes) and matmul peak in the model's dtype."""
    s, device = ctx.sizes, torch.device(ctx.device)
    bandwidth = copy_bandwidth(device, s.copy_bytes, s.repeats)
    peak = matmul_peak(device, s.matmul_n, getattr(torch, s.dtype), s.repeats)
    ctx.emit(
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, matmul peak "
        f"{peak / 1e12:.2f} TFLOP/s (measured in this run)"
    )
    return SectionResult(
        extra={"copy_bandwidth_gb_s": bandwidth / 1e9, "matmul_peak_tflop_s": peak / 1e12}
    )


def attention(ctx: Context) -> SectionResult:
    """The Triton paged decode kernel alone, GB/s of KV read against the copy bandwidth."""
    device = torch.device(ctx.device)
    ctx.emit("\n| decode kernel: batch | keys | config (block_n/warps/stages) | us | GB/s "
             "| of copy bandwidth | max abs err |\n|---|---|---|---|---|---|---|")  # fmt: skip

    def emit_row(r: dict[str, Any]) -> None:
        head = f"| {r['batch']} | {r['keys']} | {r['config']} "
        if "error" in r:
            ctx.emit(head + f"| {r['error']} | | | |")
            return
        ctx.emit(
            head + f"| {r['us']:.1f} | {r['gb_s']:.0f} | {r['of_copy_bandwidth']:.0%} "
            f"| {r['max_abs_err']:.1e} |"
        )

    rows = measure_attention(
        shape_config(ctx.sizes),
        ctx.sizes.attention,
        device,
        _probe(ctx, "copy_bandwidth_gb_s"),
        emit_row,
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return SectionResult(extra=rows)


def decode(ctx: Context) -> SectionResult:
    """Step time at each decode batch against the HBM roofline and the matmul peak."""
    models, context = gpu(ctx), ctx.sizes.decode_context
    runner, config = models.runner, models.config
    bandwidth, peak = _probe(ctx, "copy_bandwidth_gb_s"), _probe(ctx, "matmul_peak_tflop_s")
    ctx.emit("\n| decode batch | context | step ms | HBM roofline ms | of roofline "
             "| of matmul peak |\n|---|---|---|---|---|---|")  # fmt: skip
    rows = []
    for batch in ctx.sizes.decode_batches:
        step_s = measure_decode(runner, ctx.sizes, batch)
        roofline_s = decode_step_bytes(config, batch, context, models.dtype_bytes) / bandwidth
        d = {
            "batch": batch,
            "context": context,
            "step_ms": step_s * 1e3,
            "hbm_roofline_ms": roofline_s * 1e3,
            "of_hbm_roofline": roofline_s / step_s,
            "of_matmul_peak": decode_step_flops(config, batch, context) / step_s / peak,
        }
        rows.append(d)
        ctx.emit(
            f"| {batch} | {context} | {d['step_ms']:.2f} | {d['hbm_roofline_ms']:.2f} "
            f"| {d['of_hbm_roofline']:.0%} | {d['of_matmul_peak']:.0%} |"
        )
    return SectionResult(extra=rows)


def measure_prefill(runner: TorchRunner, sizes: Sizes) -> float:
    """Best seconds of one step prefilling ``prefill_seqs`` fresh prompts of ``prefill_len``."""
    bs, n, length = sizes.block_size, sizes.prefill_seqs, sizes.prefill_len
    pages = -(-length // bs)
    plan = step_plan(
        0,
        prefill=[
            greedy_seq(f"p{i}", [3] * length, 0, list(range(i * pages, (i + 1) * pages)))
            for i in range(n)
        ],
    )
    return best_s(lambda: runner.execute(plan), runner.device, sizes.repeats)


def prefill(ctx: Context) -> SectionResult:
    """One step of several fresh prompts, FLOPs / time against the matmul peak."""
    s, models = ctx.sizes, gpu(ctx)
    prefill_s = measure_prefill(models.runner, s)
    flop_s = prefill_flops(models.config, s.prefill_seqs, s.prefill_len) / prefill_s
    p = {
        "seqs": s.prefill_seqs,
        "tokens_each": s.prefill_len,
        "step_ms": prefill_s * 1e3,
        "tflop_s": flop_s / 1e12,
        "of_matmul_peak": flop_s / _probe(ctx, "matmul_peak_tflop_s"),
    }
    ctx.emit(
        f"\nprefill {p['seqs']} x {p['tokens_each']} tokens: {p['step_ms']:.1f} ms, "
        f"{p['tflop_s']:.2f} TFLOP/s = {p['of_matmul_peak']:.0%} of the matmul peak"
    )
    return SectionResult(extra=p)


def profile(ctx: Context) -> SectionResult:
    """torch.profiler over a few decode steps: the kernels that took the most device time."""
    s, runner = ctx.sizes, gpu(ctx).runner
    found = []
    for batch in s.profile_batches:
        p = profile_decode(runner, s, batch, s.profile_steps)
        found.append(asdict(p))
        what = "GPU kernels" if ctx.device.startswith("cuda") else "CPU ops (dry run)"
        ctx.emit(
            f"\ndecode batch {batch} x {s.decode_context} keys, {p.steps} steps profiled: "
            f"{p.step_ms:.2f} ms a step, {what} {p.kernels_ms:.2f} ms "
            f"({p.kernels_ms / p.step_ms:.0%} of the step)\n"
            "| kernel | us / step | calls / step | of the step |\n|---|---|---|---|"
        )
        for k in p.top:
            ctx.emit(f"| {k['name'][:90]} | {k['us']:.1f} | {k['calls']:.1f} "
                     f"| {k['of_step']:.1%} |")  # fmt: skip
    return SectionResult(extra=found)


def prompts_for(sizes: Sizes, num_requests: int, vocab: int) -> list[list[int]]:
    """Random chat128-like prompts: ``prompt_len`` token ids each, all distinct."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (num_requests, sizes.prompt_len), generator=g).tolist()


def serving(ctx: Context) -> SectionResult:
    """Closed-loop users through the engine's three calls in process: output tok/s, the
    GPU's busy fraction; with ``transformers``, its static batches on the same prompts."""
    s, models = ctx.sizes, gpu(ctx)
    hf, config = models.models
    ctx.emit("\n| users | requests | steps | kvserve tok/s | GPU busy | transformers static "
             "tok/s | kvserve / transformers |\n|---|---|---|---|---|---|---|")  # fmt: skip
    rows: list[dict[str, float]] = []
    for users in s.users:
        prompts = prompts_for(s, users * s.requests_per_user, config.vocab_size)
        ours = serve_closed_loop(models.runner, s, users, prompts)
        rows.append({
            "users": users, "requests": len(prompts), "steps": ours["steps"],
            "kvserve_tok_s": ours["tok_s"], "gpu_busy": ours["gpu_busy"],
        })  # fmt: skip
        if not s.transformers:
            _emit_serving(ctx, rows[-1])
    if not s.transformers:
        return SectionResult(extra=rows)
    models.drop_runner()  # transformers needs the memory the pool held
    for row in rows:
        users = int(row["users"])
        prompts = prompts_for(s, users * s.requests_per_user, config.vocab_size)
        hf_run = run_batches(hf, prompts, batch_size=users, max_new_tokens=s.output_len, pad_id=0)
        row["transformers_static_tok_s"] = hf_run.output_tokens_per_s
        row["ratio"] = row["kvserve_tok_s"] / hf_run.output_tokens_per_s
        _emit_serving(ctx, row)
    return SectionResult(extra=rows)


def _emit_serving(ctx: Context, row: dict[str, float]) -> None:
    theirs = row.get("transformers_static_tok_s")
    vs = "| - | - |" if theirs is None else f"| {theirs:.1f} | {row['ratio']:.2f}x |"
    ctx.emit(
        f"| {row['users']} | {row['requests']} | {row['steps']} | {row['kvserve_tok_s']:.1f} "
        f"| {row['gpu_busy']:.1%} {vs}"
    )


def server(ctx: Context) -> SectionResult:
    """The same traffic through ``kvserve serve`` over HTTP (the load tester): output tok/s
    against the closed loop's; each user count saved as soon as it is measured."""
    s, models, device = ctx.sizes, gpu(ctx), torch.device(ctx.device)
    hf, config = models.models
    load = ServerLoad(
        users=s.users, requests_per_user=s.requests_per_user, prompt_len=s.prompt_len,
        output_len=s.output_len, vocab_size=config.vocab_size,
        max_num_batched_tokens=s.max_num_batched_tokens, block_size=s.block_size,
        kv_memory_bytes=s.kv_budget_bytes,
    )  # fmt: skip
    closed = {int(r["users"]): r["kvserve_tok_s"] for r in ctx.report.extra("serving") or []}
    result = ctx.report.results["server"] = SectionResult(extra=[])

    def emit(row: dict[str, Any]) -> None:
        loop = closed.get(row["users"])
        row["closed_loop_tok_s"] = loop
        row["of_closed_loop"] = None if not loop else row["tok_s"] / loop
        result.extra.append(row)
        ctx.saved()
        ratio = "-" if row["of_closed_loop"] is None else f"{row['of_closed_loop']:.2f}x"
        ttft, tpot = row["ttft_p50_s"], row["tpot_p50_s"]
        ctx.emit(
            f"| {row['users']} | {row['requests']} | {row['ok']} | {row['tok_s']:.1f} "
            f"| {'-' if loop is None else f'{loop:.1f}'} | {ratio} "
            f"| {'-' if ttft is None else f'{ttft * 1e3:.1f}'} "
            f"| {'-' if tpot is None else f'{tpot * 1e3:.2f}'} |"
        )

    with tempfile.TemporaryDirectory(prefix="kvserve-bench-model-") as folder:
        t0 = time.perf_counter()
        write_checkpoint(hf, Path(folder))
        ctx.emit(f"\nkvserve serve over HTTP (checkpoint written in "
                 f"{time.perf_counter() - t0:.1f} s)\n| users | requests | ok "
                 "| server tok/s | closed loop tok/s | server / closed loop | TTFT p50 ms "
                 "| TPOT p50 ms |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
        models.drop_all()  # the server needs the GPU's memory
        del hf
        gc.collect()  # the runner's cycles (graphs, threads) hold the pool and weights
        if device.type == "cuda":
            torch.cuda.empty_cache()
            held = torch.cuda.memory_reserved(device) / 2**30
            ctx.emit(f"(this process holds {held:.1f} GiB of GPU memory for the server's run)")
        serve_http(
            Path(folder), load, device=str(device), dtype=dtype_name(models.dtype),
            backend=ctx.attention_backend, emit=emit,
        )  # fmt: skip
    return result
