"""The reference section of ``make bench``: ``chat128`` (64 chat prompts of 128 tokens, 128
output tokens, greedy) by users, kvserve through gRPC against transformers (one at a time and
in static batches) and llama.cpp's ``llama-server`` on the same GGUF and requests."""

from __future__ import annotations

import gc
import json
from typing import Any

from benchmarks.harness.context import Context, say
from benchmarks.harness.report import (
    Row,
    SectionResult,
    fmt,
    ms,
    ratio,
    row_from_report,
    times,
    verdict,
)

# Issue 7's targets for kvserve through gRPC with fp32 weights.
TARGET_TOK_S = {1: 20.0, 8: 100.0, 32: 250.0}
TARGET_ITL_P99_MS_32 = 200.0
# Issue 10's targets, kvserve against llama.cpp measured in the same run: output tok/s ratio by
# users, and kvserve's ITL p99 at most this fraction of llama.cpp's at 32 users.
TARGET_VS_LLAMA_CPP = {1: 1.3, 8: 2.0, 32: 3.0}
TARGET_ITL_P99_VS_LLAMA_CPP_32 = 0.5


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
