"""The CUDA path measured: decode and prefill against rooflines measured in the same run, where
a decode step's time goes, serving in process with the GPU's busy time, and the real server
over HTTP.

    python -m benchmarks.bench_gpu                 # any CUDA machine with kvserve installed
    python -m benchmarks.bench_gpu --quick         # every headline figure, smaller counts
    python -m benchmarks.bench_gpu --sections probes,attention --out gpu.json
    python -m benchmarks.bench_gpu --dry-run       # the same code on CPU, tiny shapes (CI)

The model is Llama-3-8B-SHAPED with RANDOM weights in bf16 (32 layers, hidden 4096, 32 / 8
heads of 128, MLP 14336, vocab 128256): timings depend on shapes, not on values, and no
checkpoint download is needed. Generation is greedy with ``ignore_eos``, so every request
produces exactly its output length. Each section prints its table as soon as it is measured
and ``--out`` is rewritten after each, so a run cut short keeps what came before; ``--sections``
picks some (the probes always run: the others are measured against them). Sections:

1. **probes**: device copy bandwidth (``dst.copy_(src)`` of a large buffer, read + write
   bytes) and matmul peak (a square GEMM in the model's dtype), best of a few runs.
2. **attention**: the Triton paged decode kernel alone (no model), at batch 1 / 32 / 256 x
   512 and 8,192 keys on scattered pages: GB/s of KV read against the copy bandwidth, each
   timed as CUDA-graph replays over enough page sets to overflow the L2 cache, checked
   against a torch reference; then a sweep of tile and launch configurations at the two
   shapes the targets name (batch 256 x 512, batch 1 x 8,192).
3. **decode**: step time at batch 1 / 32 / 128 / 256 with every request at the same
   context, against the HBM roofline (weights + KV read once per step / copy bandwidth) and,
   for the compute-bound batches, against the matmul peak (linear and attention FLOPs).
4. **prefill**: one step of several fresh prompts, FLOPs / time against the matmul peak.
5. **profile**: torch.profiler over a few decode steps at batch 1 and 256: the kernels that
   took the most GPU time, each with its share of the step (``gpu_step.profile_decode``).
6. **serving**: chat128-like traffic (128-token prompts, 128 output tokens) from 1 / 32 / 256
   closed-loop users through the engine's three-call step (``schedule``, ``execute``,
   ``update``, in process): output tok/s, and the GPU's busy fraction (each step's forward
   timed by CUDA events, over the wall); with ``--transformers`` also transformers'
   ``generate()`` on static batches of the same size on the same prompts, same GPU, same run.
7. **server**: the same traffic through ``kvserve serve --device cuda`` over HTTP, driven by
   the load tester (``gpu_server``): output tok/s against the closed loop's.

``--quick`` keeps every headline figure (the decode kernel at 1 x 8,192 keys, decode at batch
1 and 256, the profile, serving and the server at 256 users) with fewer cases and steps.
``--dry-run`` shrinks every shape (a 2-layer model in fp32 on CPU, the attention kernel in
Triton's interpreter, the server on CPU) and runs the same code, so CI proves the program
runs; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_attention import AttentionCases, measure_attention
from benchmarks.bench_transformers import run_batches
from benchmarks.gpu_server import ServerLoad, serve_http, write_checkpoint
from benchmarks.gpu_step import (
    greedy_seq,
    measure_decode,
    profile_decode,
    serve_closed_loop,
    step_plan,
)
from model_runner.config import ATTENTION_BACKEND_CHOICES, ModelConfig, RunnerOptions
from model_runner.device import dtype_name
from model_runner.hf_loader import normalize_hf_config
from model_runner.runner import TorchRunner

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
    attention: AttentionCases
    profile_batches: tuple[int, ...] = (1, 256)
    profile_steps: int = 5
    transformers: bool = False  # serving also measures transformers' static batches
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
    attention=AttentionCases(
        batches=(1, 32, 256),
        keys=(512, 8192),
        configs=(
            (16, 4, 2),
            (32, 4, 2),
            (32, 4, 3),
            (32, 8, 2),
            (64, 4, 2),
            (64, 4, 3),
            (64, 8, 2),
            (64, 8, 3),
        ),
        sweep=((256, 512), (1, 8192)),
    ),
)
# Every headline figure of issue 38 in a few minutes: batch 1 and 256 only, fewer steps and
# configurations, serving and the server at 256 users.
QUICK = dataclasses.replace(
    FULL,
    decode_batches=(1, 256),
    decode_steps=10,
    users=(256,),
    attention=dataclasses.replace(
        FULL.attention,
        batches=(1, 256),
        configs=((16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 8, 2)),
        sweep=((1, 8192),),
    ),
    profile_steps=3,
    repeats=3,
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
    attention=AttentionCases(
        batches=(1, 3),
        keys=(20, 40),
        configs=((16, 4, 2), (32, 4, 2)),
        sweep=((3, 20),),
        dtype=torch.float32,
        repeats=2,
    ),
    profile_batches=(1, 8),
    profile_steps=1,
    transformers=True,
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
    options = RunnerOptions(
        block_size=sizes.block_size,
        dtype=sizes.dtype,
        device=device,
        kv_budget_bytes=sizes.kv_budget_bytes,
        kv_dtype=sizes.dtype,
        attention_backend=backend,
    )
    return TorchRunner(config, state, options)


# ---------------------------------------------------------------------------- sections

SECTIONS = ("probes", "attention", "decode", "prefill", "profile", "serving", "server")


@dataclass(slots=True)
class Report:
    device: str
    dtype: str
    attention_backend: str
    sections: list[str] = field(default_factory=list)  # those measured, in order
    copy_bandwidth_gb_s: float = 0.0
    matmul_peak_tflop_s: float = 0.0
    attention: list[dict[str, Any]] = field(default_factory=list)
    decode: list[dict[str, float]] = field(default_factory=list)
    prefill: dict[str, float] = field(default_factory=dict)
    profile: list[dict[str, Any]] = field(default_factory=list)
    serving: list[dict[str, float]] = field(default_factory=list)
    server: list[dict[str, Any]] = field(default_factory=list)


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


def prompts_for(sizes: Sizes, num_requests: int, vocab: int) -> list[list[int]]:
    """Random chat128-like prompts: ``prompt_len`` token ids each, all distinct."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (num_requests, sizes.prompt_len), generator=g).tolist()


