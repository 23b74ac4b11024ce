"""The path chooser: which of the fused step, the CUDA graphs and the eager path runs a step
(the paths' kernels are stand-ins here: only ``fits`` and ``choose`` run), and the LM head
behind the graph path (a CPU stand-in replays the padded batch eagerly)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from model_runner.config import RunnerOptions
from model_runner.cuda_graphs import PaddedDecode, graph_bucket
from model_runner.paths import EagerPath, ForwardPaths, FusedPath, GraphPath, skips_released
from model_runner.runner import TorchRunner
from model_runner.step import StepRows
from scheduler.output import ScheduledSeq
from tests.model_runner.oracle import our_config, plan, random_ids, seq, tiny_hf

IDS = list(range(40))
STANDIN: Any = SimpleNamespace(sizes=(1, 2, 4))


def _draft(rid: str, pos: int, num_drafts: int, table: list[int]) -> ScheduledSeq:
    s = seq(rid, IDS, pos, pos + 1 + num_drafts, table)
    return dataclasses.replace(s, all_token_ids=IDS[: pos + 1], num_draft_tokens=num_drafts)


def _decodes(n: int) -> StepRows:
    return StepRows.from_seqs([], [seq(f"d{i}", IDS, 9, 10, [1, 2, 3]) for i in range(n)], 4)


def test_graphs_take_decode_steps_a_bucket_holds() -> None:
    """With graphs of (1, 2, 4) and no fused path: a decode with 2 drafts (3 rows) replays a
    graph; a prefill step and 5 decodes run eagerly."""
    paths = ForwardPaths(EagerPath(STANDIN, STANDIN, STANDIN), graphs=GraphPath(STANDIN))
    drafts = StepRows.from_seqs([], [_draft("v", 4, 2, [4, 5])], 4)
    prefill = StepRows.from_seqs([seq("p", IDS, 0, 3, [6])], [], 4)
    assert paths.choose(drafts).name == "graphs"
    assert paths.choose(prefill).name == "eager"
    assert paths.choose(_decodes(5)).name == "eager"


def test_the_fused_path_comes_first_up_to_its_row_bound() -> None:
    """FusedPath(max_rows=4) before graphs of (1, 2, 4): 4 decode rows take the fused path,
    a 4-row prefill chunk too; 5 rows fall through to the eager path (no bucket holds them)."""
    fused = FusedPath(STANDIN, None, max_rows=4)
    paths = ForwardPaths(EagerPath(STANDIN, STANDIN, STANDIN), fused, GraphPath(STANDIN))
    assert paths.choose(_decodes(4)).name == "fused"
    assert paths.choose(StepRows.from_seqs([seq("p", IDS, 0, 4, [6])], [], 4)).name == "fused"
    assert paths.choose(_decodes(5)).name == "eager"


def test_released_positions_inside_the_window_skip_the_fused_path() -> None:
    """Null block 0: a decode at 14 whose blocks 0-1 were released (adaptive KV strategy)
    must skip them, unless a window of 6 already starts past them; a table without released
    blocks never skips."""
    released = StepRows.from_seqs([], [seq("a", IDS, 14, 15, [0, 0, 5, 6])], 4, null_block_id=0)
    assert skips_released(released, None)
    assert not skips_released(released, 6)
    kept = StepRows.from_seqs([], [seq("a", IDS, 14, 15, [3, 4, 5, 6])], 4, null_block_id=0)
    assert not skips_released(kept, None)
    fused = FusedPath(STANDIN, None, max_rows=1 << 30)
    assert not fused.fits(released) and fused.fits(kept)


class ReplayStandIn:
    """``DecodeGraphs``' contract on a CPU: ``run(step)`` fills the backend's graph batch of
    the next size up and runs the model's forward over it (what a replay computes: every row
    of the bucket, the scratch slot for the padding), returning the real rows."""

    def __init__(self, model: Any, pool: Any, sizes: tuple[int, ...], scratch_slot: int) -> None:
        self.model, self.pool, self.sizes = model, pool, sizes
        self.scratch_slot = scratch_slot
        self.batches = {n: model.attention.graph_batch(n, max_pages=16) for n in sizes}
        self.replayed_rows: list[int] = []

    def run(self, step: StepRows) -> torch.Tensor:
        size = graph_bucket(step, self.sizes)
        assert size is not None
        self.model.attention.fill(PaddedDecode(step, size, self.scratch_slot))
        hidden = self.model.forward(self.batches[size], self.pool)
        self.replayed_rows.append(hidden.shape[0])
        return hidden[: step.num_rows]


def test_the_lm_head_sees_only_the_rows_that_sample_on_the_graph_path() -> None:
    """A runner whose decode steps take the graph path (graphs of 1, 2, 4; replayed by a CPU
    stand-in, Triton interpreted): 3 decodes replay the graph of 4 rows and the LM head runs
    on 3; a prefill step whose first chunk does not sample runs the head on 1 row. Greedy
    tokens equal the eager runner's."""
    hf = tiny_hf("llama-gqa")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    options = RunnerOptions(
        num_blocks=8,
        block_size=4,
        kv_dtype="float32",
        dtype="float32",
        device="cpu",
        attention_backend="triton",
        use_onednn=False,
    )
    runners = [TorchRunner(our_config(hf), state, options) for _ in range(2)]
    graphed = runners[1]
    model = graphed.model
    graphs = ReplayStandIn(model, graphed.pool, (1, 2, 4), scratch_slot=7 * 4)
    graphed.paths = ForwardPaths(
        EagerPath(model, graphed.pool, graphed.paths.eager.lora), graphs=GraphPath(graphs)
    )  # type: ignore[arg-type]
    head_rows: list[int] = []
    compute_logits = model.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor:
        head_rows.append(hidden.shape[0])
        return compute_logits(hidden)

    model.compute_logits = counted  # type: ignore[method-assign]
    ids = [random_ids(6, seed=s) for s in range(3)]
    tables = [[0, 1], [2, 3], [4, 5]]
    prefill = plan(0, prefill=[
        seq("a", ids[0], 0, 2, tables[0], do_sample=False),
        seq("b", ids[1], 0, 5, tables[1]),
        seq("c", ids[2], 0, 5, tables[2]),
    ])  # fmt: skip
    outs = [r.execute(prefill) for r in runners]
    assert head_rows == [2] and graphs.replayed_rows == []
    decode = plan(1, decode=[seq(r, ids[i], 5 if r != "a" else 2, 6 if r != "a" else 3,
                                 tables[i]) for i, r in enumerate("abc")])  # fmt: skip
    outs += [r.execute(decode) for r in runners]
    assert graphs.replayed_rows == [4] and head_rows == [2, 3]
    assert outs[0].sampled_token_ids == outs[1].sampled_token_ids
    assert outs[2].sampled_token_ids == outs[3].sampled_token_ids
    assert set(outs[3].sampled_token_ids) == {"a", "b", "c"}
