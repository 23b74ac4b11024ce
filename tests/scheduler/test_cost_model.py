"""The online step-cost model: exact shapes, least-squares priors, RLS tracking, no wind-up."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest

from scheduler.cost_model import FEATURES, StepCostModel, StepShape
from tests.scheduler.helpers import make_request, make_runner, make_scheduler

TRUE_S = (4e-3, 0.8e-3, 1.5e-3, 2e-9, 3e-7, 5e-3)  # per unit of each raw feature


def _truth(shape: StepShape) -> float:
    raw = (
        1.0,
        shape.prefill_tokens,
        shape.decode_seqs,
        shape.prefill_attention,
        shape.decode_context,
        1 if shape.prefill_chunks else 0,
    )
    return sum(c * v for c, v in zip(TRUE_S, raw, strict=True))


def _random_shape(rng: random.Random) -> StepShape:
    prefill = [(rng.randint(1, 512), rng.randint(0, 2048)) for _ in range(rng.randint(0, 3))]
    decodes = [rng.randint(1, 4096) for _ in range(rng.randint(0, 64))]
    if not prefill and not decodes:
        decodes = [10]
    return StepShape.of(prefill, decodes)


def test_shape_counts_tokens_seqs_attention_pairs_and_context() -> None:
    """A step's shape counts prefill tokens, decodes, causal attention pairs and decode context."""
    shape = StepShape.of([(4, 0), (3, 10)], [5, 7])
    # Causal pairs: 4*0 + 4*5/2 = 10; 3*10 + 3*4/2 = 36. Decodes read start + 1 positions.
    assert shape == StepShape(
        prefill_tokens=7, decode_seqs=2, prefill_attention=46, decode_context=14, prefill_chunks=2
    )
    assert shape.with_chunk(2, 1) == StepShape(9, 2, 46 + 2 + 3, 14, 3)
    assert shape.with_decode(9) == StepShape(7, 3, 46, 23, 2)
    assert StepShape().is_empty and not shape.is_empty


def test_shape_of_a_real_plan() -> None:
    """StepShape.of_plan reads a plan: a 5-token prefill, then a decode beside a prefill."""
    sched, kv = make_scheduler(num_blocks=16, max_num_batched_tokens=16)
    runner = make_runner(kv)
    sched.add_request(make_request("a", prompt_len=5, max_tokens=3))
    first = sched.schedule()
    assert StepShape.of_plan(first) == StepShape(5, 0, 15, 0, 1)
    sched.update(first, runner.execute(first))
    sched.add_request(make_request("b", prompt_len=3, max_tokens=3, first_token=300))
    plan = sched.schedule()
    # a decodes at position 5 (6 positions read); b prefills 3 tokens.
    assert StepShape.of_plan(plan) == StepShape(3, 1, 6, 6, 1)


def test_shape_of_a_plan_costs_speculative_drafts_as_a_chunk_after_the_decode() -> None:
    """A decode at position 9 with 3 drafts: one decode over 10 positions, and 3 tokens
    after 10 computed positions (its verification rows, not a prefill chunk)."""
    seq = SimpleNamespace(token_ids=[5, 6, 7, 8], start_pos=9)
    plan = SimpleNamespace(prefill=[], decode=[seq])
    assert StepShape.of_plan(plan) == StepShape(3, 1, 3 * 10 + 6, 10, 0)  # type: ignore[arg-type]


def test_fit_recovers_a_linear_truth_exactly() -> None:
    """Least squares over 200 random shapes recovers the true per-feature coefficients."""
    rng = random.Random(0)
    samples = [(s, _truth(s)) for s in (_random_shape(rng) for _ in range(200))]
    model = StepCostModel.fit(samples)
    for got, want in zip(model.coefficients_s, TRUE_S, strict=True):
        assert got == pytest.approx(want, rel=1e-4)
    shape = StepShape.of([(100, 50)], [300] * 8)
    assert model.predict(shape) == pytest.approx(_truth(shape), rel=1e-6)
    assert model.predict(StepShape()) == 0.0


