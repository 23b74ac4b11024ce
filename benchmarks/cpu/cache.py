"""The KV cache's sections of ``make bench``: paged (paged KV against contiguous
preallocation, in the same memory), kvcache (decode latency by length, KV cache against
recompute) and sinks (perplexity under attention sinks + window).
"""

from __future__ import annotations

from benchmarks.harness.context import Context, say
from benchmarks.harness.report import Row, SectionResult, fmt, ratio


def paged(ctx: Context) -> SectionResult:
    """Paged KV against contiguous preallocation in the same memory (FakeRunner)."""
    sizes, kv_bytes_per_token = ctx.sizes, smollm2_kv_bytes_per_token()
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
                f"{fmt(ratio(r.peak_concurrent, baseline[r.workload]), '.1f')}x concurrency"
            )
        rows.append(row)
    return SectionResult(rows)


def smollm2_kv_bytes_per_token() -> int | None:
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


def kvcache(ctx: Context) -> SectionResult:
    """Per-token decode latency against sequence length, KV cache against recompute."""
    from benchmarks import bench_kv_cache

    sizes = ctx.sizes
    say(f"[kvcache] lengths {sizes.kvcache_lengths}, {ctx.kv_threads} thread(s)")
    points = bench_kv_cache.run(sizes.kvcache_lengths, sizes.kvcache_tokens, ctx.kv_threads)
    png = ctx.out_dir / f"kv-cache-{'quick-' if ctx.quick else ''}{ctx.stamp}.png"
    bench_kv_cache.plot(
        points,
        png,
        f"SmolLM2-135M Q4_1 GGUF on kvserve's kernels, fp16 KV, "
        f"{ctx.kv_threads} thread(s); median of {sizes.kvcache_tokens} tokens",
    )
    return SectionResult(
        extra={"points": bench_kv_cache.as_dicts(points), "png": str(png)},
        table="KV cache against recompute (kvcache), per generated token, median of "
        f"{sizes.kvcache_tokens} tokens:\n\n{bench_kv_cache.format_table(points)}\n\nPNG: {png}",
    )


def sinks(ctx: Context) -> SectionResult:
    """Perplexity of a long text under attention sinks + window, window alone, full."""
    from benchmarks import bench_sinks

    sizes = ctx.sizes
    say(f"[sinks] {sizes.sinks_tokens} tokens, cache {sizes.sinks_cache}")
    results = bench_sinks.run(
        bench_sinks.DEFAULT_TEXT, sizes.sinks_tokens, sizes.sinks_cache, 4, 64, ctx.kv_threads
    )
    return SectionResult(
        extra=bench_sinks.as_dicts(results),
        table=f"Attention sinks (sinks), perplexity of {sizes.sinks_tokens} tokens of "
        f"{bench_sinks.DEFAULT_TEXT.name}:\n\n"
        f"{bench_sinks.format_table(results, sizes.sinks_cache)}",
    )
