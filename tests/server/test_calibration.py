"""The step-cost model's calibration rounds (server/calibration.py): the shapes they run.

The seconds are the machine's; the shapes are exact, and the speculative rounds must put
draft rows on decodes (the shapes ``benchmarks/bench_cost_model.py`` holds the model to)."""

from __future__ import annotations

from collections.abc import Sequence

from cache_manager import KVCacheConfig
from model_runner.fake import FakeRunner
from scheduler.cost_model import StepCostModel, StepShape
from scheduler.output import ScheduledSeq
from server.calibration import ROUNDS, calibrate, run_rounds
from tests.server.helpers import fake_info

CACHE = KVCacheConfig(num_blocks=512, block_size=16)


class PhraseRunner(FakeRunner):
    """Continues every sequence with period 8, as a model continues a repeated phrase: the
    n-gram drafter's guesses are right."""

    def token_for(self, seq: ScheduledSeq, offset: int = 0) -> int:
        ids = seq.all_token_ids
        return ids[len(ids) - 8 + offset]


def shapes(samples: Sequence[tuple[StepShape, float]]) -> list[StepShape]:
    return [shape for shape, _ in samples]


def test_rounds_run_chunks_then_decodes() -> None:
    """(1 request, 64-token prompt, chunks of 32, 4 out): two chunks, then 3 decodes."""
    runner = FakeRunner(fake_info(1024))
    got = shapes(run_rounds(runner, CACHE, 1024, [(1, 64, 32, 4)]))
    assert got == [
        StepShape(32, 0, 32 * 33 // 2, 0, 1),
        StepShape(32, 0, 32 * 32 + 32 * 33 // 2, 0, 1),
        StepShape(0, 1, 0, 65, 0),
        StepShape(0, 1, 0, 66, 0),
        StepShape(0, 1, 0, 67, 0),
    ]


def test_speculative_rounds_put_draft_rows_on_decodes() -> None:
    """A repeated 8-token phrase: after the prompt, each decode carries 3 drafts, all accepted
    (4 tokens a step), and the last carries what max_tokens leaves."""
    runner = PhraseRunner(fake_info(1024))
    got = shapes(run_rounds(runner, CACHE, 1024, [(1, 32, 32, 7)], speculative=True))
    assert got == [
        StepShape(32, 0, 32 * 33 // 2, 0, 1),
        StepShape(0, 1, 0, 33, 0).with_drafts(3, 32),
        StepShape(0, 1, 0, 37, 0).with_drafts(1, 36),
    ]
    assert got[1] == StepShape(3, 1, 3 * 33 + 6, 33, 0)


def test_calibration_fits_every_round_but_the_cold_first_step() -> None:
    """The scripted rounds run every prompt token once and every decode to its output count,
    and ``calibrate`` fits a six-coefficient step-cost model from them."""
    runner = FakeRunner(fake_info(2048))
    samples = run_rounds(runner, CACHE, 2048, ROUNDS)
    model = calibrate(runner, CACHE, 2048)
    assert isinstance(model, StepCostModel) and len(model.coefficients_s) == 6
    # every round's steps: prompts in chunks, then decodes to the round's output count
    assert sum(s.decode_seqs for s in shapes(samples)) == sum(
        n * (out - 1) for n, _, _, out in ROUNDS
    )
    assert sum(s.prefill_tokens for s in shapes(samples)) == sum(n * p for n, p, _, _ in ROUNDS)
