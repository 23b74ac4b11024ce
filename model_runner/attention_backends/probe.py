"""``auto`` on CUDA: the fastest attention backend that measures right, chosen at start-up.

Each installed candidate runs one layer (one per window, with per-layer windows) of a
synthetic step at the model's ``AttentionSpec`` (prefill chunks over cached prefixes and a
batch of decodes, random pool and queries); its output is held against the torch
reference's (``max |ours - torch|`` within the KV dtype's tolerance), then timed (median of
a few eager calls after a warm-up, which also compiles). ``choose_backend`` (pure) takes the
fastest candidate that matched; torch when none did.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from model_runner.attention_backends.base import AttentionBackend, AttentionSpec
from model_runner.kv_pool import KVPool
from model_runner.step import StepRows
from scheduler.output import ScheduledSeq
from scheduler.request import SamplingParams

# max |backend - torch| over the probe's outputs (|q| ~ 0.5, random pool) that still counts
# as right, by KV dtype: fp32 sums in another order, 16-bit pools round P and V.
TOLERANCE = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 6e-2}


@dataclass(frozen=True, slots=True)
class Measurement:
    """One candidate on the probe: its largest deviation from torch, the tolerance, and its
    median seconds per layer call (None: it raised, and ``error`` says what)."""

    max_abs_err: float
    tolerance: float
    seconds: float | None
    error: str = ""

    @property
    def right(self) -> bool:
        return self.seconds is not None and self.max_abs_err <= self.tolerance


def choose_backend(measured: dict[str, Measurement]) -> str:
    """The fastest backend that measured right (ties: the first listed); ``torch`` if none."""
    right = [(m.seconds, name) for name, m in measured.items() if m.right and m.seconds]
    if not right:
        return "torch"
    best = min(s for s, _ in right)
    return next(name for s, name in right if s == best)


@dataclass(frozen=True, slots=True)
class ProbeShape:
    """The step the probe runs: ``num_decodes`` decodes at ``decode_keys`` keys and
    ``num_chunks`` chunks of ``chunk_len`` tokens over ``prefix_len`` cached tokens."""

    num_decodes: int = 32
    decode_keys: int = 512
    num_chunks: int = 2
    chunk_len: int = 128
    prefix_len: int = 128
    repeats: int = 5


def probe_step(shape: ProbeShape, block_size: int) -> tuple[StepRows, int]:
    """The probe's rows (each request on its own blocks) and the blocks they use."""
    next_block = 0
    greedy = SamplingParams(temperature=0.0)

    def entry(rid: str, start: int, end: int) -> ScheduledSeq:
        nonlocal next_block
        n = -(-end // block_size)
        blocks = list(range(next_block, next_block + n))
        next_block += n
        return ScheduledSeq(rid, [1] * (end - start), start, blocks, greedy, True)

    end = shape.prefix_len + shape.chunk_len
    chunks = [entry(f"c{i}", shape.prefix_len, end) for i in range(shape.num_chunks)]
    decodes = [
        entry(f"d{i}", shape.decode_keys - 1, shape.decode_keys) for i in range(shape.num_decodes)
    ]
    return StepRows.from_seqs(chunks, decodes, block_size), next_block


def probe_layers(spec: AttentionSpec) -> list[int]:
    """The layers the probe runs: the first of each window the layers attend within (layer
    0 alone when every layer has the same)."""
    first: dict[int | None, int] = {}
    for i in range(max(1, len(spec.layer_windows))):
        first.setdefault(spec.window(i), i)
    return sorted(first.values())


def measure_backends(
    candidates: Sequence[AttentionBackend[Any]],
    reference: AttentionBackend[Any],
    shape: ProbeShape | None = None,
) -> dict[str, Measurement]:
    """Each candidate on the probe step against ``reference`` (see the module docstring);
    all bound to the reference's ``AttentionSpec``."""
    shape = shape or ProbeShape()
    spec = reference.spec
    step, num_blocks = probe_step(shape, spec.block_size)
    g = torch.Generator().manual_seed(0)
    num_rows = step.num_rows
    qkv = torch.randn(num_rows, spec.num_heads + 2 * spec.num_kv_heads, spec.head_dim, generator=g)
    qkv = (qkv * 0.5).to(spec.device, spec.dtype)
    layers = probe_layers(spec)
    pool = KVPool(
        layers[-1] + 1, spec.num_kv_heads, spec.head_dim, num_blocks, spec.block_size,
        spec.kv_dtype, spec.device,
    )  # fmt: skip
    pool.data.copy_(torch.randn(pool.data.shape, generator=g).to(spec.kv_dtype))
    device = spec.device

    def layer(backend: AttentionBackend[Any]) -> tuple[torch.Tensor, float]:
        batch = backend.build(step)
        width = spec.num_heads * spec.head_dim
        outs = {i: torch.empty(num_rows, width, dtype=spec.dtype, device=device) for i in layers}

        def call() -> None:
            for i in layers:
                backend.forward(i, qkv, batch, pool, outs[i])

        call()  # warm-up: compiles
        times = []
        for _ in range(shape.repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        out = torch.cat([outs[i] for i in layers], dim=1)
        return out.float(), sorted(times)[len(times) // 2]

    ref, _ = layer(reference)
    tolerance = TOLERANCE.get(spec.kv_dtype, 0.0)
    measured = {}
    for backend in candidates:
        try:
            out, seconds = layer(backend)
        except Exception as e:  # a backend that cannot run here loses, with the reason
            measured[backend.name] = Measurement(float("inf"), tolerance, None, repr(e)[:200])
            continue
        err = (out - ref).abs().max().item() if torch.isfinite(out).all() else float("inf")
        measured[backend.name] = Measurement(err, tolerance, seconds)
    return measured
