"""The path chooser: which of the fused step, the CUDA graphs and the eager path runs a step
(the paths' kernels are stand-ins here: only ``fits`` and ``choose`` run)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from model_runner.paths import EagerPath, ForwardPaths, FusedPath, GraphPath, skips_released
from model_runner.step import StepRows
from scheduler.output import ScheduledSeq
from tests.model_runner.oracle import seq

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
    paths = ForwardPaths(EagerPath(STANDIN, STANDIN), graphs=GraphPath(STANDIN))
    drafts = StepRows.from_seqs([], [_draft("v", 4, 2, [4, 5])], 4)
    prefill = StepRows.from_seqs([seq("p", IDS, 0, 3, [6])], [], 4)
    assert paths.choose(drafts).name == "graphs"
    assert paths.choose(prefill).name == "eager"
    assert paths.choose(_decodes(5)).name == "eager"


def test_the_fused_path_comes_first_up_to_its_row_bound() -> None:
    """FusedPath(max_rows=4) before graphs of (1, 2, 4): 4 decode rows take the fused path,
    a 4-row prefill chunk too; 5 rows fall through to the eager path (no bucket holds them)."""
    fused = FusedPath(STANDIN, None, max_rows=4)
    paths = ForwardPaths(EagerPath(STANDIN, STANDIN), fused, GraphPath(STANDIN))
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
