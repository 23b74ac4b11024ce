"""Block tables -> the CSR page table the paged kernels read (Triton and FlashInfer alike).

This is the ONE place that turns a step's ``ScheduledSeq`` block tables into page lists.
Request i owns query rows ``qo_indptr[i] : qo_indptr[i + 1]`` of the flat batch and pages
``kv_indices[kv_indptr[i] : kv_indptr[i + 1]]``, the last of them holding
``kv_last_page_len[i]`` keys (FlashInfer's names and convention)::

    block table   [ b0 | b1 | b2 | b3 | b4 ]          block_size 4, end_pos 18, window 8
    visible keys             10 ........ 17             (p - 8 < k <= p for p = 17)
    pages                    [ b2 | b3 | b4 ]           first page: first_key_block()
    key positions             8..11 12..15 16,17        kv_start_pos = 8, last_page_len = 2

A request's keys run ``kv_start_pos .. end_pos - 1`` (``kv_len`` of them) and its queries
are the LAST ``qo_len`` of those positions, so a kernel never needs absolute positions:
query j of request i sits at relative position ``kv_len - qo_len + j`` and sees relative keys
``k <= q`` (and ``k > q - window``). Pages before the window, and pages the adaptive KV
strategy released to the null block, are never listed, so they are never read. A decode is
a request with ``qo_len = 1``; a chunk over a cached prefix is one with ``kv_len > qo_len``.

Plain ``list[int]`` here (exactly testable, and what FlashInfer's ``plan`` wants on the
host); ``to_device`` makes the int32 tensors the kernels index with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_runner.block_table import first_key_block
from scheduler.output import ScheduledSeq


@dataclass(slots=True)
class PageTable:
    """The page table of one step's requests, rows in batch order (see the module docstring)."""

    block_size: int
    qo_indptr: list[int]  # [n + 1] query rows
    kv_indptr: list[int]  # [n + 1] pages
    kv_indices: list[int]  # [kv_indptr[-1]] block ids
    kv_last_page_len: list[int]  # [n] keys in the last page, 1 .. block_size
    kv_start_pos: list[int]  # [n] absolute position of the first listed key

    @property
    def num_seqs(self) -> int:
        return len(self.kv_last_page_len)

    @property
    def kv_lens(self) -> list[int]:
        """Keys per request: full pages plus the last page's keys (0 for an empty slot)."""
        bs = self.block_size
        return [
            max(0, (self.kv_indptr[i + 1] - self.kv_indptr[i] - 1) * bs + last)
            for i, last in enumerate(self.kv_last_page_len)
        ]

    def padded(self, num_seqs: int) -> PageTable:
        """This table with empty slots appended up to ``num_seqs`` requests (no queries, no
        pages, ``last_page_len`` 0): the padding rows of a CUDA graph's fixed batch size."""
        pad = num_seqs - self.num_seqs
        if pad < 0:
            raise ValueError(f"cannot pad {self.num_seqs} requests down to {num_seqs}")
        return PageTable(
            self.block_size,
            self.qo_indptr + [self.qo_indptr[-1]] * pad,
            self.kv_indptr + [self.kv_indptr[-1]] * pad,
            list(self.kv_indices),
            self.kv_last_page_len + [0] * pad,
            self.kv_start_pos + [0] * pad,
        )

    @property
    def qo_lens(self) -> list[int]:
        return [b - a for a, b in zip(self.qo_indptr, self.qo_indptr[1:], strict=False)]

    def to_device(self, device: torch.device) -> PageTableTensors:
        """int32 tensors of the table on ``device``, in one host-to-device copy."""
        n = self.num_seqs
        flat = torch.tensor(
            self.qo_indptr + self.kv_indptr + self.kv_last_page_len + self.kv_lens
            + self.kv_indices,
            dtype=torch.int32,
        ).to(device, non_blocking=True)  # fmt: skip
        a = n + 1
        return PageTableTensors(
            qo_indptr=flat[:a],
            kv_indptr=flat[a : 2 * a],
            kv_last_page_len=flat[2 * a : 2 * a + n],
            kv_lens=flat[2 * a + n : 2 * a + 2 * n],
            kv_indices=flat[2 * a + 2 * n :],
            max_qo_len=max(self.qo_lens, default=0),
            max_kv_len=max(self.kv_lens, default=0),
        )


