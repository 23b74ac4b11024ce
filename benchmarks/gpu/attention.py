"""The GPU ``attention`` section's measurement: the Triton paged decode kernel alone, no model.

A decode batch over one layer's pool (random K/V on scattered pages), timed as CUDA-graph
replays over enough page sets that their KV overflows the L2 cache; GB/s of KV read against
the copy bandwidth measured in the same run; each case checked against a torch reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.harness.sizes import AttentionCases
from model_runner.config import ModelConfig


def graph_time_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` (after a warm-up call, which compiles): on a CUDA ``device``
    as a replayed CUDA graph timed with events (no launch gaps), elsewhere by the clock."""
    fn()
    if device.type != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(max(repeats, 10)):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


@dataclass(slots=True)
class DecodeProblem:
    """A decode batch over one layer's pool: ``num_sets`` page tables of ``batch`` requests
    of ``keys`` keys each, on distinct scattered pages (timed one after the other, so their
    KV overflows the L2 cache)."""

    q: torch.Tensor  # [batch, heads, head_dim]
    kv: torch.Tensor  # [2 * kvh, pages, block_size, head_dim]
    out: torch.Tensor
    tables: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # indptr, indices, lens
    kv_bytes: int  # KV one call must read

    def run(self, **kernel_args: int) -> None:
        from model_runner.attention_backends.triton_kernels import paged_decode

        for indptr, indices, lens in self.tables:
            paged_decode(self.q, self.kv, self.out, indptr, indices, lens, **kernel_args)


def decode_problem(
    config: ModelConfig,
    cases: AttentionCases,
    kv: torch.Tensor,
    batch: int,
    keys: int,
    seed: int = 0,
) -> DecodeProblem:
    """``batch`` requests of ``keys`` keys over pool ``kv``, in as many page sets as take
    256 MiB of KV (at most 64, and at most what the pool holds)."""
    device, bs = kv.device, cases.block_size
    dtype_bytes = kv.element_size()
    kv_bytes = batch * keys * 2 * config.num_kv_heads * config.head_dim * dtype_bytes
    pages_per_seq = -(-keys // bs)
    num_pages = kv.shape[1]
    num_sets = max(1, min(64, -(-(256 << 20) // kv_bytes), num_pages // (batch * pages_per_seq)))
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_pages, generator=g).to(torch.int32)
    tables = []
    for i in range(num_sets):
        n = batch * pages_per_seq
        indices = order[i * n : (i + 1) * n]
        indptr = torch.arange(0, n + 1, pages_per_seq, dtype=torch.int32)
        lens = torch.full((batch,), keys, dtype=torch.int32)
        tables.append((indptr.to(device), indices.to(device), lens.to(device)))
    q = torch.randn(batch, config.num_heads, config.head_dim, generator=g) * 0.1
    q = q.to(device, kv.dtype)
    return DecodeProblem(q, kv, torch.empty_like(q), tables, kv_bytes)


def decode_reference(problem: DecodeProblem, rows: int) -> torch.Tensor:
    """The first ``rows`` requests of the last page set (the one ``run`` leaves in ``out``)
    in fp32 torch: gather, softmax, matmul."""
    indptr, indices, lens = problem.tables[-1]
    kvh2, d = problem.kv.shape[0], problem.kv.shape[3]
    kvh = kvh2 // 2
    outs = []
    for i in range(rows):
        pages = indices[int(indptr[i]) : int(indptr[i + 1])].long()
        kv = problem.kv[:, pages].reshape(kvh2, -1, d)[:, : int(lens[i])].float()
        q = problem.q[i].float().view(kvh, -1, d)
        probs = torch.softmax(q @ kv[:kvh].transpose(1, 2), dim=-1)
        outs.append((probs @ kv[kvh:]).reshape(-1, d))
    return torch.stack(outs)


def measure_attention(
    config: ModelConfig,
    cases: AttentionCases,
    device: torch.device,
    bandwidth: float,
    on_row: Callable[[dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """The ``attention`` section's rows (each handed to ``on_row`` as measured): every
    (batch, keys) at the default configuration, then the sweep's configurations."""
    shapes = [(b, k) for k in cases.keys for b in cases.batches]
    max_pages = max(b * -(-k // cases.block_size) for b, k in shapes)
    shape = (2 * config.num_kv_heads, max_pages, cases.block_size, config.head_dim)
    torch.manual_seed(0)
    dtype = getattr(torch, cases.dtype)
    kv = torch.randn(shape, device=device, dtype=dtype)  # random: never time on zeros
    default = {"block_n": None, "num_warps": None, "num_stages": None}
    runs = [(b, k, default) for b, k in shapes]
    for b, k in cases.sweep:
        for block_n, warps, stages in cases.configs:
            runs.append((b, k, {"block_n": block_n, "num_warps": warps, "num_stages": stages}))
    rows: list[dict[str, Any]] = []
    for batch, keys, cfg in runs:
        args = {name: value for name, value in cfg.items() if value is not None}
        row: dict[str, Any] = {
            "batch": batch,
            "keys": keys,
            "config": "{block_n}/{num_warps}/{num_stages}".format(**args) if args else "default",
        }
        try:
            problem = decode_problem(config, cases, kv, batch, keys)
            seconds = graph_time_s(lambda p=problem, a=args: p.run(**a), device, cases.repeats)
            seconds /= len(problem.tables)
            n = min(batch, 8)
            problem.run(**args)
            err = problem.out[:n].float().flatten(1) - decode_reference(problem, n).flatten(1)
        except Exception as e:  # a configuration that does not compile here (shared memory)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        else:
            row |= {
                "us": seconds * 1e6,
                "gb_s": problem.kv_bytes / seconds / 1e9,
                "of_copy_bandwidth": problem.kv_bytes / seconds / bandwidth,
                "max_abs_err": err.abs().max().item(),
            }
        rows.append(row)
        on_row(row)
    return rows
