"""The Triton paged kernels against the torch reference backend, on small shapes.

Each case runs one layer's attention twice over copies of the same random pool: through
``TorchAttention`` (gathers, masks, SDPA) and through ``TritonAttention`` (page table, the
kernels reading K/V in place). On a CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from model_runner.attention_backends.base import AttentionSpec
from model_runner.attention_backends.page_table import build_page_table
from model_runner.attention_backends.torch_backend import TorchAttention
from model_runner.attention_backends.triton_backend import TritonAttention
from model_runner.kv_pool import KVPool
from model_runner.step import StepRows
from tests.model_runner.oracle import seq

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 4
HEAD_DIM = 16
NUM_BLOCKS = 80
TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}


def _run_both(
    prefill, decode, num_heads, num_kv_heads, dtype=torch.float32, window=None, null_block=None
):
    """(reference, triton) outputs [T, H * D] of one layer over the same pool and qkv."""
    g = torch.Generator().manual_seed(0)
    pool = KVPool(1, num_kv_heads, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE, dtype, DEVICE)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g).to(dtype))
    num_tokens = sum(s.num_tokens for s in (*prefill, *decode))
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, HEAD_DIM, generator=g)
    qkv = (qkv * 0.5).to(dtype).to(DEVICE)
    spec = AttentionSpec(
        num_heads, num_kv_heads, HEAD_DIM, BLOCK_SIZE, dtype, dtype, DEVICE, window
    )
    step = StepRows.from_seqs(prefill, decode, BLOCK_SIZE, null_block)
    outs = []
    for backend in (TorchAttention(spec), TritonAttention(spec)):
        p = KVPool(1, num_kv_heads, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE, dtype, DEVICE)
        p.data.copy_(pool.data)
        batch = backend.build(step)
        out = torch.full((num_tokens, num_heads * HEAD_DIM), float("nan"), dtype=dtype)
        out = out.to(DEVICE)
        backend.forward(0, qkv.clone(), batch, p, out)
        outs.append(out.float().cpu())
    return outs


def _assert_close(ref: torch.Tensor, ours: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(ours).all()
    err = (ours - ref).abs().max().item()
    assert err <= TOL[dtype], f"max |triton - torch| = {err:.3e}"


def _ids(n: int) -> list[int]:
    return [(7 * i + 3) % 100 for i in range(n)]


def test_decode_ragged_contexts() -> None:
    """Decodes at positions 44, 12, 0 and 5 (contexts over two key tiles, one key, a
    partial block) with scattered block tables match the reference (MHA, fp32)."""
    decode = [
        seq("a", _ids(45), 44, 45, list(range(39, 27, -1))),
        seq("b", _ids(13), 12, 13, [3, 17, 5, 9]),
        seq("c", _ids(1), 0, 1, [21]),
        seq("d", _ids(6), 5, 6, [0, 22]),
    ]
    ref, ours = _run_both([], decode, 2, 2)
    _assert_close(ref, ours, torch.float32)


def test_prefill_fresh_prompts() -> None:
    """Two prompts from position 0 (7 and 18 tokens, two query tiles) attend causally to
    their own keys, as the reference's plain causal SDPA."""
    prefill = [
        seq("a", _ids(7), 0, 7, [4, 8]),
        seq("b", _ids(18), 0, 18, [10, 2, 30, 31, 12]),
    ]
    ref, ours = _run_both(prefill, [], 2, 2)
    _assert_close(ref, ours, torch.float32)


def test_chunked_prefill_over_a_prefix_hit_with_gqa_and_decodes() -> None:
    """A chunk at positions 8..13 over 8 cached keys (a prefix hit), another at 3..4, and
    two decodes in the same step, 4 query heads on 2 KV heads: the reference's outputs."""
    prefill = [
        seq("a", _ids(14), 8, 14, [6, 7, 15, 16]),
        seq("b", _ids(5), 3, 5, [20, 25]),
    ]
    decode = [seq("c", _ids(10), 9, 10, [1, 2, 3]), seq("d", _ids(3), 2, 3, [33])]
    ref, ours = _run_both(prefill, decode, 4, 2)
    _assert_close(ref, ours, torch.float32)


