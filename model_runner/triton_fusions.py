"""A layer's small ops fused into Triton kernels, for the CUDA forward pass.

Between its four GEMMs and its attention, a layer of the torch forward launches about fifteen
small kernels: RMSNorm (one or more), the residual copy of ``addmm``, eight elementwise ops
of RoPE, the pool's ``index_copy_``, SiLU and the ``* up`` product. Each reads and writes
a few hundred KB at most, so at decode batch sizes their launches, not their bytes, cost the
time (the H100 profile of issue 38: ~11 ms of a 26 ms batch-256 step was neither attention
nor GEMM). Three kernels do their work (vLLM's ``fused_add_rms_norm``,
``rotary_embedding`` + ``reshape_and_cache``, ``silu_and_mul`` in the same roles)::

    add_rms_norm(x, residual, w)   residual += x; return rms_norm(residual) * w
    rope_kv_write(qkv, ...)        RoPE on Q and K in place, then K and V into the pool slots
    silu_mul(gate_up)              silu(gate) * up

Each program does one token (row): it loads whole rows in 16-byte vectors, computes in fp32
and rounds once to the tensor's dtype. RoPE pairs are adjacent elements ``(2i, 2i + 1)``
(``model.py``'s interleaved layout), split and joined in registers so the loads stay
vectors. ``model.LlamaModel.forward`` takes these on CUDA (``_fusion_ops``); the torch ops stay
the CPU path and the reference these are tested against (in Triton's interpreter on CPU, and
compiled for sm_90 in the codegen test).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n,
    eps,
    HAS_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    h = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
    if HAS_ADD:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + x.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, 0) / n + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + cols, (hf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _rotate(ptr, rows, rows_valid, offs_d, cos, sin, ROWS: tl.constexpr, HALF: tl.constexpr):
    """The head vectors at ``ptr + rows`` [ROWS] (element offsets), rotated by (cos, sin)
    [HALF] on pairs (2i, 2i + 1): [ROWS, 2 * HALF] in fp32."""
    mask = rows_valid[:, None]
    x = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (ROWS, HALF, 2)))
    r0 = x0 * cos[None, :] - x1 * sin[None, :]
    r1 = x0 * sin[None, :] + x1 * cos[None, :]
    return tl.reshape(tl.join(r0, r1), (ROWS, 2 * HALF))


@triton.jit
def _rope_kv_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    kv_ptr,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_ci,
    stride_kvh,
    stride_kvs,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + t)
    offs_i = tl.arange(0, HALF)
    offs_d = tl.arange(0, 2 * HALF)
    cos = tl.load(cos_ptr + pos * stride_cp + offs_i * stride_ci).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cp + offs_i * stride_ci).to(tl.float32)
    row = qkv_ptr + t * stride_qt
    dtype = qkv_ptr.dtype.element_ty

    q_heads = tl.arange(0, HEADS_PAD)
    q_valid = q_heads < num_heads
    q_rows = q_heads * stride_qh
    q = _rotate(row, q_rows, q_valid, offs_d, cos, sin, HEADS_PAD, HALF)
    tl.store(row + q_rows[:, None] + offs_d[None, :], q.to(dtype), mask=q_valid[:, None])

    kv_heads = tl.arange(0, KV_PAD)
    kv_valid = kv_heads < num_kv_heads
    k_rows = (num_heads + kv_heads) * stride_qh
    k = _rotate(row, k_rows, kv_valid, offs_d, cos, sin, KV_PAD, HALF)
    tl.store(row + k_rows[:, None] + offs_d[None, :], k.to(dtype), mask=kv_valid[:, None])
    v_rows = (num_heads + num_kv_heads + kv_heads) * stride_qh
    v = tl.load(row + v_rows[:, None] + offs_d[None, :], mask=kv_valid[:, None], other=0.0)

    # Pool: K heads then V heads, slot ``slot`` of each (``KVPool.data[layer]``'s layout).
    pool = kv_ptr + slot * stride_kvs + offs_d[None, :]
    k_dst = pool + kv_heads[:, None].to(tl.int64) * stride_kvh
    v_dst = pool + (num_kv_heads + kv_heads)[:, None].to(tl.int64) * stride_kvh
    pool_dtype = kv_ptr.dtype.element_ty
    tl.store(k_dst, k.to(dtype).to(pool_dtype), mask=kv_valid[:, None])
    tl.store(v_dst, v.to(pool_dtype), mask=kv_valid[:, None])


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, stride_g, stride_o, inter, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


# RoPE + KV write: one token's heads per program, 4 warps (a GQA layer's K and V heads, 8 x
# 128 elements, are still 8 per thread: 16-byte accesses).
ROPE_WARPS = 4


def _warps(num_elements: int) -> int:
    """Warps for a program over ``num_elements`` elements: 8 elements (16 bytes of bf16) per
    thread, between 1 and 16 warps."""
    return max(1, min(16, num_elements // 256))


def _unit_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D rows with unit stride, got {tuple(t.stride())}")


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place (skipped when ``x`` is None), then RMSNorm of ``residual``
    times ``weight``: a new tensor [T, hidden] in ``residual``'s dtype."""
    _unit_rows(residual, "residual")
    if x is not None:
        _unit_rows(x, "x")
        if x.shape != residual.shape:
            raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    rows, n = residual.shape
    out = torch.empty_like(residual)
    if rows == 0:
        return out
    src = residual if x is None else x
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(rows,)](
        src, residual, weight, out, src.stride(0), residual.stride(0), out.stride(0), n, eps,
        HAS_ADD=x is not None, BLOCK=block, num_warps=_warps(block),
    )  # fmt: skip
    return out


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: torch.Tensor,
    num_heads: int,
) -> None:
    """RoPE of Q and K in ``qkv`` [T, H + 2 kvh, D] in place (pairs ``(2i, 2i + 1)`` rotated
    by ``cos`` / ``sin`` [max_len, D/2] at each row's position), then the rotated K and the V
    of row t into flat slot ``slot_mapping[t]`` of ``kv``, one layer of the pool
    (``[2 * kvh, num_blocks, block_size, D]``, converted to its dtype)."""
    rows, num_all, head_dim = qkv.shape
    num_kv_heads = (num_all - num_heads) // 2
    if qkv.stride(2) != 1 or kv.stride(3) != 1 or kv.stride(1) != kv.shape[2] * kv.stride(2):
        raise ValueError("rope_kv_write needs unit stride along head_dim and whole pool blocks")
    if num_kv_heads < 1 or kv.shape[0] != 2 * num_kv_heads or kv.shape[3] != head_dim:
        raise ValueError(f"pool layer {tuple(kv.shape)} does not hold qkv {tuple(qkv.shape)}")
    half = head_dim // 2
    if head_dim % 2 or half & (half - 1):
        raise ValueError(f"head_dim {head_dim}: the fused RoPE needs a power of two")
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.shape[-1] != half:
        raise ValueError(f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} need [max_len, {half}]")
    if rows == 0:
        return
    heads_pad = triton.next_power_of_2(num_heads)
    _rope_kv_write_kernel[(rows,)](
        qkv, cos, sin, positions, slot_mapping, kv,
        qkv.stride(0), qkv.stride(1), cos.stride(0), cos.stride(1), kv.stride(0), kv.stride(2),
        num_heads, num_kv_heads,
        HALF=half, HEADS_PAD=heads_pad, KV_PAD=triton.next_power_of_2(num_kv_heads),
        num_warps=ROPE_WARPS,
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` [T, 2 I] (the gate columns, then the up columns):
    a new tensor [T, I]."""
    _unit_rows(gate_up, "gate_up")
    rows, width = gate_up.shape
    if width % 2:
        raise ValueError(f"gate_up has {width} columns: gate and up need an even count")
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    block = min(triton.next_power_of_2(inter), 2048)
    grid = (rows, triton.cdiv(inter, block))
    _silu_mul_kernel[grid](
        gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block,
        num_warps=_warps(block),
    )  # fmt: skip
    return out
