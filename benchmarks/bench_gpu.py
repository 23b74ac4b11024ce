"""The CUDA path measured: decode and prefill against rooflines measured in the same run, and
serving against transformers' static batching on the same GPU.

    python -m benchmarks.bench_gpu                 # any CUDA machine with kvserve installed
    python -m benchmarks.bench_gpu --dry-run       # the same code on CPU, tiny shapes (CI)

The model is Llama-3-8B-SHAPED with RANDOM weights in bf16 (32 layers, hidden 4096, 32 / 8
heads of 128, MLP 14336, vocab 128256): timings depend on shapes, not on values, and no
checkpoint download is needed. Generation is greedy with ``ignore_eos``, so every request
produces exactly its output length. Sections:

1. **Probes**: device copy bandwidth (``dst.copy_(src)`` of a large buffer, read + write
   bytes) and matmul peak (a square GEMM in the model's dtype), best of a few runs.
2. **Decode**: step time at batch 1 / 32 / 128 / 256 with every request at the same
   context, against the HBM roofline (weights + KV read once per step / copy bandwidth) and,
   for the compute-bound batches, against the matmul peak (linear and attention FLOPs).
3. **Prefill**: one step of several fresh prompts, FLOPs / time against the matmul peak.
4. **Serving**: chat128-like traffic (128-token prompts, 128 output tokens) from 1 / 32 / 256
   closed-loop users through the engine's three-call step (``schedule``, ``execute``,
   ``update``, in process), against transformers' ``generate()`` on static batches of the
   same size on the same prompts, same GPU, same run.

``--dry-run`` shrinks every shape (a 2-layer model in fp32 on CPU) and runs the same code, so
CI proves the program runs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from benchmarks.bench_transformers import run_batches
from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.config import ATTENTION_BACKEND_CHOICES, ModelConfig
from model_runner.hf_loader import normalize_hf_config
from model_runner.runner import TorchRunner
from scheduler import Request, Scheduler, SchedulerConfig
from scheduler.output import ScheduledSeq, SchedulerOutput
from scheduler.request import SamplingParams

GREEDY = SamplingParams(temperature=0.0)

LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    **LLAMA3_8B,
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


@dataclass(frozen=True, slots=True)
class Sizes:
    model: dict[str, Any]
    dtype: torch.dtype
    copy_bytes: int
    matmul_n: int
    decode_batches: tuple[int, ...]
    decode_context: int
    decode_steps: int
    prefill_seqs: int
    prefill_len: int
    users: tuple[int, ...]
    prompt_len: int
    output_len: int
    requests_per_user: int
    kv_budget_bytes: int
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    repeats: int = 5


FULL = Sizes(
    model=LLAMA3_8B,
    dtype=torch.bfloat16,
    copy_bytes=2 << 30,
    matmul_n=8192,
    decode_batches=(1, 32, 128, 256),
    decode_context=512,
    decode_steps=20,
    prefill_seqs=4,
    prefill_len=2048,
    users=(1, 32, 256),
    prompt_len=128,
    output_len=128,
    requests_per_user=2,
    kv_budget_bytes=24 << 30,
)
DRY = Sizes(
    model=TINY,
    dtype=torch.float32,
    copy_bytes=8 << 20,
    matmul_n=128,
    decode_batches=(1, 32, 128, 256),
    decode_context=16,
    decode_steps=2,
    prefill_seqs=2,
    prefill_len=32,
    users=(1, 4, 8),
    prompt_len=16,
    output_len=4,
    requests_per_user=1,
    kv_budget_bytes=64 << 20,
    max_num_batched_tokens=512,
    repeats=2,
)


# ---------------------------------------------------------------------------- probes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up call)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_s(lambda: dst.copy_(src), device, repeats)


def matmul_peak(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / best_s(lambda: a @ b, device, repeats)


# ---------------------------------------------------------------------------- model arithmetic


def linear_params_per_token(config: ModelConfig) -> int:
    """Weights every token multiplies by in the layers (QKV, O, gate, up, down)."""
    h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
    hidden = config.hidden_size
    per_layer = hidden * (h + 2 * kvh) * d + h * d * hidden + 3 * hidden * config.intermediate_size
    return config.num_layers * per_layer


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


def decode_step_bytes(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> int:
    """Bytes a decode step must read at least: the layers' and the head's weights once, and
    every request's KV."""
    weights = (linear_params_per_token(config) + config.vocab_size * config.hidden_size) * (
        dtype_bytes
    )
    return weights + batch * context * kv_bytes_per_token(config, dtype_bytes)


def attention_flops(config: ModelConfig, num_pairs: int) -> int:
    """QK^T and PV over ``num_pairs`` (query, key) pairs, every layer and head."""
    return 4 * config.num_layers * config.num_heads * config.head_dim * num_pairs