class Bench:
    """One run: the sections in order, each printed and saved as soon as it is measured.
    The models and the runner are built when a section first needs them."""

    def __init__(
        self,
        sizes: Sizes,
        device: torch.device,
        backend: str,
        emit: Callable[[str], None] = print,
        save: Callable[[Report], None] | None = None,
    ) -> None:
        self.sizes = sizes
        self.device = device
        self.backend = backend
        self.emit = emit
        self.save = save
        self.dtype_bytes = torch.empty(0, dtype=sizes.dtype).element_size()
        self.report = Report(str(device), str(sizes.dtype).removeprefix("torch."), backend)
        self._models: tuple[Any, ModelConfig] | None = None
        self._runner: TorchRunner | None = None
        self.bandwidth = self.peak = 0.0

    @property
    def config(self) -> ModelConfig:
        return self.models[1]

    @property
    def models(self) -> tuple[Any, ModelConfig]:
        if self._models is None:
            self._models = make_models(self.sizes, self.device)
        return self._models

    @property
    def runner(self) -> TorchRunner:
        if self._runner is None:
            hf, config = self.models
            self._runner = make_runner(hf, config, self.sizes, self.device, self.backend)
            self.report.attention_backend = self._runner.attention.name
            self.emit(f"attention backend: {self.report.attention_backend}")
        return self._runner

    def run(self, sections: Sequence[str]) -> Report:
        self.emit(f"device {self.device}, {self.report.dtype}")
        for name in ("probes", *(s for s in SECTIONS if s in sections and s != "probes")):
            getattr(self, f"section_{name}")()
            self.report.sections.append(name)
            if self.save is not None:
                self.save(self.report)
        return self.report

    def section_probes(self) -> None:
        s = self.sizes
        self.bandwidth = copy_bandwidth(self.device, s.copy_bytes, s.repeats)
        self.peak = matmul_peak(self.device, s.matmul_n, s.dtype, s.repeats)
        self.report.copy_bandwidth_gb_s = self.bandwidth / 1e9
        self.report.matmul_peak_tflop_s = self.peak / 1e12
        self.emit(
            f"copy bandwidth {self.bandwidth / 1e9:.1f} GB/s, matmul peak "
            f"{self.peak / 1e12:.2f} TFLOP/s (measured in this run)"
        )

    def section_attention(self) -> None:
        from transformers import LlamaConfig

        hf_config = LlamaConfig(**self.sizes.model).to_dict()
        config = ModelConfig.from_hf_config(normalize_hf_config(hf_config), name="shape")
        self.emit("\n| decode kernel: batch | keys | config (block_n/warps/stages) | us | GB/s "
                  "| of copy bandwidth | max abs err |\n|---|---|---|---|---|---|---|")  # fmt: skip
        self.report.attention = measure_attention(
            config,
            self.sizes.attention,
            self.device,
            self.bandwidth,
            self._emit_attention_row,
        )
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _emit_attention_row(self, r: dict[str, Any]) -> None:
        head = f"| {r['batch']} | {r['keys']} | {r['config']} "
        if "error" in r:
            self.emit(head + f"| {r['error']} | | | |")
            return
        self.emit(
            head + f"| {r['us']:.1f} | {r['gb_s']:.0f} | {r['of_copy_bandwidth']:.0%} "
            f"| {r['max_abs_err']:.1e} |"
        )

    def section_decode(self) -> None:
        ctx, runner = self.sizes.decode_context, self.runner
        self.emit("\n| decode batch | context | step ms | HBM roofline ms | of roofline "
                  "| of matmul peak |\n|---|---|---|---|---|---|")  # fmt: skip
        for batch in self.sizes.decode_batches:
            step_s = measure_decode(runner, self.sizes, batch)
            roofline_s = decode_step_bytes(self.config, batch, ctx, self.dtype_bytes)
            roofline_s /= self.bandwidth
            d = {
                "batch": batch,
                "context": ctx,
                "step_ms": step_s * 1e3,
                "hbm_roofline_ms": roofline_s * 1e3,
                "of_hbm_roofline": roofline_s / step_s,
                "of_matmul_peak": decode_step_flops(self.config, batch, ctx) / step_s / self.peak,
            }
            self.report.decode.append(d)
            self.emit(
                f"| {batch} | {ctx} | {d['step_ms']:.2f} | {d['hbm_roofline_ms']:.2f} "
                f"| {d['of_hbm_roofline']:.0%} | {d['of_matmul_peak']:.0%} |"
            )

    def section_prefill(self) -> None:
        s = self.sizes
        prefill_s = measure_prefill(self.runner, s)
        flop_s = prefill_flops(self.config, s.prefill_seqs, s.prefill_len) / prefill_s
        p = self.report.prefill = {
            "seqs": s.prefill_seqs,
            "tokens_each": s.prefill_len,
            "step_ms": prefill_s * 1e3,
            "tflop_s": flop_s / 1e12,
            "of_matmul_peak": flop_s / self.peak,
        }
        self.emit(
            f"\nprefill {p['seqs']} x {p['tokens_each']} tokens: {p['step_ms']:.1f} ms, "
            f"{p['tflop_s']:.2f} TFLOP/s = {p['of_matmul_peak']:.0%} of the matmul peak"
        )

    def section_profile(self) -> None:
        s, runner = self.sizes, self.runner
        for batch in s.profile_batches:
            p = profile_decode(runner, s, batch, s.profile_steps)
            self.report.profile.append(asdict(p))
            what = "GPU kernels" if self.device.type == "cuda" else "CPU ops (dry run)"
            self.emit(
                f"\ndecode batch {batch} x {s.decode_context} keys, {p.steps} steps profiled: "
                f"{p.step_ms:.2f} ms a step, {what} {p.kernels_ms:.2f} ms "
                f"({p.kernels_ms / p.step_ms:.0%} of the step)\n"
                "| kernel | us / step | calls / step | of the step |\n|---|---|---|---|"
            )
            for k in p.top:
                self.emit(f"| {k['name'][:90]} | {k['us']:.1f} | {k['calls']:.1f} "
                          f"| {k['of_step']:.1%} |")  # fmt: skip

    def section_serving(self) -> None:
        s = self.sizes
        hf, config = self.models
        self.emit("\n| users | requests | steps | kvserve tok/s | GPU busy | transformers static "
                  "tok/s | kvserve / transformers |\n|---|---|---|---|---|---|---|")  # fmt: skip
        rows: list[dict[str, float]] = []
        for users in s.users:
            prompts = prompts_for(s, users * s.requests_per_user, config.vocab_size)
            ours = serve_closed_loop(self.runner, s, users, prompts)
            rows.append({
                "users": users, "requests": len(prompts), "steps": ours["steps"],
                "kvserve_tok_s": ours["tok_s"], "gpu_busy": ours["gpu_busy"],
            })  # fmt: skip
            if not s.transformers:
                self._emit_serving(rows[-1])
        self.report.serving = rows
        if not s.transformers:
            return
        self._runner = None  # transformers needs the memory the pool held
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for row in rows:
            users = int(row["users"])
            prompts = prompts_for(s, users * s.requests_per_user, config.vocab_size)
            hf_run = run_batches(
                hf, prompts, batch_size=users, max_new_tokens=s.output_len, pad_id=0
            )
            row["transformers_static_tok_s"] = hf_run.output_tokens_per_s
            row["ratio"] = row["kvserve_tok_s"] / hf_run.output_tokens_per_s
            self._emit_serving(row)

    def _emit_serving(self, row: dict[str, float]) -> None:
        theirs = row.get("transformers_static_tok_s")
        vs = "| - | - |" if theirs is None else f"| {theirs:.1f} | {row['ratio']:.2f}x |"
        self.emit(
            f"| {row['users']} | {row['requests']} | {row['steps']} | {row['kvserve_tok_s']:.1f} "
            f"| {row['gpu_busy']:.1%} {vs}"
        )

    def section_server(self) -> None:
        s = self.sizes
        hf, config = self.models
        load = ServerLoad(
            users=s.users, requests_per_user=s.requests_per_user, prompt_len=s.prompt_len,
            output_len=s.output_len, vocab_size=config.vocab_size,
            max_num_batched_tokens=s.max_num_batched_tokens, block_size=s.block_size,
            kv_memory_bytes=s.kv_budget_bytes,
        )  # fmt: skip
        closed = {int(r["users"]): r["kvserve_tok_s"] for r in self.report.serving}

        def emit(row: dict[str, Any]) -> None:
            loop = closed.get(row["users"])
            row["closed_loop_tok_s"] = loop
            row["of_closed_loop"] = None if not loop else row["tok_s"] / loop
            self.report.server.append(row)
            if self.save is not None:  # each user count kept as soon as it is measured
                self.save(self.report)
            ratio = "-" if row["of_closed_loop"] is None else f"{row['of_closed_loop']:.2f}x"
            ttft, tpot = row["ttft_p50_s"], row["tpot_p50_s"]
            self.emit(
                f"| {row['users']} | {row['requests']} | {row['ok']} | {row['tok_s']:.1f} "
                f"| {'-' if loop is None else f'{loop:.1f}'} | {ratio} "
                f"| {'-' if ttft is None else f'{ttft * 1e3:.1f}'} "
                f"| {'-' if tpot is None else f'{tpot * 1e3:.2f}'} |"
            )

        with tempfile.TemporaryDirectory(prefix="kvserve-bench-model-") as folder:
            t0 = time.perf_counter()
            write_checkpoint(hf, Path(folder))
            self.emit(f"\nkvserve serve over HTTP (checkpoint written in "
                      f"{time.perf_counter() - t0:.1f} s)\n| users | requests | ok "
                      "| server tok/s | closed loop tok/s | server / closed loop | TTFT p50 ms "
                      "| TPOT p50 ms |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
            self._runner = self._models = None  # the server needs the GPU's memory
            del hf
            gc.collect()  # the runner's cycles (graphs, threads) hold the pool and weights
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
                held = torch.cuda.memory_reserved(self.device) / 2**30
                self.emit(f"(this process holds {held:.1f} GiB of GPU memory for the server's run)")
            serve_http(
                Path(folder), load, device=str(self.device), dtype=dtype_name(s.dtype),
                backend=self.backend, emit=emit,
            )  # fmt: skip


def parse_sections(text: str) -> list[str]:
    """``--sections``: comma-separated names of ``SECTIONS`` (``all``: every one)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown sections {unknown or text!r}: use some of {', '.join(SECTIONS)} or all"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (CI)")
    parser.add_argument(
        "--quick", action="store_true", help="every headline figure, fewer cases and steps"
    )
    parser.add_argument(
        "--transformers", action="store_true",
        help="serving also runs transformers' static batches (always in the dry run)",
    )  # fmt: skip
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES)
    parser.add_argument(
        "--sections", type=parse_sections, default=list(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write the report as JSON here (per section)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    if device.type != "cuda" and "attention" in args.sections:
        # Triton runs off CUDA only in its interpreter; read when its kernels are decorated.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    def save(report: Report) -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(asdict(report), f, indent=2)

    def emit(line: str) -> None:
        print(line, flush=True)

    sizes = DRY if args.dry_run else QUICK if args.quick else FULL
    if args.transformers:
        sizes = dataclasses.replace(sizes, transformers=True)
    Bench(sizes, device, args.attention_backend, emit, save).run(args.sections)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
