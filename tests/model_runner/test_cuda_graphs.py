"""CUDA graphs for decode steps: the pure parts (sizes, the bucket a step takes, padding, the
memory estimate) and the Triton backend's graph batch (in Triton's interpreter) on any
machine; capture and replay against eager steps where CUDA is present."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from model_runner.attention_backends.base import PaddedDecode
from model_runner.attention_backends.paged import graph_page_table
from model_runner.config import ModelConfig
from model_runner.cuda_graphs import (
    GRAPH_BATCH_SIZES,
    capture_sizes,
    graph_batch_size,
    graph_bucket,
    graph_memory_bytes,
)
from model_runner.step import StepRows
from scheduler.request import Constraint, SamplingParams
from tests.model_runner.oracle import seq


def test_sizes_are_powers_of_two_up_to_256() -> None:
    """Graphs are captured for 1, 2, 4, ..., 256 decodes."""
    assert GRAPH_BATCH_SIZES == (1, 2, 4, 8, 16, 32, 64, 128, 256)


def test_a_batch_takes_the_next_size_up() -> None:
    """1 -> 1, 3 -> 4, 5 -> 8, 32 -> 32, 33 -> 64, 256 -> 256; 257 runs eagerly (None)."""
    assert [graph_batch_size(n) for n in (1, 2, 3, 5, 32, 33, 200, 256, 257)] == [
        1, 2, 4, 8, 32, 64, 256, 256, None,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="at least one"):
        graph_batch_size(0)


def test_capture_sizes_end_at_the_most_rows_a_step_holds() -> None:
    """48 rows capture 1..32 and 48; 8 rows 1, 2, 4, 8; 1 row only 1; 256 and 1000 every
    size; 0 raises."""
    assert capture_sizes(48) == (1, 2, 4, 8, 16, 32, 48)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(256) == GRAPH_BATCH_SIZES
    assert capture_sizes(1000) == GRAPH_BATCH_SIZES
    with pytest.raises(ValueError, match="at least one row"):
        capture_sizes(0)


def _draft(rid: str, ids: list[int], pos: int, num_drafts: int, table: list[int]) -> Any:
    s = seq(rid, ids, pos, pos + 1 + num_drafts, table)
    return dataclasses.replace(s, all_token_ids=ids[: pos + 1], num_draft_tokens=num_drafts)


def test_the_bucket_counts_rows_and_refuses_prefill() -> None:
    """A decode with 2 drafts and a constrained decode are 4 rows: graph 4 of (1, 2, 4, 8),
    graph 8 of (1, 2, 8); a step with a prefill chunk, or 9 rows over (1, 2, 4, 8), has none."""
    ids = list(range(20))
    constrained = dataclasses.replace(
        seq("c", ids, 9, 10, [1, 2, 3]),
        sampling=SamplingParams(constraint=Constraint("regex", "[0-9]+")),
    )
    step = StepRows.from_seqs([], [_draft("v", ids, 4, 2, [4, 5]), constrained], 4)
    assert graph_bucket(step, (1, 2, 4, 8)) == 4
    assert graph_bucket(step, (1, 2, 8)) == 8
    mixed = StepRows.from_seqs([seq("p", ids, 0, 3, [6])], [constrained], 4)
    assert graph_bucket(mixed, (1, 2, 4, 8)) is None
    many = StepRows.from_seqs([], [seq(f"d{i}", ids, 9, 10, [1, 2, 3]) for i in range(9)], 4)
    assert graph_bucket(many, (1, 2, 4, 8)) is None


def test_padding_rows_write_the_scratch_slot_and_have_no_keys() -> None:
    """Three decodes padded to 4 (block size 4, 3 pages per row): the real rows' ids,
    positions, slots and pages, then a row of token 0 at position 0 writing the scratch
    slot, with no keys, and the page list padded with 0 to 4 x 3 entries."""
    decode = [
        seq("a", list(range(10)), 9, 10, [5, 1, 8]),
        seq("b", list(range(3)), 2, 3, [4]),
        seq("c", list(range(5)), 4, 5, [2, 7]),
    ]
    step = StepRows.from_seqs([], decode, 4)
    padded = PaddedDecode(step, 4, scratch_slot=400)
    assert padded.num_pad == 1
    assert padded.row_ids() == [9, 2, 4, 0, 9, 2, 4, 0, 33, 18, 28, 400]  # ids | pos | slots
    kv_indptr, kv_lens = [0, 3, 4, 6, 6], [10, 3, 5, 0]
    kv_indices = [5, 1, 8, 4, 2, 7] + [0] * 6
    assert graph_page_table(padded, max_pages=3) == kv_indptr + kv_lens + kv_indices
    with pytest.raises(ValueError, match="do not fit"):
        PaddedDecode(step, 2, scratch_slot=400)
    with pytest.raises(ValueError, match="prefill rows"):
        PaddedDecode(StepRows.from_seqs(decode[:1], [], 4), 4, scratch_slot=400)


def test_draft_rows_are_one_token_decodes_over_their_table() -> None:
    """A decode at 5 with 2 drafts (table [3, 6]) padded to 4: rows at 5, 6 and 7, each
    seeing keys up to itself (6, 7, 8 keys) over the same two pages, then one padding row."""
    ids = list(range(10))
    step = StepRows.from_seqs([], [_draft("v", ids, 5, 2, [3, 6])], 4)
    padded = PaddedDecode(step, 4, scratch_slot=400)
    assert padded.row_ids() == [5, 6, 7, 0, 5, 6, 7, 0, 25, 26, 27, 400]  # ids | pos | slots
    kv_indptr, kv_lens, kv_indices = [0, 2, 4, 6, 6], [6, 7, 8, 0], [3, 6, 3, 6, 3, 6, 0, 0]
    assert graph_page_table(padded, max_pages=2) == kv_indptr + kv_lens + kv_indices


def test_a_window_drops_the_pages_before_it_in_the_graph_table() -> None:
    """Window 4, block size 4: a decode at 9 sees keys 6..9, so its table lists blocks 1 and
    2 of [5, 1, 8] (kv_len 6 counted from block 1's first key), padded to 2 x 3 pages."""
    step = StepRows.from_seqs([], [seq("a", list(range(10)), 9, 10, [5, 1, 8])], 4)
    table = graph_page_table(PaddedDecode(step, 2, scratch_slot=400), 3, sliding_window=4)
    assert table == [0, 2, 2, 6, 0, 1, 8, 0, 0, 0, 0]  # kv_indptr | kv_lens | kv_indices


def test_a_backend_without_graphs_makes_no_graph_batch() -> None:
    """The torch reference has no CUDA graphs: ``graph_batch`` and ``fill`` raise."""
    from model_runner.attention_backends import AttentionSpec, make_attention_backend

    cpu = torch.device("cpu")
    spec = AttentionSpec(4, 2, 16, 4, torch.float32, torch.float32, cpu)
    torch_backend = make_attention_backend("torch", spec)
    assert not torch_backend.graphs
    with pytest.raises(NotImplementedError, match="no CUDA graphs"):
        torch_backend.graph_batch(4, 3)
    step = StepRows.from_seqs([], [], 4)
    with pytest.raises(NotImplementedError, match="no CUDA graphs"):
        torch_backend.fill(PaddedDecode(step, 4, scratch_slot=0))


def test_the_triton_graph_batch_gives_the_eager_steps_hidden_states() -> None:
    """Triton (on CUDA, else in its interpreter), no graph captured: a decode with 2 drafts
    beside two plain decodes (5 rows, 4 pages at most), filled into the backend's graph
    batch of 8 and run through the model, gives the eager step's hidden states at every row
    (fp32, 1e-4); the same static batch refilled with a 1-row step gives that step's; the
    padding rows write the scratch block and nothing else."""
    pytest.importorskip("triton")
    from tests.model_runner.oracle import make_runner, plan, random_ids, tiny_hf

    hf = tiny_hf("llama-gqa")
    runner = make_runner(hf, num_blocks=16, attention_backend="triton")
    ids = [random_ids(14, s) for s in range(3)]
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    lens = [8, 8, 13]
    runner.step_logits(
        plan(0, prefill=[seq(f"r{i}", ids[i], 0, lens[i], tables[i]) for i in range(3)])
    )
    scratch_block = 15  # never in a table: the padding rows write its first slot
    scratch_slot = scratch_block * runner.block_size
    attention, pool, limits = runner.attention, runner.pool, runner.limits
    batch = attention.graph_batch(8, max_pages=4)
    decodes = [
        _draft("r0", ids[0], 8, 2, tables[0]),
        seq("r2", ids[2], 13, 14, tables[2]),
        seq("r1", ids[1], 8, 9, tables[1]),
    ]
    for step_plan in (
        plan(1, decode=decodes),
        plan(2, decode=[seq("r1", ids[1], 9, 10, tables[1])]),
    ):
        step = StepRows.of(step_plan, limits)
        eager = runner.paths.eager.forward(step)
        before = pool.data.clone()
        attention.fill(PaddedDecode(step, 8, scratch_slot))
        graphed = runner.model.forward(batch, pool)
        assert graphed.shape[0] == 8
        assert (graphed[: step.num_rows] - eager).abs().max().item() <= 1e-4
        after = pool.data.clone()
        after[:, :, scratch_block] = before[:, :, scratch_block]
        assert (after - before).abs().max().item() <= 1e-5  # the real rows' K/V, rewritten


def test_graph_memory_estimate_for_a_llama_3_8b_shape() -> None:
    """Llama-3-8B (hidden 4096, 32 / 8 heads of 128, MLP 14336), bf16, batch 256: twice a
    layer's activations per row (3 x 4096 + 48 x 128 + 32 x 128 + 3 x 14336 = 65536
    elements) plus 36 bytes of inputs per row."""
    config = ModelConfig(
        architecture="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
    )
    assert graph_memory_bytes(config, 256, 2) == 2 * 256 * 65536 * 2 + 256 * 36


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graph_replay_equals_eager_decode() -> None:
    """On CUDA with the Triton backend: decode logits of 3 requests (graph of 4) from the
    captured graph equal the same runner's eager step (fp32, 1e-4)."""
    pytest.importorskip("triton")
    from tests.model_runner.oracle import make_runner, plan, random_ids, tiny_hf

    hf = tiny_hf("llama-gqa")
    ids = [random_ids(9, s) for s in range(3)]
    tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    prefill = plan(0, prefill=[seq(f"r{i}", ids[i], 0, 8, tables[i]) for i in range(3)])
    decode = plan(1, decode=[seq(f"r{i}", ids[i], 8, 9, tables[i]) for i in range(3)])
    logits = []
    for graphs in (False, True):
        runner = make_runner(hf, attention_backend="triton", cuda_graphs=graphs)
        runner.step_logits(prefill)
        logits.append(runner.step_logits(decode))
    for rid, ref in logits[0].items():
        assert (logits[1][rid] - ref).abs().max().item() <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_graph_replay_of_draft_rows_equals_eager() -> None:
    """On CUDA with the Triton backend: a decode with 2 drafts beside a plain decode (4 rows:
    graph 4) gives the eager step's logits at every row (fp32, 1e-4); eager verifies the
    drafts as a chunk, the graph as one-token decodes."""
    pytest.importorskip("triton")
    from tests.model_runner.oracle import make_runner, plan, random_ids, tiny_hf

    hf = tiny_hf("llama-gqa")
    ids = [random_ids(12, s) for s in range(2)]
    tables = [[1, 2, 3], [4, 5, 6]]
    prefill = plan(0, prefill=[seq(f"r{i}", ids[i], 0, 8, tables[i]) for i in range(2)])
    decode = plan(
        1, decode=[_draft("r0", ids[0], 8, 2, tables[0]), seq("r1", ids[1], 8, 9, tables[1])]
    )
    logits = []
    for graphs in (False, True):
        runner = make_runner(hf, attention_backend="triton", cuda_graphs=graphs)
        runner.step_logits(prefill)
        logits.append(runner.step_logits(decode))
    for rid, ref in logits[0].items():
        assert logits[1][rid].shape == ref.shape
        assert (logits[1][rid] - ref).abs().max().item() <= 1e-4