def test_rls_converges_from_a_wrong_prior() -> None:
    """Recursive least squares from a prior 3x off predicts within 1 % once the prior decays."""
    rng = random.Random(1)
    model = StepCostModel([c * 3.0 for c in TRUE_S], forgetting=0.98)
    errors = []  # |predicted - measured| / measured, as observe() predicted each step
    for _ in range(400):
        shape = _random_shape(rng)
        predicted = model.observe(shape, _truth(shape))
        errors.append(abs(predicted - _truth(shape)) / _truth(shape))
    assert errors[0] == pytest.approx(2.0)  # the prior was 3x off
    # The prior's weight decays as 0.98^n: over the last 256 steps the fit is within 1 %.
    assert statistics.median(errors[-256:]) < 0.01
    assert model.num_observations == 400
    assert len(model.coefficients_s) == len(FEATURES)
    assert errors[-1] < 1e-3


def test_rls_follows_a_machine_that_slows_down() -> None:
    """The same shapes suddenly take twice as long (another process took a core): within 300
    steps the predictions are within 3 % again."""
    rng = random.Random(2)
    model = StepCostModel(TRUE_S)
    for _ in range(100):
        shape = _random_shape(rng)
        model.observe(shape, _truth(shape))
    for _ in range(300):
        shape = _random_shape(rng)
        model.observe(shape, 2 * _truth(shape))
    shape = StepShape.of([(64, 0)], [512] * 16)
    assert model.predict(shape) == pytest.approx(2 * _truth(shape), rel=0.03)


def test_no_covariance_wind_up_on_decode_only_steps() -> None:
    """Thousands of decode-only steps excite two directions; the forgotten ones must not blow
    up: the covariance trace stays within its cap, and a prefill step afterwards is
    still predicted sensibly (the prior's prefill coefficient survives)."""
    model = StepCostModel(TRUE_S, prior_weight=4.0, forgetting=0.9)
    for i in range(5000):
        shape = StepShape.of([], [1000 + i % 7] * 8)
        model.observe(shape, _truth(shape))
    trace = sum(model._p[i][i] for i in range(len(FEATURES)))
    assert trace <= model._max_trace * (1 + 1e-9)
    prefill = StepShape.of([(512, 0)], [])
    assert model.predict(prefill) == pytest.approx(_truth(prefill), rel=0.05)


def test_bad_measurements_are_ignored() -> None:
    """NaN, infinite, negative times and empty steps change neither the count nor the fit."""
    model = StepCostModel(TRUE_S)
    shape = StepShape.of([], [10])
    for bad in (float("nan"), float("inf"), -1.0):
        assert model.observe(shape, bad) == 0.0
    assert model.observe(StepShape(), 1.0) == 0.0
    assert model.num_observations == 0
    assert model.coefficients_s == pytest.approx(TRUE_S)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prior_s": (1.0,)}, "needs 6 coefficients"),
        ({"prior_s": TRUE_S, "forgetting": 0.0}, "forgetting"),
        ({"prior_s": TRUE_S, "prior_weight": 0.0}, "prior_weight"),
    ],
)
def test_invalid_parameters(kwargs: dict[str, object], match: str) -> None:
    """A prior of the wrong length, a zero forgetting factor or prior weight: ValueError."""
    with pytest.raises(ValueError, match=match):
        StepCostModel(**kwargs)  # type: ignore[arg-type]


def test_a_step_far_slower_than_predicted_counts_as_only_1_5x() -> None:
    """After 50 exact steps (typical error ~0), a step 4x slower than its prediction moves
    the fit exactly as a step 1.5x slower would (OUTLIER_MIN_RATIO 0.5): one noisy step
    cannot throw the model off. A step 1.2x slower is folded in as it is."""
    rng = random.Random(3)
    shapes = [_random_shape(rng) for _ in range(50)]
    odd = StepShape.of([(128, 0)], [])
    fits = []
    for factor in (4.0, 1.5, 1.2):
        model = StepCostModel(TRUE_S)
        for shape in shapes:
            model.observe(shape, _truth(shape))
        model.observe(odd, factor * _truth(odd))
        fits.append(model.coefficients_s)
    assert fits[0] == pytest.approx(fits[1], rel=1e-9)
    assert fits[2] != pytest.approx(fits[1], rel=1e-3)
    model = StepCostModel(TRUE_S)
    for shape in shapes:
        model.observe(shape, _truth(shape))
    assert model.predict(odd) == pytest.approx(_truth(odd), rel=1e-6)
