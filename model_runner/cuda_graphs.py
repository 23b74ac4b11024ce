"""CUDA graphs for decode steps: one captured forward pass per batch size, replayed.

A decode step of a bf16 8B model on an H100 launches ~10 kernels per layer; at batch 1 the
launches, not the weights, would bound the step. So decode steps (no prefill rows) replay a
graph captured for the next size up, with the inputs padded. The sizes are sized to the
server: ``capture_sizes`` keeps those of ``GRAPH_BATCH_SIZES`` below the most rows a decode
step can hold (``max_num_seqs``, times 1 + k with k drafts each) and that number itself. A
decode with drafts is k + 1 rows, each a one-token decode over its request's table (every
row's K/V is written before any row attends, and each attends up to its own position)::

    rows     | dec 0 | dec 1 | dec 2 | pad | pad | pad | pad | pad |     3 decodes -> graph 8
    token    |  t0   |  t1   |  t2   |  0  ...
    slot     |  s0   |  s1   |  s2   | scratch slot (a block the cache manager never lends)
    kv len   |  n0   |  n1   |  n2   |  0  ...  (an empty slot: the kernel writes zeros)

A graph bakes in every tensor address, so the inputs live in static buffers (one host ->
device copy per step fills them) and the page table has a fixed capacity
(``max_pages_per_seq`` per row). The Triton decode kernel's grid is the batch size, and the
key loop bound is read from ``kv_lens`` on the device, so one graph serves any contexts.

Memory: graphs share one memory pool, captured largest first, so the pool holds about one
step's activations at the largest captured size. ``graph_memory_bytes`` estimates it, and
the runner takes it out of the KV budget BEFORE sizing the pool (the graphs are captured
after, since they read the pool). Everything here but ``DecodeGraphs`` (the sizes, the
bucket a step takes, the padding) is pure and tested on CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_runner.attention_backends.base import ForwardBatch
from model_runner.attention_backends.page_table import (
    PagedMetadata,
    PageTableTensors,
    build_page_table,
)
from model_runner.config import ModelConfig
from model_runner.kv_pool import KVPool
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
class PaddedDecode:
    """A decode step's inputs padded to a graph's batch size (host lists, see the module
    docstring); ``kv_indices`` has ``batch_size * max_pages_per_seq`` entries."""

    batch_size: int
    num_rows: int  # the real rows, before the padding
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_lens: list[int]


def pad_decode(
    step: StepRows,
    batch_size: int,
    max_pages_per_seq: int,
    scratch_slot: int,
    sliding_window: int | None = None,
) -> PaddedDecode:
    """The rows of decode step ``step`` as the inputs of the graph of ``batch_size``: one
    page table entry per row (``StepRows.one_row_decodes``), then the padding rows."""
    if step.prefill:
        raise ValueError("a step with prefill rows has no graph")
    num_rows = step.num_rows
    num_pad = batch_size - num_rows
    if num_pad < 0:
        raise ValueError(f"{num_rows} decode rows do not fit a graph of {batch_size}")
    rows = step.one_row_decodes()
    table = build_page_table(rows, step.block_size, sliding_window, step.null_block_id)
    table = table.padded(batch_size)
    indices = table.kv_indices + [0] * (batch_size * max_pages_per_seq - len(table.kv_indices))
    return PaddedDecode(
        batch_size=batch_size,
        num_rows=num_rows,
        input_ids=step.token_ids + [0] * num_pad,
        positions=step.positions + [0] * num_pad,
        slot_mapping=step.slot_mapping + [scratch_slot] * num_pad,
        kv_indptr=table.kv_indptr,
        kv_indices=indices,
        kv_lens=table.kv_lens,
    )


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    ints64: torch.Tensor  # ids | positions | slots
    ints32: torch.Tensor  # kv_indptr | kv_lens | kv_indices
    hidden: torch.Tensor  # [batch_size, hidden], the captured output


class DecodeGraphs:
    """Decode steps captured as CUDA graphs on ``model`` over ``pool`` (CUDA only).

    The model's attention must read its decode page table from the batch's metadata
    alone (a backend with ``graphs``); the pool must hold the scratch slot ``scratch_slot``."""

    def __init__(
        self,
        model: object,
        pool: KVPool,
        *,
        block_size: int,
        max_model_len: int,
        scratch_slot: int,
        sizes: Sequence[int],
    ) -> None:
        if pool.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {pool.device}")
        self.model = model
        self.pool = pool
        self.block_size = block_size
        self.max_pages_per_seq = -(-max_model_len // block_size)
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
        device = self.pool.device
        ints64 = torch.zeros(3 * size, dtype=torch.int64, device=device)
        ints64[2 * size :] = self.scratch_slot
        ints32 = torch.zeros(2 * size + 1 + size * self.max_pages_per_seq, dtype=torch.int32)
        ints32 = ints32.to(device)
        table = PageTableTensors(
            qo_indptr=torch.arange(size + 1, dtype=torch.int32, device=device),
            kv_indptr=ints32[: size + 1],
            kv_last_page_len=torch.zeros(size, dtype=torch.int32, device=device),  # unread
            kv_lens=ints32[size + 1 : 2 * size + 1],
            kv_indices=ints32[2 * size + 1 :],
            max_qo_len=1,
            max_kv_len=self.max_pages_per_seq * self.block_size,
        )
        batch = ForwardBatch(
            num_tokens=size,
            input_ids=ints64[:size],
            positions=ints64[size : 2 * size],
            slot_mapping=ints64[2 * size :],
            max_position=0,
            metadata=PagedMetadata(0, None, None, None, table),
        )
        forward = self.model.forward  # type: ignore[attr-defined]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
            forward(batch, self.pool)
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            hidden = forward(batch, self.pool)
        return _Graph(graph, ints64, ints32, hidden)

    def run(self, padded: PaddedDecode) -> torch.Tensor:
        """Replay the graph of ``padded.batch_size``; hidden states of the real rows."""
        entry = self._graphs[padded.batch_size]
        host64 = torch.tensor(
            padded.input_ids + padded.positions + padded.slot_mapping, dtype=torch.int64
        )
        host32 = torch.tensor(
            padded.kv_indptr + padded.kv_lens + padded.kv_indices, dtype=torch.int32
        )
        entry.ints64.copy_(host64.pin_memory(), non_blocking=True)
        entry.ints32.copy_(host32.pin_memory(), non_blocking=True)
        entry.graph.replay()
        return entry.hidden[: padded.num_rows]