@dataclass(slots=True)
class PageTableTensors:
    """``PageTable`` as int32 device tensors, plus the host-side maxima kernels size grids by."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    kv_indices: torch.Tensor
    max_qo_len: int
    max_kv_len: int


def build_page_table(
    seqs: Sequence[ScheduledSeq],
    block_size: int,
    sliding_window: int | None = None,
    null_block_id: int | None = None,
    attention_sinks: int = 0,
) -> PageTable:
    """The page table of ``seqs`` (each computing ``start_pos .. end_pos - 1``): pages from the
    first block holding a key the chunk's FIRST query sees, through the block of ``end_pos - 1``.
    Later queries of a chunk see fewer of those keys; the window mask drops the rest.

    With ``attention_sinks`` S (needs a window) the sink blocks come first, then the window's
    (``| sinks | window |``, as the torch path gathers them), or one run from block 0 while
    the window still reaches them; the first S listed keys are then positions 0 .. S - 1.
    Relative positions past the sink blocks shift by the gap, the same for keys and queries,
    so the window mask still holds and hides the sink blocks' keys past S."""
    num_sink_blocks = -(-attention_sinks // block_size)
    qo_indptr = [0]
    kv_indptr = [0]
    kv_indices: list[int] = []
    last_page_len: list[int] = []
    kv_start_pos: list[int] = []
    for seq in seqs:
        start, end = seq.start_pos, seq.end_pos
        first = first_key_block(
            seq.block_ids, start, block_size, sliding_window, num_sink_blocks, null_block_id
        )
        last = (end - 1) // block_size
        if num_sink_blocks and first <= num_sink_blocks:
            first = 0  # no gap yet: the sinks and the window are one run from 0
        elif num_sink_blocks:
            kv_indices.extend(seq.block_ids[:num_sink_blocks])
        kv_indices.extend(seq.block_ids[first : last + 1])
        qo_indptr.append(qo_indptr[-1] + end - start)
        kv_indptr.append(len(kv_indices))
        last_page_len.append(end - last * block_size)
        kv_start_pos.append(0 if num_sink_blocks else first * block_size)
    return PageTable(block_size, qo_indptr, kv_indptr, kv_indices, last_page_len, kv_start_pos)


def sink_rotation(
    seqs: Sequence[ScheduledSeq],
    sliding_window: int,
    attention_sinks: int,
    rope_inv_freq: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row of ``seqs`` (in order), fp32 ``cos, sin`` ``[rows, D/2]`` of ``-d * inv_freq``
    with ``d = max(0, p - W + 1 - S)`` (``torch_backend``'s gap): the rotation that
    scores the sink keys with the query at its cache position (identity while d is 0)."""
    positions = torch.tensor(
        [p for s in seqs for p in range(s.start_pos, s.end_pos)], dtype=torch.float64
    )
    gap = (positions - (sliding_window - 1 + attention_sinks)).clamp_(min=0)
    angles = -gap.unsqueeze(1) * rope_inv_freq.double().cpu().unsqueeze(0)
    return angles.cos().float(), angles.sin().float()


@dataclass(slots=True)
class PagedMetadata:
    """The page tables of one step: host lists (FlashInfer plans from them) and device
    tensors (the kernels read them). ``None`` where the step has no rows of that kind."""

    num_prefill_rows: int
    prefill_table: PageTable | None
    decode_table: PageTable | None
    prefill: PageTableTensors | None
    decode: PageTableTensors | None
