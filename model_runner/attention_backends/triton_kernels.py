"""Paged attention in Triton: K/V read in place from the pool through the page table.

Imported only by the ``triton`` backend (and its tests), after ``TRITON_INTERPRET`` is
settled: Triton reads it when a kernel is decorated. Two kernels, one contract
(``page_table``'s relative positions: query j of request i at ``kv_len - qo_len + j``):

- ``paged_prefill``: ragged query tiles (chunks over a cached prefix, fresh prompts, draft
  verification), grid ``(query tiles, requests, heads)``, online softmax over key tiles of
  ``BLOCK_N`` tokens; a key tile may span pages (each key finds its page through
  ``kv_indices``), so ``BLOCK_N`` does not depend on ``block_size``.
- ``paged_decode``: one query per request, grid ``(requests, kv heads)``: the program loads
  the GROUP query heads that share a KV head, so each key is read once per GQA group.
  An empty slot (no keys: a CUDA-graph padding row) writes zeros.

The pool layout is ``KVPool.data[layer]``: ``[2 * kvh, num_blocks, block_size, head_dim]``
(K heads, then V heads). The softmax runs in fp32; when Q and the pool share a 16-bit dtype (a
bf16 model on a GPU) the prefill matmuls take 16-bit operands with fp32 accumulation (as
FlashAttention does), otherwise fp32 throughout. Q comes pre-scaled (scale 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    stride_qt,
    stride_qh,
    stride_kvh,
    stride_kvb,
    stride_kvo,
    stride_ot,
    stride_oh,
    num_kv_heads,
    window,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DOT_16BIT: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_first = tl.load(qo_indptr + seq)
    qo_len = tl.load(qo_indptr + seq + 1) - q_first
    if tile * BLOCK_M >= qo_len:
        return
    kv_len = tl.load(kv_lens + seq)
    page_first = tl.load(kv_indptr + seq)
    kv_head = head // GROUP
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_valid = offs_m < qo_len
    q_pos = kv_len - qo_len + offs_m
    q_rows = (q_first + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_valid[:, None],
        other=0.0,
    )
    if not DOT_16BIT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys this tile can see: up to its last query, from its first query's window start.
    hi = tl.minimum(kv_len, kv_len - qo_len + tile * BLOCK_M + BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, kv_len - qo_len + tile * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    k_base = kv_ptr + kv_head * stride_kvh
    v_base = kv_ptr + (num_kv_heads + kv_head) * stride_kvh
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_len
        page = tl.load(kv_indices + page_first + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        slot = page.to(tl.int64) * stride_kvb + (offs_n % BLOCK_SIZE) * stride_kvo
        k = tl.load(k_base + slot[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        if DOT_16BIT:
            s = tl.dot(q, tl.trans(k))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_16BIT:
            pv = tl.dot(p.to(v.dtype), v)
        else:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None],
    )


@triton.jit
def _decode_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    stride_qt,
    stride_qh,
    stride_kvh,
    stride_kvb,
    stride_kvo,
    stride_ot,
    stride_oh,
    num_kv_heads,
    window,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    kv_len = tl.load(kv_lens + seq)
    page_first = tl.load(kv_indptr + seq)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    row = seq.to(tl.int64)
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_valid[:, None],
        other=0.0,
    ).to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, kv_len - window)
        lo = (lo // BLOCK_N) * BLOCK_N
    k_base = kv_ptr + kv_head * stride_kvh
    v_base = kv_ptr + (num_kv_heads + kv_head) * stride_kvh
    for n0 in range(lo, kv_len, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_len
        if HAS_WINDOW:
            n_valid = n_valid & (offs_n >= kv_len - window)
        page = tl.load(kv_indices + page_first + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        slot = page.to(tl.int64) * stride_kvb + (offs_n % BLOCK_SIZE) * stride_kvo
        k = tl.load(k_base + slot[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=n_valid[:, None], other=0.0)
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        m_i = m_new
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # an empty slot: acc is 0, the output 0
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=g_valid[:, None],
    )


def _dot_16bit(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the prefill matmuls take 16-bit operands: Q and the pool share fp16 or bf16.
    Not bf16 on a CPU: Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands as raw
    bits (results ~1e10 off), so the interpreter takes the fp32 path there."""
    if q.dtype != kv.dtype or kv.dtype == torch.float32:
        return False
    return kv.dtype == torch.float16 or kv.is_cuda


def _check(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged attention needs unit stride along head_dim")
    if kv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the Triton kernels read float KV pools, not {kv.dtype}")


def paged_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    max_qo_len: int,
    sliding_window: int | None = None,
    block_m: int = 16,
    block_n: int = 32,
) -> None:
    """Causal attention of ragged query rows over paged keys, written into ``out``.

    ``q``/``out``: ``[T, H, D]`` (any row and head strides); ``kv``: one layer of the pool,
    ``[2 * kvh, num_blocks, block_size, D]``; the rest: a ``PageTableTensors``'s fields."""
    _check(q, kv, out)
    num_seqs = kv_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv.shape[0] // 2
    if num_seqs == 0 or max_qo_len == 0:
        return
    grid = (triton.cdiv(max_qo_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, kv, out, qo_indptr, kv_indptr, kv_indices, kv_lens,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        out.stride(0), out.stride(1), num_kv_heads, sliding_window or 0,
        BLOCK_SIZE=kv.shape[2], GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
        DOT_16BIT=_dot_16bit(q, kv),
    )  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    sliding_window: int | None = None,
    block_n: int = 32,
) -> None:
    """One query per request (row i of ``q`` [B, H, D]) over its paged keys, into ``out``."""
    _check(q, kv, out)
    num_seqs = kv_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv.shape[0] // 2
    if num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    _decode_kernel[(num_seqs, num_kv_heads)](
        q, kv, out, kv_indptr, kv_indices, kv_lens,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        out.stride(0), out.stride(1), num_kv_heads, sliding_window or 0,
        BLOCK_SIZE=kv.shape[2], GROUP=group, GROUP_PAD=triton.next_power_of_2(group),
        HEAD_DIM=head_dim, BLOCK_N=block_n, HAS_WINDOW=sliding_window is not None,
    )  # fmt: skip
