"""Paged attention in Triton on tensor cores: K/V read in place from the pool through the page
table, both products in ``tl.dot``, split-KV merged by log-sum-exp.

Imported only by the ``triton`` backend (and its tests and benchmarks), after
``TRITON_INTERPRET`` is settled: Triton reads it when a kernel is decorated. One kernel serves
decode and prefill; one contract (``page_table``'s relative positions: query j of request i
sits at ``kv_len - qo_len + j``).

**One program per (request, query tile, KV head, split).** The rows of a program are the
query heads of one KV head's GQA group for ``BLOCK_Q`` consecutive tokens, packed as
``token * GROUP_PAD + head`` and padded to at least 16 rows (``tl.dot``'s smallest M)::

    decode (BLOCK_Q 1, group 4):     rows | h0 h1 h2 h3 | 12 padding rows (masked) |
    prefill (BLOCK_Q 16, group 4):   rows | t0: h0..h3 | t1: h0..h3 | ... | t15: h0..h3 |

so each key tile is read ONCE per KV head and multiplies all the heads that share it:
``S = Q [BLOCK_M, D] . K^T [D, BLOCK_N]`` and ``acc += P [BLOCK_M, BLOCK_N] . V [BLOCK_N, D]``,
16-bit operands with fp32 accumulation (fp32 pools: fp32 operands, IEEE), online softmax in
fp32. A key tile may span pages: each key finds its page through ``kv_indices``.

**Split-KV.** A program's key tiles are cut into ``num_splits`` contiguous runs; each split
writes its normalized partial output and its log-sum-exp, and ``_merge_kernel`` combines them
(grid ``(rows, heads)``). ``num_kv_splits`` chooses the count from the launch's size alone (for
decode, the batch size: under CUDA graphs, the padded bucket), and each request's keys are
cut on the device from its own ``kv_len``, so one captured graph serves any context; splits
past a request's last tile write ``-inf`` and read nothing. A padded row (``kv_len`` 0) reads
no key and writes zeros.

**Windows and attention sinks** (``torch_backend``'s semantics, the reference, in relative
positions): a query at q sees keys ``k <= q`` with ``k > q - window``, plus, with ``num_sinks``
S, the first S listed keys (the page table lists the sink blocks first). Sink keys are scored
with the query rotated back by its gap (the per-row ``sink_cos`` / ``sink_sin`` of
``page_table.sink_rotation``); the rotation pairs elements ``(2i, 2i + 1)`` as the reference
does.

The pool layout is ``KVPool.data[layer]``: ``[2 * kvh, num_blocks, block_size, head_dim]``
(K heads, then V heads). Q comes pre-scaled (scale 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Key splits per (request, KV head) at most, and the waves of programs a launch aims for.
MAX_KV_SPLITS = 64
TARGET_WAVES = 4
MIN_BLOCK_M = 16  # tl.dot's smallest M (rows) on tensor cores


def num_kv_splits(num_programs: int, num_sms: int, max_splits: int = MAX_KV_SPLITS) -> int:
    """Splits of each program's keys so that a launch of ``num_programs`` unsplit programs
    fills ``TARGET_WAVES`` waves of ``num_sms`` multiprocessors (1 once it already does).

    A pure function of the launch's size: for decode ``num_programs`` is the batch (the
    padded CUDA-graph bucket) times the KV heads, never a context length, so a captured
    graph stays valid for any context."""
    if num_programs < 1 or num_sms < 1 or max_splits < 1:
        raise ValueError(f"need positive sizes, got {num_programs}, {num_sms}, {max_splits}")
    return max(1, min(max_splits, -(-TARGET_WAVES * num_sms // num_programs)))


def default_num_splits(device: torch.device, num_programs: int) -> int:
    """``num_kv_splits`` over a CUDA ``device``'s multiprocessors; 1 elsewhere (the
    interpreter, where tests pass their split counts)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return num_kv_splits(num_programs, sms)


