"""The sections of ``make bench`` on real model files, each against llama.cpp in the same run:

- ``kernels``: kvserve's quantized matmul against ggml's ``test-backend-ops``, op by op;
- ``models``: real GGUF files (the embedded Q4_1, its Q4_K_M, random Q4_K_M 1B, 3B, Qwen3-1.7B
  a Qwen3-30B-A3B-shaped MoE and Gemma 3 1B);
- ``kvtier``: KV tier 2 as users run it, returning turns' TTFT;
- ``lora``: 8 adapters mixed against the base alone, and one adapter against llama-server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from benchmarks.harness.context import Context, say
from benchmarks.harness.report import SectionResult


def kernels(ctx: Context) -> SectionResult:
    """kvserve's quantized matmul against ggml's test-backend-ops, op by op, and M = 1 against
    the read bandwidth (bench_kernels; --quick: two types, two shapes, kvserve only when
    llama.cpp is off)."""
    from benchmarks import bench_kernels, bench_shapes, bench_tuning

    ggml = "off" if ctx.llama_cpp_mode == "off" else "cached"
    if ctx.quick:
        report = bench_kernels.run(("q4_0", "q4_K"), (1, 8), 0.05, ggml, False, 1, say)
        shapes = bench_shapes.run(bench_shapes.QUICK_SHAPES, passes=1, quick=True, say=say)
        tuning = bench_tuning.run(bench_tuning.QUICK_SHAPES, (1,), (1,), 1, quick=True, say=say)
    else:
        report = bench_kernels.run(ggml=ggml, say=say)
        shapes = bench_shapes.run(say=say)
        tuning = bench_tuning.run(say=say)
    return SectionResult(
        extra=report | {"shapes": shapes, "tuning": tuning},
        table="Quantized matmul against ggml (kernels), in this run:\n\n"
        + bench_kernels.format_tables(report)
        + "\n\n"
        + bench_shapes.format_table(shapes)
        + "\n\n"
        + bench_tuning.format_table(tuning),
    )


def models(ctx: Context) -> SectionResult:
    """Real GGUF files against llama.cpp (bench_models): the embedded Q4_1, its Q4_K_M,
    random Q4_K_M 1B, 3B, Qwen3-1.7B, Qwen3-30B-A3B-shaped MoE and Gemma 3 1B; bandwidth
    probe, llama-bench (2 threads, and 1 for the random ones), chat128 by users
    (bench_models.MAX_USERS), RSS."""
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


def lora(ctx: Context) -> SectionResult:
    """8 adapters mixed against the base alone on one server, and one adapter against
    ``llama-server --lora``, chat128, runs interleaved (bench_lora)."""
    from benchmarks import bench_llama_cpp, bench_lora, bench_models

    sizes = ctx.sizes
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    quantize = Path("/nonexistent")
    if ctx.llama_cpp.binary is not None:
        quantize = bench_llama_cpp.ensure_tools(cache_dir, build=False).get(
            "llama-quantize", quantize
        )
    work = cache_dir.parent.parent / "models"
    ((path, _),) = bench_models.build_models([sizes.lora_model], work, quantize).values()
    say(f"[lora] {sizes.lora_model}: rank {sizes.lora_rank}, levels {sizes.lora_levels}")
    figures, note = bench_lora.run(
        path, sizes.lora_model, ctx.workload_file,
        levels=list(sizes.lora_levels), mixed=sizes.lora_mixed,
        output_tokens=sizes.lora_output_tokens, threads=ctx.threads, rank=sizes.lora_rank,
        rounds=sizes.lora_rounds, work=work / "lora", llama_server=ctx.llama_cpp.binary,
        converter=bench_lora.converter_path(cache_dir),
    )  # fmt: skip
    verdicts = figures.verdicts()
    return SectionResult(
        extra=asdict(figures) | {"gguf": note, "verdicts": verdicts if ctx.full else None},
        table=bench_lora.format_table(figures) + f"\n\nThe adapter as GGUF: {note}.",
    )
