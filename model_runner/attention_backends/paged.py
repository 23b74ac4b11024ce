"""What the paged backends (Triton, FlashInfer) share: a step's batch is its row tensors and
two page tables (``page_table``), no gathers and no masks: their kernels read K/V in place.

Rows of a paged batch: the chunks (prefill and draft verification), then the decodes::

    rows: | chunk a | chunk b | ... | dec 0 | dec 1 | ... |
            prefill page table        decode page table (one query per request)
"""

from __future__ import annotations

from model_runner.attention_backends.base import (
    FLOAT_DTYPES,
    AttentionBackend,
    ForwardBatch,
    row_tensors,
)
from model_runner.attention_backends.page_table import PagedMetadata, build_page_table
from model_runner.step import StepRows


class PagedAttentionBackend(AttentionBackend[PagedMetadata]):
    """A backend whose kernels read K/V in place through the CSR page table."""

    kv_dtypes = FLOAT_DTYPES

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