@triton.jit
def _attend_tile(
    q,
    k_base,
    v_base,
    kv_indices,
    page_first,
    offs_n,
    offs_d,
    n_load,
    visible,
    m_i,
    l_i,
    acc,
    stride_kvb,
    stride_kvo,
    BLOCK_SIZE: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """One key tile: scores, online-softmax update (base 2), P.V. Keys outside ``n_load``
    are never read; scores outside ``visible`` [BLOCK_M, BLOCK_N] are -inf."""
    page = tl.load(kv_indices + page_first + offs_n // BLOCK_SIZE, mask=n_load, other=0)
    slot = page.to(tl.int64) * stride_kvb + (offs_n % BLOCK_SIZE) * stride_kvo
    k_t = tl.load(k_base + slot[None, :] + offs_d[:, None], mask=n_load[None, :], other=0.0)
    v = tl.load(v_base + slot[:, None] + offs_d[None, :], mask=n_load[:, None], other=0.0)
    if DOT_FP32:  # noqa: SIM108 (a compile-time branch)
        s = tl.dot(q, k_t.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k_t)
    s = tl.where(visible, s * 1.4426950408889634, float("-inf"))  # log2(e): exp2 below
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    sink_cos,
    sink_sin,
    stride_qt,
    stride_qh,
    stride_kvh,
    stride_kvb,
    stride_kvo,
    stride_ot,
    stride_oh,
    num_heads,
    num_kv_heads,
    window,
    num_sinks,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    if DECODE:  # row i is request i's one query
        q_first = seq
        qo_len = 1
    else:
        q_first = tl.load(qo_indptr + seq)
        qo_len = tl.load(qo_indptr + seq + 1) - q_first
    if tile * BLOCK_Q >= qo_len:
        return
    kv_len = tl.load(kv_lens + seq)
    page_first = tl.load(kv_indptr + seq)

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tile * BLOCK_Q + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    m_valid = (tok < qo_len) & (offs_m % GROUP_PAD < GROUP)
    q_pos = kv_len - qo_len + tok
    rows = (q_first + tok).to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=m_valid[:, None], other=0.0)

    # Keys the tile's rows can see, past the sinks: from its first query's window start to
    # its last query; cut into NUM_SPLITS runs of whole BLOCK_N tiles.
    first_q = kv_len - qo_len + tile * BLOCK_Q
    hi = tl.minimum(kv_len, first_q + BLOCK_Q)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, first_q - window + 1)
    if HAS_SINKS:
        lo = tl.maximum(lo, num_sinks)
    base = (lo // BLOCK_N) * BLOCK_N
    num_tiles = tl.cdiv(tl.maximum(hi - base, 0), BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    t0 = split * per_split
    t1 = tl.minimum(t0 + per_split, num_tiles)
    sink_hi = 0
    if HAS_SINKS:
        sink_hi = tl.where(split == 0, tl.minimum(num_sinks, kv_len), 0)

    idx = (rows * num_heads + head) * NUM_SPLITS + split  # this split's partial, per row
    if NUM_SPLITS > 1:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if (t0 >= t1) & (sink_hi == 0):  # nothing to read: the merge skips this split
            tl.store(lse_ptr + idx, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=m_valid)
            return

    if DOT_FP32:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # int64: a head's stride times 2 * kvh overflows int32 in pools past 2^31 elements
    k_base = kv_ptr + kv_head.to(tl.int64) * stride_kvh
    v_base = kv_ptr + (num_kv_heads + kv_head).to(tl.int64) * stride_kvh

    if HAS_SINKS:
        # R(-d) q on pairs (2i, 2i + 1): q * cos + swap(q) * (-sin, +sin)
        half = rows[:, None] * (HEAD_DIM // 2) + offs_d[None, :] // 2
        cos = tl.load(sink_cos + half, mask=m_valid[:, None], other=1.0)
        sin = tl.load(sink_sin + half, mask=m_valid[:, None], other=0.0)
        q_swap = tl.load(q_ptrs + (offs_d ^ 1)[None, :], mask=m_valid[:, None], other=0.0)
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
        q_sink = q.to(tl.float32) * cos + q_swap.to(tl.float32) * sin * sign[None, :]
        q_sink = q_sink.to(q.dtype)
        for n0 in range(0, sink_hi, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_load = offs_n < sink_hi
            visible = n_load[None, :] & (offs_n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _attend_tile(
                q_sink, k_base, v_base, kv_indices, page_first, offs_n, offs_d, n_load,
                visible, m_i, l_i, acc, stride_kvb, stride_kvo, BLOCK_SIZE, DOT_FP32,
            )  # fmt: skip

    for t in range(t0, t1):
        offs_n = base + t * BLOCK_N + tl.arange(0, BLOCK_N)
        n_load = (offs_n >= lo) & (offs_n < hi)
        visible = n_load[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(
            q, k_base, v_base, kv_indices, page_first, offs_n, offs_d, n_load, visible,
            m_i, l_i, acc, stride_kvb, stride_kvo, BLOCK_SIZE, DOT_FP32,
        )  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # no visible key: acc is 0, the output 0
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptrs + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])
    else:
        tl.store(part_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], o, mask=m_valid[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(lse_ptr + idx, lse, mask=m_valid)


@triton.jit
def _merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """out[row, head] = the splits' partial outputs weighted by exp(lse) (base 2)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    idx = (row * num_heads + head) * NUM_SPLITS + offs_s
    lse = tl.load(lse_ptr + idx, mask=offs_s < NUM_SPLITS, other=float("-inf"))
    live = lse > float("-inf")
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(live, tl.exp2(lse - m_safe), 0.0)
    part = tl.load(
        part_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=live[:, None], other=0.0
    )
    total = tl.sum(w, 0)
    o = tl.sum(w[:, None] * part, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


def _dot_fp32(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the products take fp32 operands: an fp32 pool, Q and pool of different dtypes,
    or bf16 in the interpreter (Triton 3.9's interpreter multiplies bf16 ``tl.dot`` operands
    as raw bits, results ~1e10 off). Otherwise 16-bit operands, fp32 accumulation."""
    if q.dtype != kv.dtype or kv.dtype == torch.float32:
        return True
    return kv.dtype == torch.bfloat16 and not kv.is_cuda


def _check(q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("paged attention needs unit stride along head_dim")
    if kv.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the Triton kernels read float KV pools, not {kv.dtype}")


def _launch(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    qo_indptr: torch.Tensor | None,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    *,
    num_q_tiles: int,
    block_q: int,
    group_pad: int,
    block_n: int,
    num_splits: int | None,
    sliding_window: int | None,
    num_sinks: int,
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None,
    num_warps: int,
    num_stages: int,
) -> None:
    _check(q, kv, out)
    num_seqs = kv_lens.shape[0]
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = kv.shape[0] // 2
    if num_seqs == 0 or num_rows == 0 or num_q_tiles == 0:
        return
    if num_sinks and sink_rotation is None:
        raise ValueError("attention sinks need the per-row sink rotation (sink_rotation)")
    if num_splits is None:
        num_splits = default_num_splits(q.device, num_seqs * num_q_tiles * num_kv_heads)
    part = lse = out  # unread placeholders when unsplit
    if num_splits > 1:
        part = torch.empty(num_rows, num_heads, num_splits, head_dim, device=q.device)
        lse = torch.empty(num_rows, num_heads, num_splits, device=q.device)
    cos, sin = sink_rotation if num_sinks and sink_rotation is not None else (q, q)
    grid = (num_seqs, num_q_tiles, num_kv_heads * num_splits)
    _attention_kernel[grid](
        q, kv, out, part, lse, kv_lens if qo_indptr is None else qo_indptr, kv_indptr,
        kv_indices, kv_lens, cos, sin,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        out.stride(0), out.stride(1), num_heads, num_kv_heads, sliding_window or 0, num_sinks,
        BLOCK_SIZE=kv.shape[2], GROUP=num_heads // num_kv_heads, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, BLOCK_Q=block_q, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DECODE=qo_indptr is None, HAS_WINDOW=sliding_window is not None,
        HAS_SINKS=num_sinks > 0, DOT_FP32=_dot_fp32(q, kv),
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _merge_kernel[(num_rows, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), num_heads,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
        )  # fmt: skip


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
    *,
    num_sinks: int = 0,
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """Causal attention of ragged query rows over paged keys, written into ``out``.

    ``q``/``out``: ``[T, H, D]`` (any row and head strides); ``kv``: one layer of the pool,
    ``[2 * kvh, num_blocks, block_size, D]``; the rest: a ``PageTableTensors``'s fields.
    A tile holds ``block_m`` rows: ``block_m / GROUP_PAD`` tokens of one GQA group.
    ``num_splits`` None: ``num_kv_splits`` of the launch (requests x query tiles x KV heads:
    a few short chunks over long prefixes split their keys, a large prefill does not);
    ``sink_rotation``: ``page_table.sink_rotation`` of the rows."""
    group_pad = triton.next_power_of_2(q.shape[1] // (kv.shape[0] // 2))
    block_q = max(1, max(block_m, MIN_BLOCK_M) // group_pad)
    _launch(
        q, kv, out, qo_indptr, kv_indptr, kv_indices, kv_lens,
        num_q_tiles=triton.cdiv(max_qo_len, block_q), block_q=block_q,
        group_pad=max(group_pad, MIN_BLOCK_M // block_q), block_n=block_n,
        num_splits=num_splits, sliding_window=sliding_window, num_sinks=num_sinks,
        sink_rotation=sink_rotation, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    sliding_window: int | None = None,
    *,
    num_sinks: int = 0,
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_n: int = 32,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> None:
    """One query per request (row i of ``q`` [B, H, D]) over its paged keys, into ``out``:
    the GQA group padded to 16 rows, ``num_splits`` (default ``num_kv_splits`` of B x kvh)
    key splits merged by log-sum-exp. An empty slot (``kv_len`` 0) writes zeros."""
    group_pad = max(MIN_BLOCK_M, triton.next_power_of_2(q.shape[1] // (kv.shape[0] // 2)))
    _launch(
        q, kv, out, None, kv_indptr, kv_indices, kv_lens,
        num_q_tiles=1, block_q=1, group_pad=group_pad, block_n=block_n,
        num_splits=num_splits, sliding_window=sliding_window, num_sinks=num_sinks,
        sink_rotation=sink_rotation, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