def decode_step_flops(config: ModelConfig, batch: int, context: int) -> int:
    per_token = 2 * (linear_params_per_token(config) + config.vocab_size * config.hidden_size)
    return batch * per_token + attention_flops(config, batch * context)


def prefill_flops(config: ModelConfig, num_seqs: int, length: int) -> int:
    """Layers over every token, causal attention, the head on each prompt's last token."""
    layers = 2 * linear_params_per_token(config) * num_seqs * length
    head = 2 * config.vocab_size * config.hidden_size * num_seqs
    return layers + head + attention_flops(config, num_seqs * length * (length + 1) // 2)


# ---------------------------------------------------------------------------- models


def make_models(sizes: Sizes, device: torch.device) -> tuple[Any, ModelConfig]:
    """The transformers model with random weights (normal, std 0.02; norms 1) in the run's
    dtype on ``device``, and kvserve's config of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(**sizes.model)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(sizes.dtype)
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    config = ModelConfig.from_hf_config(normalize_hf_config(hf.config.to_dict()), name="llama3-8b")
    return hf.eval(), config


def make_runner(hf: Any, config: ModelConfig, sizes: Sizes, device: torch.device, backend: str):
    state = dict(hf.state_dict())
    return TorchRunner(
        config,
        state,
        block_size=sizes.block_size,
        dtype=sizes.dtype,
        device=device,
        kv_budget_bytes=sizes.kv_budget_bytes,
        kv_dtype=sizes.dtype,
        attention_backend=backend,
    )


def _seq(rid: str, token_ids: list[int], start: int, block_ids: list[int]) -> ScheduledSeq:
    return ScheduledSeq(rid, token_ids, start, block_ids, GREEDY, True)


def _plan(step: int, prefill=(), decode=()) -> SchedulerOutput:  # type: ignore[no-untyped-def]
    return SchedulerOutput(step_id=step, prefill=list(prefill), decode=list(decode))


# ---------------------------------------------------------------------------- sections


@dataclass(slots=True)
class Report:
    device: str
    dtype: str
    attention_backend: str
    copy_bandwidth_gb_s: float = 0.0
    matmul_peak_tflop_s: float = 0.0
    decode: list[dict[str, float]] = field(default_factory=list)
    prefill: dict[str, float] = field(default_factory=dict)
    serving: list[dict[str, float]] = field(default_factory=list)


def measure_decode(runner: TorchRunner, sizes: Sizes, batch: int) -> float:
    """Median seconds of a decode step of ``batch`` requests at ``decode_context`` keys."""
    bs, ctx = sizes.block_size, sizes.decode_context
    pages = -(-(ctx + sizes.decode_steps + 1) // bs)
    if batch * pages > runner.num_blocks:
        raise ValueError(f"decode batch {batch} needs {batch * pages} blocks > {runner.num_blocks}")
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(batch)]
    step = 0
    chunk = max(1, sizes.max_num_batched_tokens // ctx)
    for i in range(0, batch, chunk):  # fill the contexts (not timed)
        runner.execute(
            _plan(
                step,
                prefill=[
                    _seq(f"r{j}", [1] * ctx, 0, tables[j]) for j in range(i, min(batch, i + chunk))
                ],
            )
        )
        step += 1
    times: list[float] = []
    for s in range(sizes.decode_steps):
        plan = _plan(step, decode=[_seq(f"r{j}", [2], ctx + s, tables[j]) for j in range(batch)])
        t0 = time.perf_counter()
        runner.execute(plan)  # returns host tokens: the step has finished on the device
        times.append(time.perf_counter() - t0)
        step += 1
    times.sort()
    return times[len(times) // 2]


def measure_prefill(runner: TorchRunner, sizes: Sizes) -> float:
    """Best seconds of one step prefilling ``prefill_seqs`` fresh prompts of ``prefill_len``."""
    bs, n, length = sizes.block_size, sizes.prefill_seqs, sizes.prefill_len
    pages = -(-length // bs)
    plan = _plan(
        0,
        prefill=[
            _seq(f"p{i}", [3] * length, 0, list(range(i * pages, (i + 1) * pages)))
            for i in range(n)
        ],
    )
    return best_s(lambda: runner.execute(plan), runner.device, sizes.repeats)


def prompts_for(sizes: Sizes, num_requests: int, vocab: int) -> list[list[int]]:
    """Random chat128-like prompts: ``prompt_len`` token ids each, all distinct."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (num_requests, sizes.prompt_len), generator=g).tolist()


def serve_closed_loop(
    runner: TorchRunner, sizes: Sizes, num_users: int, prompts: Sequence[list[int]]
) -> dict[str, float]:
    """``num_users`` users, each sending its next prompt when the last one finished; output
    tokens per second over the whole run."""
    kv = KVCacheManager(KVCacheConfig(num_blocks=runner.num_blocks, block_size=sizes.block_size))
    config = SchedulerConfig(
        max_num_seqs=num_users,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        max_model_len=runner.info.max_model_len,
    )
    sched = Scheduler(config, kv)
    pending = list(enumerate(prompts))
    pending.reverse()

    def submit() -> None:
        i, prompt = pending.pop()
        sampling = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)
        sched.add_request(Request(f"u{i}", list(prompt), sampling))

    for _ in range(min(num_users, len(pending))):
        submit()
    output_tokens = 0
    t0 = time.perf_counter()
    while sched.num_waiting or sched.num_running:
        plan = sched.schedule()
        result = runner.execute(plan)
        for out in sched.update(plan, result):
            output_tokens += len(out.new_token_ids)
            if out.finished and pending:
                submit()
    wall = time.perf_counter() - t0
    return {"output_tokens": output_tokens, "wall_s": wall, "tok_s": output_tokens / wall}


