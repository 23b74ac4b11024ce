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


# ------------------------------------------------------------------ the kernels, called directly
# Each case: the torch reference (``TorchAttention``: gathers, masks, SDPA, sinks) against
# ``paged_prefill`` / ``paged_decode`` over ``build_page_table``'s tables, with tiny tiles
# (16 rows, 16 keys) so a few dozen keys span several tiles and pages.

ROPE_INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
HEADS = {1: (2, 2), 4: (4, 1), 8: (8, 1)}  # GQA group -> (query heads, KV heads)


def _kernels_vs_reference(
    prefill,
    decode,
    group: int,
    *,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    window: int | None = None,
    sinks: int = 0,
    splits: int = 1,
    prefill_splits: int = 1,
    pad_decode_to: int | None = None,
    num_blocks: int = 40,
    poison: torch.Tensor | None = None,
):
    """(reference, ours) [T, H * D] of one layer over the same random pool and qkv; decode
    tables padded with empty slots to ``pad_decode_to`` (their rows returned after the real
    ones). ``poison`` (bool [num_blocks, block_size]): those pool slots hold NaN for ours."""
    from model_runner.attention_backends import triton_kernels
    from model_runner.attention_backends.page_table import sink_rotation

    num_heads, num_kv_heads = HEADS[group]
    g = torch.Generator().manual_seed(group * 100 + block_size + splits)
    pool = KVPool(1, num_kv_heads, HEAD_DIM, num_blocks, block_size, dtype, DEVICE)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g).to(dtype))
    num_tokens = sum(s.num_tokens for s in (*prefill, *decode))
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, HEAD_DIM, generator=g)
    qkv = (qkv * 0.5).to(dtype).to(DEVICE)
    inv_freq = ROPE_INV_FREQ.float().to(DEVICE) if sinks else None
    spec = AttentionSpec(num_heads, num_kv_heads, HEAD_DIM, block_size, dtype, dtype, DEVICE,
                         window, sinks, inv_freq)  # fmt: skip
    reference = TorchAttention(spec)
    batch = reference.build(StepRows.from_seqs(prefill, decode, block_size))
    ref_pool = KVPool(1, num_kv_heads, HEAD_DIM, num_blocks, block_size, dtype, DEVICE)
    ref_pool.data.copy_(pool.data)
    ref = torch.empty(num_tokens, num_heads * HEAD_DIM, dtype=dtype, device=DEVICE)
    reference.forward(0, qkv, batch, ref_pool, ref)

    pool.write(0, qkv[:, num_heads:], batch.slot_mapping)
    if poison is not None:
        pool.data[:, :, poison.to(DEVICE)] = float("nan")
    kv = pool.data[0]
    q = qkv[:, :num_heads]
    num_rows = num_tokens + (pad_decode_to or len(decode)) - len(decode)
    out = torch.full((num_rows, num_heads, HEAD_DIM), float("nan"), dtype=dtype, device=DEVICE)
    r = sum(s.num_tokens for s in prefill)
    for seqs, rows, is_decode in ((prefill, slice(0, r), False), (decode, slice(r, None), True)):
        if not seqs:
            continue
        table = build_page_table(seqs, block_size, window, attention_sinks=sinks)
        rotation = None
        if sinks:
            assert window is not None
            cos, sin = sink_rotation(seqs, window, sinks, ROPE_INV_FREQ)
            rotation = (cos.to(DEVICE), sin.to(DEVICE))
        kw = {"num_sinks": sinks, "sink_rotation": rotation, "block_n": 16}
        if is_decode:
            table = table.padded(pad_decode_to or len(seqs))
            q_rows = torch.cat([q[rows], q[rows][:1].expand(table.num_seqs - len(seqs), -1, -1)])
            if rotation is not None:
                pad = table.num_seqs - len(seqs)
                rotation = tuple(torch.cat([t, t[:1].expand(pad, -1)]) for t in rotation)
                kw["sink_rotation"] = rotation
            t = table.to_device(DEVICE)
            triton_kernels.paged_decode(
                q_rows, kv, out[rows], t.kv_indptr, t.kv_indices, t.kv_lens, window,
                num_splits=splits, **kw,
            )  # fmt: skip
        else:
            t = table.to_device(DEVICE)
            triton_kernels.paged_prefill(
                q[rows], kv, out[rows], t.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_lens,
                t.max_qo_len, window, block_m=16, num_splits=prefill_splits, **kw,
            )  # fmt: skip
    return ref.float().cpu(), out.flatten(1).float().cpu()


