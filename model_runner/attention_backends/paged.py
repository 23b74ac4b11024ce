"""What the paged backends (Triton, FlashInfer) share: a step's batch is its row tensors and
two page tables (``page_table``), no gathers and no masks: their kernels read K/V in place.

Rows of a paged batch: the chunks (prefill and draft verification), then the decodes::

    rows: | chunk a | chunk b | ... | dec 0 | dec 1 | ... |
            prefill page table        decode page table (one query per request)

A decode graph's batch (``graph_batch``) is a decode page table alone, in static tensors of a
fixed capacity (``max_pages`` per row); ``fill`` writes a step's rows and pages into them with
one host-to-device copy per dtype (``graph_page_table`` says what).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_runner.attention_backends.base import (
    FLOAT_DTYPES,
    AttentionBackend,
    AttentionSpec,
    ForwardBatch,
    PaddedDecode,
    row_tensors,
)
from model_runner.attention_backends.page_table import (
    PagedMetadata,
    PageTableTensors,
    build_page_table,
)
from model_runner.step import StepRows


@dataclass(frozen=True, slots=True)
class _GraphInputs:
    """The static tensors of one graph batch."""

    ints64: torch.Tensor  # input ids | positions | slots
    ints32: torch.Tensor  # kv_indptr | kv_lens | kv_indices
    max_pages: int


class PagedAttentionBackend(AttentionBackend[PagedMetadata]):
    """A backend whose kernels read K/V in place through the CSR page table."""

    kv_dtypes = FLOAT_DTYPES

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        self._graph_inputs: dict[int, _GraphInputs] = {}

    def build(self, step: StepRows) -> ForwardBatch[PagedMetadata]:
        """Row tensors and the two page tables of ``step``, then ``plan``."""
        spec = self.spec
        bs, window, null = spec.block_size, spec.sliding_window, step.null_block_id
        chunks, decodes = step.chunks, step.plain_decodes
        prefill_table = build_page_table(chunks, bs, window, null) if chunks else None
        decode_table = build_page_table(decodes, bs, window, null) if decodes else None
        ids, positions, slots, _ = row_tensors(step, spec.device)
        meta = PagedMetadata(
            num_prefill_rows=sum(s.num_tokens for s in chunks),
            prefill_table=prefill_table,
            decode_table=decode_table,
            prefill=None if prefill_table is None else prefill_table.to_device(spec.device),
            decode=None if decode_table is None else decode_table.to_device(spec.device),
        )
        self.plan(meta)
        return ForwardBatch(step.num_rows, ids, positions, slots, step.max_position, meta)

    def plan(self, meta: PagedMetadata) -> None:
        """Per-step work shared by every layer (FlashInfer's ``plan``); none by default."""

    def graph_batch(self, size: int, max_pages: int) -> ForwardBatch[PagedMetadata]:
        """``size`` one-query rows over a decode page table of ``max_pages`` pages a row, in
        static tensors (``kv_last_page_len`` is not read by a kernel that graphs)."""
        if not self.graphs:
            return super().graph_batch(size, max_pages)
        device = self.spec.device
        ints64 = torch.zeros(3 * size, dtype=torch.int64, device=device)
        ints32 = torch.zeros(2 * size + 1 + size * max_pages, dtype=torch.int32, device=device)
        self._graph_inputs[size] = _GraphInputs(ints64, ints32, max_pages)
        table = PageTableTensors(
            qo_indptr=torch.arange(size + 1, dtype=torch.int32, device=device),
            kv_indptr=ints32[: size + 1],
            kv_last_page_len=torch.zeros(size, dtype=torch.int32, device=device),
            kv_lens=ints32[size + 1 : 2 * size + 1],
            kv_indices=ints32[2 * size + 1 :],
            max_qo_len=1,
            max_kv_len=max_pages * self.spec.block_size,
        )
        meta = PagedMetadata(
            num_prefill_rows=0, prefill_table=None, decode_table=None, prefill=None, decode=table
        )
        return ForwardBatch(
            num_tokens=size,
            input_ids=ints64[:size],
            positions=ints64[size : 2 * size],
            slot_mapping=ints64[2 * size :],
            max_position=0,
            metadata=meta,
        )

    def fill(self, padded: PaddedDecode) -> None:
        if not self.graphs:
            return super().fill(padded)
        inputs = self._graph_inputs[padded.batch_size]
        table = graph_page_table(padded, inputs.max_pages, self.spec.sliding_window)
        _copy_in(inputs.ints64, padded.row_ids())
        _copy_in(inputs.ints32, table)


def graph_page_table(
    padded: PaddedDecode, max_pages: int, sliding_window: int | None = None
) -> list[int]:
    """``kv_indptr | kv_lens | kv_indices`` of ``padded``'s rows: one page-table entry per
    row (``StepRows.one_row_decodes``), empty slots for the padding, and the page list
    padded with 0 to ``batch_size * max_pages`` entries."""
    step = padded.step
    rows = step.one_row_decodes()
    table = build_page_table(rows, step.block_size, sliding_window, step.null_block_id)
    table = table.padded(padded.batch_size)
    indices = table.kv_indices + [0] * (padded.batch_size * max_pages - len(table.kv_indices))
    return table.kv_indptr + table.kv_lens + indices


def _copy_in(dst: torch.Tensor, values: list[int]) -> None:
    """``values`` into ``dst`` in place: one host-to-device copy, from pinned memory on CUDA."""
    host = torch.tensor(values, dtype=dst.dtype)
    if dst.is_cuda:
        host = host.pin_memory()
    dst.copy_(host, non_blocking=True)