def run(sizes: Sizes, device: torch.device, backend: str) -> Report:
    hf, config = make_models(sizes, device)
    dtype_bytes = torch.empty(0, dtype=sizes.dtype).element_size()
    runner = make_runner(hf, config, sizes, device, backend)
    report = Report(str(device), str(sizes.dtype).removeprefix("torch."), runner.attention.name)
    bandwidth = copy_bandwidth(device, sizes.copy_bytes, sizes.repeats)
    peak = matmul_peak(device, sizes.matmul_n, sizes.dtype, sizes.repeats)
    report.copy_bandwidth_gb_s = bandwidth / 1e9
    report.matmul_peak_tflop_s = peak / 1e12

    ctx = sizes.decode_context
    for batch in sizes.decode_batches:
        step_s = measure_decode(runner, sizes, batch)
        roofline_s = decode_step_bytes(config, batch, ctx, dtype_bytes) / bandwidth
        flop_s = decode_step_flops(config, batch, ctx) / step_s
        report.decode.append(
            {
                "batch": batch,
                "context": ctx,
                "step_ms": step_s * 1e3,
                "hbm_roofline_ms": roofline_s * 1e3,
                "of_hbm_roofline": roofline_s / step_s,
                "of_matmul_peak": flop_s / peak,
            }
        )
    prefill_s = measure_prefill(runner, sizes)
    flop_s = prefill_flops(config, sizes.prefill_seqs, sizes.prefill_len) / prefill_s
    report.prefill = {
        "seqs": sizes.prefill_seqs,
        "tokens_each": sizes.prefill_len,
        "step_ms": prefill_s * 1e3,
        "tflop_s": flop_s / 1e12,
        "of_matmul_peak": flop_s / peak,
    }

    served: dict[int, dict[str, float]] = {}
    for users in sizes.users:
        prompts = prompts_for(sizes, users * sizes.requests_per_user, config.vocab_size)
        served[users] = serve_closed_loop(runner, sizes, users, prompts)
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for users in sizes.users:
        prompts = prompts_for(sizes, users * sizes.requests_per_user, config.vocab_size)
        hf_run = run_batches(
            hf, prompts, batch_size=users, max_new_tokens=sizes.output_len, pad_id=0
        )
        ours = served[users]
        report.serving.append(
            {
                "users": users,
                "requests": len(prompts),
                "kvserve_tok_s": ours["tok_s"],
                "transformers_static_tok_s": hf_run.output_tokens_per_s,
                "ratio": ours["tok_s"] / hf_run.output_tokens_per_s,
            }
        )
    return report


def format_report(report: Report) -> str:
    lines = [
        f"device {report.device}, {report.dtype}, attention backend {report.attention_backend}",
        f"copy bandwidth {report.copy_bandwidth_gb_s:.1f} GB/s, "
        f"matmul peak {report.matmul_peak_tflop_s:.2f} TFLOP/s (measured in this run)",
        "",
        "| decode batch | context | step ms | HBM roofline ms | of roofline | of matmul peak |",
        "|---|---|---|---|---|---|",
    ]
    for d in report.decode:
        lines.append(
            f"| {d['batch']} | {d['context']} | {d['step_ms']:.2f} | {d['hbm_roofline_ms']:.2f} "
            f"| {d['of_hbm_roofline']:.0%} | {d['of_matmul_peak']:.0%} |"
        )
    p = report.prefill
    lines += [
        "",
        f"prefill {p['seqs']} x {p['tokens_each']} tokens: {p['step_ms']:.1f} ms, "
        f"{p['tflop_s']:.2f} TFLOP/s = {p['of_matmul_peak']:.0%} of the matmul peak",
        "",
        "| users | requests | kvserve tok/s | transformers static tok/s | kvserve / transformers |",
        "|---|---|---|---|---|",
    ]
    for s in report.serving:
        lines.append(
            f"| {s['users']} | {s['requests']} | {s['kvserve_tok_s']:.1f} "
            f"| {s['transformers_static_tok_s']:.1f} | {s['ratio']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (CI)")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES)
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    report = run(DRY if args.dry_run else FULL, device, args.attention_backend)
    print(format_report(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