def _decodes(ends: list[int], block_size: int, first_block: int = 0) -> list:
    """Decodes at positions ``end - 1``, each on its own run of blocks (reversed, so pages
    are not in pool order)."""
    seqs, b = [], first_block
    for i, end in enumerate(ends):
        n = -(-end // block_size)
        seqs.append(seq(f"d{i}", _ids(end), end - 1, end, list(range(b + n - 1, b - 1, -1))))
        b += n
    return seqs


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_gqa_groups_and_page_sizes(group: int, block_size: int) -> None:
    """Decodes at contexts 1, 17, 40 and 97 (one key, a partial page, several tiles and
    pages) split 3 ways: the reference's outputs for GQA groups 1, 4, 8 and pages of 16, 32."""
    ref, ours = _kernels_vs_reference([], _decodes([1, 17, 40, 97], block_size), group,
                                      block_size=block_size, splits=3)  # fmt: skip
    _assert_close(ref, ours, torch.float32)


@pytest.mark.parametrize("splits", range(1, 17))
def test_decode_split_counts_and_padded_rows(splits: int) -> None:
    """Any split count 1..16 (more splits than a short context has tiles: those write -inf
    and read nothing) gives the reference's outputs; two padded rows write exact zeros."""
    decode = _decodes([3, 33, 70, 130], 16)
    ref, ours = _kernels_vs_reference([], decode, 4, splits=splits, pad_decode_to=6)
    _assert_close(ref, ours[:4], torch.float32)
    assert torch.equal(ours[4:], torch.zeros(2, ours.shape[1]))


def _prefills(block_size: int) -> list:
    """A fresh 37-token prompt, a chunk 20..45 over a 20-token prefix hit and 3 tokens over a
    60-token prefix (an extend), on scattered blocks."""
    return [
        seq("p0", _ids(37), 0, 37, [9, 3, 7][: -(-37 // block_size)]),
        seq("p1", _ids(45), 20, 45, [10, 4, 8][: -(-45 // block_size)]),
        seq("p2", _ids(63), 60, 63, [11, 5, 2, 12][: -(-63 // block_size)]),
    ]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_prefill_gqa_groups_and_page_sizes(group: int, block_size: int) -> None:
    """Fresh prompts, chunks over prefix hits and short extends (query tiles of 16 rows:
    16, 4 or 2 tokens of a group) beside two decodes: the reference's outputs."""
    decode = _decodes([29, 50], block_size, first_block=13)
    ref, ours = _kernels_vs_reference(_prefills(block_size), decode, group,
                                      block_size=block_size, splits=2)  # fmt: skip
    _assert_close(ref, ours, torch.float32)


@pytest.mark.parametrize("splits", [2, 5, 16])
def test_prefill_split_counts(splits: int) -> None:
    """Prefill rows with their keys split 2, 5 and 16 ways (causal rows that see none of a
    split's keys skip it in the merge): the reference's outputs."""
    ref, ours = _kernels_vs_reference(_prefills(16), [], 4, prefill_splits=splits)
    _assert_close(ref, ours, torch.float32)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_sliding_window_gqa_groups(group: int) -> None:
    """Window 10: chunks whose first queries' windows start mid-page, a prompt longer than
    the window, decodes past it, split 3 ways: the reference's outputs."""
    decode = _decodes([9, 44, 90], 16, first_block=13)
    ref, ours = _kernels_vs_reference(_prefills(16), decode, group, window=10, splits=3,
                                      prefill_splits=2)  # fmt: skip
    _assert_close(ref, ours, torch.float32)


@pytest.mark.parametrize(("group", "block_size"), [(1, 16), (4, 32), (8, 16)])
def test_attention_sinks(group: int, block_size: int) -> None:
    """4 sinks and a window of 12: decodes before the gap (one run from block 0), inside
    the first block and past it (sink pages, then window pages); a prompt and chunks across
    the gap; splits 1 and 4: the reference's outputs (sinks scored with the query rotated
    back by its gap)."""
    prefill = [
        seq("p0", _ids(30), 0, 30, [20, 21]),
        seq("p1", _ids(70), 50, 70, [22, 23, 24, 25, 26][: -(-70 // block_size)]),
    ]
    decode = _decodes([6, 14, 31, 90], block_size, first_block=1)
    for splits in (1, 4):
        ref, ours = _kernels_vs_reference(prefill, decode, group, block_size=block_size,
                                          window=12, sinks=4, splits=splits,
                                          prefill_splits=splits)  # fmt: skip
        _assert_close(ref, ours, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_pool_dtypes(dtype: torch.dtype) -> None:
    """fp16, bf16 and fp32 models and pools (16-bit products with fp32 accumulation on a GPU;
    bf16 in fp32 in the interpreter), a window and sinks, split 2 ways: within the dtype's
    tolerance of the reference."""
    decode = _decodes([20, 75], 16, first_block=13)
    ref, ours = _kernels_vs_reference(_prefills(16), decode, 4, dtype=dtype, window=24,
                                      sinks=3, splits=2)  # fmt: skip
    _assert_close(ref, ours, dtype)


def test_invisible_keys_and_unlisted_blocks_are_never_read() -> None:
    """With NaN in every pool slot outside the window (past the sinks) and in every block
    no table lists, outputs equal the clean run's: the kernels never load those keys."""
    block_size, window, sinks = 16, 12, 4
    prefill = [seq("p", _ids(70), 50, 70, [1, 2, 3, 4, 5])]
    decode = _decodes([90], block_size, first_block=13)
    poison = torch.ones(40, block_size, dtype=torch.bool)
    for s in (*prefill, *decode):
        for pos in range(s.end_pos):
            if pos < sinks or pos > s.start_pos - window:
                poison[s.block_ids[pos // block_size], pos % block_size] = False
    args = (prefill, decode, 4)
    kw = {"block_size": block_size, "window": window, "sinks": sinks, "splits": 3}
    _, clean = _kernels_vs_reference(*args, **kw)
    _, poisoned = _kernels_vs_reference(*args, poison=poison, **kw)
    assert torch.equal(poisoned, clean)


def test_split_count_is_a_pure_function_of_the_launch_size() -> None:
    """Enough splits for 4 waves of the GPU's multiprocessors, at most 64, 1 once the
    unsplit launch fills them; bad sizes raise."""
    from model_runner.attention_backends.triton_kernels import num_kv_splits

    assert num_kv_splits(1 * 8, 132) == 64  # batch 1, 8 KV heads: 66 wanted, capped
    assert num_kv_splits(8 * 8, 132) == 9
    assert num_kv_splits(32 * 8, 132) == 3
    assert num_kv_splits(66 * 8, 132) == 1
    assert num_kv_splits(256 * 8, 132) == 1
    assert num_kv_splits(4, 132, max_splits=16) == 16
    with pytest.raises(ValueError, match="positive"):
        num_kv_splits(0, 132)


def test_the_triton_path_never_gathers_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of chunks over prefixes and decodes on the Triton backend with
    ``KVPool.gather`` made to raise: the kernels read K/V in place, so it still runs."""

    def no_gather(*args: object) -> None:
        raise AssertionError("the Triton path gathered the cache")

    prefill = [seq("a", _ids(14), 8, 14, [6, 7, 15, 16])]
    decode = [seq("c", _ids(10), 9, 10, [1, 2, 3])]
    spec = AttentionSpec(4, 2, HEAD_DIM, BLOCK_SIZE, torch.float32, torch.float32, DEVICE)
    backend = TritonAttention(spec)
    pool = KVPool(1, 2, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE, torch.float32, DEVICE)
    batch = backend.build(StepRows.from_seqs(prefill, decode, BLOCK_SIZE))
    qkv = torch.randn(7, 8, HEAD_DIM, device=DEVICE)
    out = torch.full((7, 4 * HEAD_DIM), float("nan"), device=DEVICE)
    monkeypatch.setattr(KVPool, "gather", no_gather)
    backend.forward(0, qkv, batch, pool, out)
    assert torch.isfinite(out).all()