def test_sliding_window() -> None:
    """Window 6: a decode at position 22 (its first page holds a key out of the window), a
    chunk 10..16 and a fresh prompt longer than the window: the reference's outputs."""
    prefill = [
        seq("a", _ids(17), 10, 17, [11, 12, 13, 14, 15]),
        seq("b", _ids(9), 0, 9, [16, 17, 18]),
    ]
    decode = [seq("c", _ids(23), 22, 23, [0, 0, 0, 6, 7, 8])]
    ref, ours = _run_both(prefill, decode, 4, 1, window=6)
    _assert_close(ref, ours, torch.float32)


def test_blocks_released_to_the_null_block_are_skipped() -> None:
    """No window, but the adaptive KV strategy released the first two blocks to the null
    block 0: a decode at 14 and a chunk 12..15 read keys from position 8 on, as the
    reference does."""
    decode = [seq("a", _ids(15), 14, 15, [0, 0, 5, 6])]
    prefill = [seq("b", _ids(16), 12, 16, [0, 0, 9, 10])]
    ref, ours = _run_both(prefill, decode, 2, 2, null_block=0)
    _assert_close(ref, ours, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_pools(dtype: torch.dtype) -> None:
    """fp16 and bf16 models and pools (16-bit matmul operands, fp32 softmax): within the
    dtype's tolerance of the reference, for a prefix-hit chunk and a decode with GQA."""
    prefill = [seq("a", _ids(12), 5, 12, [3, 4, 5])]
    decode = [seq("b", _ids(20), 19, 20, [9, 10, 11, 12, 13])]
    ref, ours = _run_both(prefill, decode, 4, 2, dtype=dtype)
    _assert_close(ref, ours, dtype)


def test_decode_empty_slots_write_zeros() -> None:
    """A decode table padded with empty slots (a CUDA graph's padding rows): real rows
    equal the unpadded kernel's, padding rows are exactly 0."""
    from model_runner.attention_backends import triton_kernels

    g = torch.Generator().manual_seed(1)
    kv = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM, generator=g).to(DEVICE)
    decode = [seq("a", _ids(9), 8, 9, [5, 6, 7]), seq("b", _ids(2), 1, 2, [8])]
    table = build_page_table(decode, BLOCK_SIZE)
    q = torch.randn(4, 2, HEAD_DIM, generator=g).to(DEVICE)
    outs = []
    for t in (table, table.padded(4)):
        n = t.num_seqs
        dev = t.to_device(DEVICE)
        out = torch.full((n, 2, HEAD_DIM), float("nan"), device=DEVICE)
        triton_kernels.paged_decode(q[:n], kv, out, dev.kv_indptr, dev.kv_indices, dev.kv_lens)
        outs.append(out.cpu())
    assert torch.equal(outs[1][:2], outs[0])
    assert torch.equal(outs[1][2:], torch.zeros(2, 2, HEAD_DIM))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_ragged_steps(seed: int) -> None:
    """Seeded random steps (1-3 chunks anywhere in contexts of up to 40 tokens, 1-4 decodes
    at up to 40, so key tiles of 32 span pages and contexts span two tiles,
    shuffled distinct blocks, a window of 5-20 tokens or none, 4 heads on 1 or 2 KV heads):
    the reference's outputs."""
    rng = torch.Generator().manual_seed(100 + seed)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=rng))

    free = torch.randperm(NUM_BLOCKS, generator=rng).tolist()

    def entry(rid: str, end: int, start: int):  # type: ignore[no-untyped-def]
        blocks = [free.pop() for _ in range(-(-end // BLOCK_SIZE))]
        return seq(rid, _ids(end), start, end, blocks)

    prefill = []
    for i in range(rand(1, 3)):
        end = rand(1, 40)
        prefill.append(entry(f"p{i}", end, rand(0, end - 1)))
    decode = []
    for i in range(rand(1, 4)):
        end = rand(1, 40)
        decode.append(entry(f"d{i}", end, end - 1))
    window = rand(5, 20) if seed % 2 else None
    ref, ours = _run_both(prefill, decode, 4, rand(1, 2), window=window)
    _assert_close(ref, ours, torch.float32)
