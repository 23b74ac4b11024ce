"""LoRA on CUDA: the segmented grouped products in Triton (Punica's SGMV and BGMV, as vLLM
and SGLang run them), one launch per target and kind for every adapter of a step.

    shrink   t[rows, :R]           = x[rows] @ A[slot]^T             (R: the padded rank)
    expand   y[rows, col0 : col0+N] += scale[rows] * t[rows] @ Bt[slot]

- **SGMV** for prefill chunks: a *segment* is a chunk's consecutive rows, all of one adapter;
  a program takes ``BLOCK_M`` rows of one segment and both products run in ``tl.dot``
  (tensor cores), fp32 accumulation.
- **BGMV** for decode rows (a decode's draft rows too): one program per row (and output
  tile): a vector product, no tile of rows to fill.

Which kind a row takes depends on its seq (a chunk's row or a decode's), never on its
neighbours, so a row's numbers do not depend on what else the step holds.

The weights of the step's adapters come stacked per layer and target (``[S, R, K]`` and
``[S, R, N]``, zero-padded to the step's largest rank, ``R`` at least 16 for ``tl.dot``).
``TRITON_INTERPRET=1`` runs the kernels on CPU (the tests, ``tests/conftest.py``).

A launch takes its grid from host ints the step planned (``LoraStep``: the segments and
the longest one), never from a device tensor: reading one back would make the host wait
for the device in the middle of a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_RANK = 16  # tl.dot's smallest dimension: ranks are padded to it
BLOCK_M = 16
BLOCK_K = 64
BLOCK_N = 64


def padded_rank(rank: int) -> int:
    return max(MIN_RANK, triton.next_power_of_2(rank))


@triton.jit
def _sgmv_shrink_kernel(
    x_ptr, a_ptr, t_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    K, R, stride_xm, stride_as, stride_ar, stride_tm,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    mblock = tl.program_id(1)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        x = tl.load(
            x_ptr + (start + rows)[:, None] * stride_xm + (k0 + kk)[None, :],
            mask=row_ok[:, None] & k_ok[None, :], other=0.0,
        )  # fmt: skip
        a = tl.load(
            a_ptr + slot * stride_as + r[None, :] * stride_ar + (k0 + kk)[:, None],
            mask=(r < R)[None, :] & k_ok[:, None], other=0.0,
        )  # fmt: skip
        acc += tl.dot(x.to(a.dtype), a)
    tl.store(
        t_ptr + (start + rows)[:, None] * stride_tm + r[None, :],
        acc, mask=row_ok[:, None] & (r < R)[None, :],
    )  # fmt: skip


@triton.jit
def _sgmv_expand_kernel(
    t_ptr, bt_ptr, y_ptr, scale_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
    N, R, col0, stride_tm, stride_bs, stride_br, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seg = tl.program_id(0)
    mblock = tl.program_id(1)
    nblock = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_len_ptr + seg)
    slot = tl.load(seg_slot_ptr + seg)
    rows = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < length
    r = tl.arange(0, BLOCK_R)
    cols = nblock * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    t = tl.load(
        t_ptr + (start + rows)[:, None] * stride_tm + r[None, :],
        mask=row_ok[:, None] & (r < R)[None, :], other=0.0,
    )  # fmt: skip
    b = tl.load(
        bt_ptr + slot * stride_bs + r[:, None] * stride_br + cols[None, :],
        mask=(r < R)[:, None] & col_ok[None, :], other=0.0,
    )  # fmt: skip
    acc = tl.dot(t.to(b.dtype), b)
    scale = tl.load(scale_ptr + start + rows, mask=row_ok, other=0.0)
    out = y_ptr + (start + rows)[:, None] * stride_ym + col0 + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    y = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc * scale[:, None]).to(y.dtype), mask=mask)


@triton.jit
def _bgmv_shrink_kernel(
    x_ptr, a_ptr, t_ptr, row_ptr, slot_ptr,
    K, R, stride_xm, stride_as, stride_ar, stride_tm,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    row = tl.load(row_ptr + i)
    slot = tl.load(slot_ptr + i)
    r = tl.arange(0, BLOCK_R)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + kk) < K
        x = tl.load(x_ptr + row * stride_xm + k0 + kk, mask=k_ok, other=0.0).to(tl.float32)
        a = tl.load(
            a_ptr + slot * stride_as + r[:, None] * stride_ar + (k0 + kk)[None, :],
            mask=(r < R)[:, None] & k_ok[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(t_ptr + row * stride_tm + r, acc, mask=r < R)


@triton.jit
def _bgmv_expand_kernel(
    t_ptr, bt_ptr, y_ptr, scale_ptr, row_ptr, slot_ptr,
    N, R, col0, stride_tm, stride_bs, stride_br, stride_ym,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    nblock = tl.program_id(1)
    row = tl.load(row_ptr + i)
    slot = tl.load(slot_ptr + i)
    r = tl.arange(0, BLOCK_R)
    cols = nblock * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    t = tl.load(t_ptr + row * stride_tm + r, mask=r < R, other=0.0)
    b = tl.load(
        bt_ptr + slot * stride_bs + r[:, None] * stride_br + cols[None, :],
        mask=(r < R)[:, None] & col_ok[None, :], other=0.0,
    ).to(tl.float32)  # fmt: skip
    acc = tl.sum(t[:, None] * b, axis=0)
    scale = tl.load(scale_ptr + row)
    out = y_ptr + row * stride_ym + col0 + cols
    y = tl.load(out, mask=col_ok, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc * scale).to(y.dtype), mask=col_ok)


def sgmv_shrink(
    x: torch.Tensor, a: torch.Tensor, t: torch.Tensor, segments: torch.Tensor, longest: int
) -> None:
    """``t[rows] = x[rows] @ a[slot]^T`` for each segment: ``segments`` [3, G] int32, its
    rows the segments' first rows, lengths and slots; ``longest`` the most rows of one, a
    host int (the grid: the launch never reads the device); ``a`` [S, R, K], ``t`` fp32
    [T, R]."""
    num_segments = segments.shape[1]
    if not num_segments:
        return
    _, rank, k = a.shape
    grid = (num_segments, triton.cdiv(longest, BLOCK_M))
    _sgmv_shrink_kernel[grid](
        x, a, t, segments[0], segments[1], segments[2], k, rank, x.stride(0), a.stride(0),
        a.stride(1), t.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=padded_rank(rank), BLOCK_K=BLOCK_K,
    )  # fmt: skip


def sgmv_expand(
    t: torch.Tensor,
    bt: torch.Tensor,
    y: torch.Tensor,
    scale: torch.Tensor,
    segments: torch.Tensor,
    longest: int,
    col0: int = 0,
) -> None:
    """``y[rows, col0 : col0 + N] += scale[rows] * t[rows] @ bt[slot]`` per segment (as
    ``sgmv_shrink`` takes them)."""
    num_segments = segments.shape[1]
    if not num_segments:
        return
    _, rank, n = bt.shape
    grid = (num_segments, triton.cdiv(longest, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _sgmv_expand_kernel[grid](
        t, bt, y, scale, segments[0], segments[1], segments[2], n, rank, col0, t.stride(0),
        bt.stride(0), bt.stride(1), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=padded_rank(rank),
        BLOCK_N=BLOCK_N,
    )  # fmt: skip


def bgmv_shrink(
    x: torch.Tensor, a: torch.Tensor, t: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor
) -> None:
    """``t[row] = x[row] @ a[slot]^T`` for each decode row and its adapter's slot."""
    if not rows.shape[0]:
        return
    _, rank, k = a.shape
    _bgmv_shrink_kernel[(rows.shape[0],)](
        x, a, t, rows, slots, k, rank, x.stride(0), a.stride(0), a.stride(1), t.stride(0),
        BLOCK_R=padded_rank(rank), BLOCK_K=BLOCK_K,
    )  # fmt: skip


def bgmv_expand(
    t: torch.Tensor,
    bt: torch.Tensor,
    y: torch.Tensor,
    scale: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    col0: int = 0,
) -> None:
    """``y[row, col0 : col0 + N] += scale[row] * t[row] @ bt[slot]`` for each decode row."""
    if not rows.shape[0]:
        return
    _, rank, n = bt.shape
    grid = (rows.shape[0], triton.cdiv(n, BLOCK_N))
    _bgmv_expand_kernel[grid](
        t, bt, y, scale, rows, slots, n, rank, col0, t.stride(0), bt.stride(0), bt.stride(1),
        y.stride(0), BLOCK_R=padded_rank(rank), BLOCK_N=BLOCK_N,
    )  # fmt: skip
