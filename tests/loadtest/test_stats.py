"""Percentiles and per-request latency figures from known synthetic timings."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loadtest.stats import SLO, Outcome, RequestResult, latency_summary, percentile, summarize


def _result(
    send_s: float,
    arrivals: list[tuple[float, int]],
    end_s: float,
    outcome: str = Outcome.OK,
    index: int = 0,
) -> RequestResult:
    return RequestResult(
        index=index,
        request_id=f"r{index}",
        priority=0,
        num_prompt_tokens=8,
        max_tokens=16,
        cancel_after_tokens=None,
        send_s=send_s,
        outcome=outcome,
        end_s=end_s,
        token_arrivals=arrivals,
    )


def test_percentile_of_101_samples_is_the_sample_at_rank_p() -> None:
    """With 101 samples the rank p/100*(n-1) is p itself: p50/p90/p99 are exact samples."""
    samples = [float(i * 3) for i in range(101)]
    random.Random(0).shuffle(samples)
    assert percentile(samples, 50) == 150.0
    assert percentile(samples, 90) == 270.0
    assert percentile(samples, 99) == 297.0
    assert percentile(samples, 0) == 0.0
    assert percentile(samples, 100) == 300.0


def test_percentile_interpolates_linearly_between_ranks() -> None:
    """Rank 1.5 of [1, 2, 4, 8, 16] lies halfway between 2 and 4; rank 3.25 a quarter past 8."""
    samples = [16.0, 1.0, 8.0, 2.0, 4.0]
    assert percentile(samples, 37.5) == 3.0
    assert percentile(samples, 81.25) == 10.0


def test_percentile_edge_cases() -> None:
    """One sample is every percentile; no sample gives None; p outside [0, 100] raises."""
    assert percentile([0.25], 99) == 0.25
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="101"):
        percentile([1.0], 101)


def test_percentile_matches_numpy_default_method() -> None:
    """The definition is numpy.percentile's default (linear) on random data."""
    rng = random.Random(1)
    for n in (2, 3, 7, 50, 333):
        samples = [rng.lognormvariate(0, 1) for _ in range(n)]
        for p in (0, 1, 12.5, 50, 90, 99, 99.9, 100):
            assert percentile(samples, p) == pytest.approx(
                float(np.percentile(samples, p)), rel=1e-12
            )


def test_summarize_keys_and_values() -> None:
    """summarize gives count, mean, p50, p90, p99, min, max (None-valued when empty)."""
    samples = [float(i) for i in range(101)]
    assert summarize(samples) == {
        "count": 101,
        "mean": 50.0,
        "p50": 50.0,
        "p90": 90.0,
        "p99": 99.0,
        "min": 0.0,
        "max": 100.0,
    }
    assert summarize([]) == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
        "min": None,
        "max": None,
    }


def test_request_figures_from_token_arrivals() -> None:
    """TTFT, TPOT, e2e and ITL samples (a 2-token message splits its gap) of one request."""
    r = _result(10.0, [(10.5, 1), (10.75, 1), (11.25, 2), (11.5, 1)], end_s=11.75)
    assert r.num_output_tokens == 5
    assert r.ttft_s == 0.5
    assert r.e2e_s == 1.75
    assert r.tpot_s == 0.25  # (11.5 - 10.5) / 4
    assert r.itl_samples() == [0.25, 0.25, 0.25, 0.25]
    one = _result(0.0, [(0.5, 1)], end_s=0.5)
    assert one.tpot_s is None
    assert one.itl_samples() == []


def test_latency_summary_uses_only_ok_requests() -> None:
    """Cancelled / failed requests are not timed; ITL pools the OK requests' samples."""
    results = [
        _result(0.0, [(1.0, 1), (1.5, 1), (2.5, 1)], 2.5, index=0),
        _result(0.0, [(2.0, 1), (2.25, 1)], 2.25, index=1),
        _result(0.0, [(0.125, 1)], 0.25, outcome=Outcome.CANCELLED, index=2),
        _result(0.0, [], 0.125, outcome=Outcome.FAILED, index=3),
    ]
    s = latency_summary(results)
    assert s["ttft"] == summarize([1.0, 2.0])
    assert s["itl"] == summarize([0.5, 1.0, 0.25])
    assert s["tpot"] == summarize([0.75, 0.25])
    assert s["e2e"] == summarize([2.5, 2.25])


def test_slo_requires_ok_and_both_limits() -> None:
    """A request meets the SLO only when OK, TTFT <= limit and TPOT <= limit."""
    slo = SLO(ttft_s=1.0, tpot_s=0.5)
    assert slo.met_by(_result(0.0, [(1.0, 1), (1.5, 1)], 1.5))
    assert not slo.met_by(_result(0.0, [(1.25, 1), (1.5, 1)], 1.5))
    assert not slo.met_by(_result(0.0, [(0.5, 1), (1.25, 1)], 1.25))
    assert not slo.met_by(_result(0.0, [(0.5, 1)], 0.5, outcome=Outcome.CANCELLED))
    assert SLO().met_by(_result(0.0, [(9.0, 1)], 9.0))
    with pytest.raises(ValueError, match="-1"):
        SLO(ttft_s=-1)


def test_tpot_is_the_mean_itl_when_the_first_message_carries_several_tokens() -> None:
    """First message 3 tokens at 1.0, then 1 token at 1.5 and 2 tokens at 2.5: ITL samples are
    0.5, 0.5, 0.5 (3 = 6 - 3 of them) and TPOT = (2.5 - 1.0) / 3 = 0.5, their mean."""
    r = _result(0.0, [(1.0, 3), (1.5, 1), (2.5, 2)], 2.6)
    assert r.itl_samples() == [0.5, 0.5, 0.5]
    assert r.tpot_s == 0.5
    assert _result(0.0, [(1.0, 4)], 1.1).tpot_s is None  # every token in one message
