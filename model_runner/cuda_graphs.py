"""CUDA graphs for decode steps: one captured forward pass per batch size, replayed.

A decode step of a bf16 8B model on an H100 launches ~10 kernels per layer; at batch 1 the
launches, not the weights, would bound the step. So decode steps (no prefill rows) replay a
graph captured for the next size up, with the inputs padded (``PaddedDecode``). The sizes are
sized to the server: ``capture_sizes`` keeps those of ``GRAPH_BATCH_SIZES`` below the most
rows a decode step can hold (``max_num_seqs``, times 1 + k with k drafts each) and that
number itself. A decode with drafts is k + 1 rows, each a one-token decode over its
request's table (every row's K/V is written before any row attends, and each attends up to
its own position).

A graph bakes in every tensor address, so its inputs live in static tensors. The attention
backend makes them (``graph_batch``: the rows and its own metadata, with a fixed capacity of
``max_pages_per_seq`` pages a row) and rewrites them before every replay (``fill``); this
module knows no backend's metadata. The Triton decode kernel's grid is the batch size, and
the key loop bound is read from ``kv_lens`` on the device, so one graph serves any contexts.

Memory: graphs share one memory pool, captured largest first, so the pool holds about one
step's activations at the largest captured size. ``graph_memory_bytes`` estimates it, and
the runner takes it out of the KV budget BEFORE sizing the pool (the graphs are captured
after, since they read the pool). Everything here but ``DecodeGraphs`` (the sizes, the
bucket a step takes, the memory estimate) is pure and tested on CPU; the backends'
``graph_batch`` and ``fill`` are tested on CPU against their eager batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_runner.attention_backends.base import PaddedDecode
from model_runner.config import ModelConfig
from model_runner.kv_pool import KVPool
from model_runner.model import LlamaModel
from model_runner.step import StepRows

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_batch_size(num_rows: int, sizes: Sequence[int] = GRAPH_BATCH_SIZES) -> int | None:
    """The smallest of ``sizes`` (ascending) holding ``num_rows`` decode rows; None above
    the largest (the step then runs eagerly)."""
    if num_rows < 1:
        raise ValueError(f"a decode step has at least one row, got {num_rows}")
    for size in sizes:
        if size >= num_rows:
            return size
    return None


def capture_sizes(max_rows: int, sizes: Sequence[int] = GRAPH_BATCH_SIZES) -> tuple[int, ...]:
    """The sizes worth capturing when a decode step holds at most ``max_rows`` rows: those
    of ``sizes`` below it, then ``max_rows`` itself (no graph pads past the largest step);
    every size when ``max_rows`` is above the largest."""
    if max_rows < 1:
        raise ValueError(f"a decode step holds at least one row, got {max_rows}")
    if max_rows > sizes[-1]:
        return tuple(sizes)
    return (*(s for s in sizes if s < max_rows), max_rows)


def graph_bucket(step: StepRows, sizes: Sequence[int]) -> int | None:
    """The captured size ``step`` replays: the smallest that holds its rows when every row
    is a decode's (drafts and constrained decodes included); None for a step with prefill
    rows or more rows than the largest size (it runs eagerly)."""
    if step.prefill or step.is_empty:
        return None
    return graph_batch_size(step.num_rows, sizes)


def graph_memory_bytes(config: ModelConfig, max_batch: int, dtype_bytes: int) -> int:
    """An upper estimate of the graph pool: twice one layer's activations at ``max_batch``
    rows (hidden and residual, QKV, attention output, gate+up, the MLP product: the
    allocator reuses a layer's buffers in the next), plus the static inputs."""
    h, d = config.num_heads, config.head_dim
    per_row = (
        3 * config.hidden_size
        + (h + 2 * config.num_kv_heads) * d
        + h * d
        + 3 * config.intermediate_size
    )
    activations = 2 * max_batch * per_row * dtype_bytes
    static = max_batch * (3 * 8 + 3 * 4)  # ids, positions, slots (int64); the page table
    return activations + static


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [batch_size, hidden], the captured output


class DecodeGraphs:
    """Decode steps captured as CUDA graphs of ``model`` over ``pool`` (CUDA only), on the
    batches ``model.attention`` makes for them (a backend with ``graphs``); the pool must
    hold the scratch slot ``scratch_slot``, which padding rows write."""

    def __init__(
        self,
        model: LlamaModel,
        pool: KVPool,
        *,
        max_model_len: int,
        scratch_slot: int,
        sizes: Sequence[int],
    ) -> None:
        if pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {pool.device}")
        if not model.attention.graphs:
            raise ValueError(f"the {model.attention.name} attention backend has no CUDA graphs")
        self.model = model
        self.pool = pool
        self.max_pages_per_seq = -(-max_model_len // pool.block_size)
        self.scratch_slot = scratch_slot
        self.sizes = tuple(sorted(sizes))
        self._graphs: dict[int, _Graph] = {}

    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool."""
        mempool = torch.cuda.graph_pool_handle()
        for size in sorted(self.sizes, reverse=True):
            self._graphs[size] = self._capture(size, mempool)
        torch.cuda.synchronize(self.pool.device)

    def _capture(self, size: int, mempool: object) -> _Graph:
        device, attention = self.pool.device, self.model.attention
        batch = attention.graph_batch(size, self.max_pages_per_seq)
        # Every row padding while capturing: the warm-up writes only the scratch slot.
        no_rows = StepRows.from_seqs((), (), self.pool.block_size)
        attention.fill(PaddedDecode(no_rows, size, self.scratch_slot))
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
            self.model.forward(batch, self.pool)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            hidden = self.model.forward(batch, self.pool)
        return _Graph(graph, hidden)

    def run(self, step: StepRows) -> torch.Tensor:
        """Replay the graph of the next captured size up (``graph_bucket``): hidden states
        of ``step``'s rows."""
        size = graph_bucket(step, self.sizes)
        if size is None:
            raise ValueError(f"no captured graph holds this step ({step.num_rows} rows)")
        self.model.attention.fill(PaddedDecode(step, size, self.scratch_slot))
        entry = self._graphs[size]
        entry.graph.replay()
        return entry.hidden[: step.num_rows]
