"""The attention backend interface, and the step batch the paged backends share.

A backend does two things for the model: ``build_batch`` turns a step's scheduled
sequences into a ``ForwardBatch`` once per step (index tensors every layer shares), and
``forward`` runs one layer's attention over it. The torch backend is today's path
(``model_runner.attention``: gathers into padded tensors, the reference); the paged ones
(Triton, FlashInfer) read K/V in place through ``page_table.build_page_table``.

Rows of a paged batch: the chunks (prefill and draft verification), then the decodes::

    rows: | chunk a | chunk b | ... | dec 0 | dec 1 | ... |
            prefill page table        decode page table (one query per request)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

from model_runner.attention import ForwardBatch, _extend_slots, paged_attention
from model_runner.attention_backends.page_table import (
    PagedMetadata,
    build_page_table,
)
from model_runner.kv_pool import KVPool
from scheduler.output import ScheduledSeq


class AttentionBackend(ABC):
    """One layer's attention over a step, and the step's metadata; chosen once at start-up."""

    name: str = ""

    @classmethod
    def unsupported(cls, kv_dtype: torch.dtype, attention_sinks: int) -> str | None:
        """Why this backend cannot serve a runner so configured, or None (whatever the
        device: asked before the backend is built or its device checked)."""
        return None

    @abstractmethod
    def build_batch(
        self,
        prefill: Sequence[ScheduledSeq],
        decode: Sequence[ScheduledSeq],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sliding_window: int | None = None,
        *,
        attention_sinks: int = 0,
        null_block_id: int | None = None,
        rope_inv_freq: torch.Tensor | None = None,
    ) -> ForwardBatch:
        """The step's batch: ``prefill`` chunks' rows, then one row per ``decode``."""

    @abstractmethod
    def forward(
        self,
        layer: int,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        out: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        """``paged_attention``'s contract: store the step's K/V into the pool, then write the
        attention of every row into ``out`` [T, H * head_dim] (``qkv`` [T, H + 2 kvh, D],
        RoPE applied, Q pre-scaled)."""


class TorchAttention(AttentionBackend):
    """Today's path (``model_runner.attention``), the reference every backend is held to."""

    name = "torch"

    def build_batch(self, *args: Any, **kwargs: Any) -> ForwardBatch:
        """``ForwardBatch.build`` with the interface's arguments: no page tables."""
        return ForwardBatch.build(*args, **kwargs)

    def forward(
        self,
        layer: int,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        out: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        paged_attention(layer, qkv, batch, pool, out, num_heads, num_kv_heads)


class PagedAttentionBackend(AttentionBackend):
    """A backend whose kernels read K/V in place through the CSR page table."""

    @classmethod
    def unsupported(cls, kv_dtype: torch.dtype, attention_sinks: int) -> str | None:
        if kv_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return f"the {cls.name} backend reads float KV pools, not {kv_dtype}"
        if attention_sinks:
            return f"the {cls.name} backend has no attention sinks (use --attention-backend torch)"
        return None

    def build_batch(
        self,
        prefill: Sequence[ScheduledSeq],
        decode: Sequence[ScheduledSeq],
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sliding_window: int | None = None,
        *,
        attention_sinks: int = 0,
        null_block_id: int | None = None,
        rope_inv_freq: torch.Tensor | None = None,
    ) -> ForwardBatch:
        assert not attention_sinks, "rejected at start-up (unsupported)"
        batch = build_paged_batch(
            prefill, decode, block_size, device, sliding_window, null_block_id
        )
        self.plan(batch, sliding_window)
        return batch

    def plan(self, batch: ForwardBatch, sliding_window: int | None) -> None:
        """Per-step work shared by every layer (FlashInfer's ``plan``); none by default."""


def build_paged_batch(
    prefill: Sequence[ScheduledSeq],
    decode: Sequence[ScheduledSeq],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
    null_block_id: int | None = None,
) -> ForwardBatch:
    """A ``ForwardBatch`` with token ids, positions, slots and the two page tables (no
    gathers, no masks: the paged kernels need neither)."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    for seq in (*prefill, *decode):
        input_ids.extend(seq.token_ids)
        positions.extend(range(seq.start_pos, seq.end_pos))
        _extend_slots(slots, seq.block_ids, seq.start_pos, seq.end_pos, block_size)
    n = len(input_ids)
    flat = torch.tensor(input_ids + positions + slots, dtype=torch.int64).to(
        device, non_blocking=True
    )
    prefill_table = decode_table = None
    if prefill:
        prefill_table = build_page_table(prefill, block_size, sliding_window, null_block_id)
    if decode:
        decode_table = build_page_table(decode, block_size, sliding_window, null_block_id)
    paged = PagedMetadata(
        num_prefill_rows=sum(s.num_tokens for s in prefill),
        prefill_table=prefill_table,
        decode_table=decode_table,
        prefill=None if prefill_table is None else prefill_table.to_device(device),
        decode=None if decode_table is None else decode_table.to_device(device),
    )
    return ForwardBatch(
        num_tokens=n,
        input_ids=flat[:n],
        positions=flat[n : 2 * n],
        slot_mapping=flat[2 * n :],
        prefills=[],
        decodes=[],
        max_position=max(positions, default=0),
        paged=paged,
    )
