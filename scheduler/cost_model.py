"""An online model of one engine step's wall time, fitted while serving. No torch, no clock.

The scheduler controls a step's shape, and the shape sets its cost::

    time_s ~ c0                       fixed: weights streamed once, launches, sampling
           + c1 * prefill_tokens      prefill FLOPs (linear layers)
           + c2 * decode_seqs         one token per decode: its linear layers and logits
           + c3 * prefill_attention   (query, key) pairs of the prefill chunks
           + c4 * decode_context      KV positions the decodes read
           + c5 * has_prefill         1 if the step has a prefill chunk: a fixed cost of
                                      such steps (fitted 22 ms on the 2-core CPU, where
                                      every step is one fused kernel call)

A chunk of ``n`` new tokens after ``s`` computed ones attends over ``n*s + n*(n+1)/2``
pairs (causal); a decode reads ``s + 1`` positions. The coefficients are fitted by recursive
least squares (RLS) with a forgetting factor, one O(k^2) update per step (k = 6): the engine
feeds it ``observe(shape, seconds)`` after every step, so the model follows the machine it
runs on (another process taking a core, longer contexts, a different model) within tens of
steps. It starts from a prior: coefficients fitted to a short calibration run at start-up,
or to the SimRunner's roofline for a named device (``fit`` does both, by least squares over
measured or simulated steps).

Decode-only steps make ``decode_seqs`` and ``decode_context`` move together, and a
forgetting factor lets the covariance grow without bound in directions the recent steps do
not excite ("covariance wind-up"), after which one odd step can throw the fit far off. The
covariance's trace is therefore capped (``TRACE_CAP`` times the prior's): forgetting pauses
while the fit is that uncertain.

A step far slower than its prediction is clipped before it is folded in (a Huber-style
update): its error counts as at most ``OUTLIER_SCALES`` typical errors, or
``OUTLIER_MIN_RATIO`` times the prediction if that is more. On the shared 2-core machine one
128-token prefill took 1.04 s instead of the 0.26 s it takes (another process had the
cores); folded in whole, it raised the predicted mixed step to the 150 ms target for steps
that took 40-60 ms, and the slo policy admitted nothing for 9 steps and ran prefill chunks
of 16-45 tokens for the next 30: it throttled for no one's benefit. A lasting change still
moves the fit: the typical error grows with it, and the bound with that. Errors the other
way (faster than predicted) are bounded by the prediction itself and are not clipped.

Two variants lost in the simulated comparison (``kvserve simulate --compare``): projecting
the coefficients onto >= 0 after each update (the fit's covariance no longer matches its
coefficients, the intercept stays high, admissions stall), and weighting the online updates
by relative error (the H100 roofline's max(compute, memory) is not linear, and relative
weights chase the small steps). Features are scaled to be O(1) for typical steps
(``SCALES``) so the update is well conditioned in float64.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from scheduler.output import SchedulerOutput

FEATURES = (
    "intercept",
    "prefill_tokens",
    "decode_seqs",
    "prefill_attention",
    "decode_context",
    "has_prefill",
)
# Divisors that bring each feature to O(1) on a typical step.
SCALES = (1.0, 1024.0, 64.0, 1024.0 * 1024.0, 64.0 * 1024.0, 1.0)
_K = len(FEATURES)
# The covariance's trace may grow to this multiple of the prior's, no further (wind-up).
TRACE_CAP = 10.0
# Outliers: a step slower than predicted by more than OUTLIER_SCALES typical errors (an
# exponential average of |error|, weight ERROR_EMA) and OUTLIER_MIN_RATIO x the prediction
# is folded in as if it were only that much slower.
OUTLIER_SCALES = 4.0
OUTLIER_MIN_RATIO = 0.5
ERROR_EMA = 0.1


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step computes, as far as its cost goes (see the module docstring)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    prefill_attention: int = 0
    decode_context: int = 0
    prefill_chunks: int = 0

    @staticmethod
    def chunk_attention(num_new: int, start: int) -> int:
        """(query, key) pairs of a causal chunk of ``num_new`` tokens after ``start``."""
        return num_new * start + num_new * (num_new + 1) // 2

    @classmethod
    def of(cls, prefill: Iterable[tuple[int, int]], decode_starts: Iterable[int]) -> StepShape:
        """The shape of prefill chunks ``(num_new, start)`` and decodes at ``start``."""
        tokens = attention = chunks = 0
        for n, s in prefill:
            tokens += n
            attention += cls.chunk_attention(n, s)
            chunks += 1
        seqs = context = 0
        for s in decode_starts:
            seqs += 1
            context += s + 1
        return cls(tokens, seqs, attention, context, chunks)

    @classmethod
    def of_plan(cls, plan: SchedulerOutput) -> StepShape:
        """A plan's shape. A decode with k speculative drafts is a decode plus k tokens
        right after it (its verification rows, on the decode path: not a prefill chunk)."""
        shape = cls.of(
            ((len(s.token_ids), s.start_pos) for s in plan.prefill),
            (s.start_pos for s in plan.decode),
        )
        for s in plan.decode:
            if len(s.token_ids) > 1:
                shape = shape.with_drafts(len(s.token_ids) - 1, s.start_pos)
        return shape

    def with_drafts(self, num_drafts: int, start: int) -> StepShape:
        """This shape plus the verification rows of a decode at ``start`` with
        ``num_drafts`` speculative drafts: tokens and attention like a chunk after it, but
        on the decode path (not a prefill chunk)."""
        return replace(
            self,
            prefill_tokens=self.prefill_tokens + num_drafts,
            prefill_attention=self.prefill_attention + self.chunk_attention(num_drafts, start + 1),
        )

    def with_chunk(self, num_new: int, start: int) -> StepShape:
        """This shape plus one prefill chunk."""
        return StepShape(
            self.prefill_tokens + num_new,
            self.decode_seqs,
            self.prefill_attention + self.chunk_attention(num_new, start),
            self.decode_context,
            self.prefill_chunks + (num_new > 0),
        )

    def with_decode(self, context: int) -> StepShape:
        """This shape plus one decode over ``context`` positions (its new token included)."""
        return StepShape(
            self.prefill_tokens,
            self.decode_seqs + 1,
            self.prefill_attention,
            self.decode_context + context,
            self.prefill_chunks,
        )

    @property
    def is_empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0

    def features(self) -> tuple[float, ...]:
        return (
            1.0,
            self.prefill_tokens / SCALES[1],
            self.decode_seqs / SCALES[2],
            self.prefill_attention / SCALES[3],
            self.decode_context / SCALES[4],
            1.0 if self.prefill_chunks else 0.0,
        )


class CostPredictor(Protocol):
    """What the scheduler asks of a cost model (tests script it)."""

    def predict(self, shape: StepShape) -> float: ...


class StepCostModel:
    """Recursive least squares over ``StepShape.features``; see the module docstring.

    ``prior_s``: seconds per unit of each raw feature (``FEATURES`` order).
    ``prior_weight``: how many steps' worth of evidence the prior counts as (the initial
    covariance is ``I / prior_weight``).
    ``forgetting``: RLS forgetting factor; observations ``m`` steps old weigh
    ``forgetting**m`` (0.98: a half-life of ~34 steps).
    """

    def __init__(
        self,
        prior_s: Sequence[float],
        *,
        prior_weight: float = 4.0,
        forgetting: float = 0.98,
    ) -> None:
        if len(prior_s) != _K:
            raise ValueError(f"prior_s needs {_K} coefficients ({', '.join(FEATURES)})")
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self._theta = [c * scale for c, scale in zip(prior_s, SCALES, strict=True)]
        p0 = 1.0 / prior_weight
        self._p = [[p0 if i == j else 0.0 for j in range(_K)] for i in range(_K)]
        self._max_trace = p0 * _K * TRACE_CAP
        self._lambda = forgetting
        self._error_scale_s: float | None = None  # typical |error| of the online updates
        self.num_observations = 0

    @classmethod
    def fit(
        cls,
        samples: Sequence[tuple[StepShape, float]],
        *,
        prior_weight: float = 4.0,
        forgetting: float = 0.98,
    ) -> StepCostModel:
        """A model whose prior is the least-squares fit (of relative error) of ``samples``
        (shape, seconds): calibration steps, or a roofline's predictions over a grid."""
        # Relative error: each row divided by its time, so a 10 ms decode step counts as much
        # as a 2 s prefill. (The online updates weigh absolute error: with forgetting, the
        # steps near the ITL target, the ones that matter, dominate them anyway.)
        kept = [(s, t) for s, t in samples if t > 0 and not s.is_empty]
        xs = [tuple(v / t for v in s.features()) for s, t in kept]
        theta = _least_squares(xs, [1.0] * len(xs))
        prior = [c / scale for c, scale in zip(theta, SCALES, strict=True)]
        return cls(prior, prior_weight=prior_weight, forgetting=forgetting)

    def predict(self, shape: StepShape) -> float:
        """Predicted wall time of a step of ``shape`` (0 for an empty step)."""
        if shape.is_empty:
            return 0.0
        x = shape.features()
        return max(0.0, sum(t * v for t, v in zip(self._theta, x, strict=True)))

    def observe(self, shape: StepShape, seconds: float) -> float:
        """Fold one measured step into the fit; return what was predicted for it."""
        if shape.is_empty or not math.isfinite(seconds) or seconds < 0:
            return 0.0
        predicted = self.predict(shape)
        if seconds <= 0:
            return predicted
        x = shape.features()
        p = self._p
        lam = self._lambda
        px = [sum(p[i][j] * x[j] for j in range(_K)) for i in range(_K)]
        denom = lam + sum(x[i] * px[i] for i in range(_K))
        gain = [v / denom for v in px]
        linear = sum(t * v for t, v in zip(self._theta, x, strict=True))
        error = seconds - linear
        scale = self._error_scale_s
        if scale is not None:  # slower than predicted by far: an outlier (module docstring)
            error = min(error, max(OUTLIER_SCALES * scale, OUTLIER_MIN_RATIO * abs(linear)))
        self._error_scale_s = (
            abs(error) if scale is None else scale + ERROR_EMA * (abs(error) - scale)
        )
        self._theta = [t + g * error for t, g in zip(self._theta, gain, strict=True)]
        # P = (P - g x^T P) / lambda, with the trace capped (no wind-up; module docstring).
        new_p = [[p[i][j] - gain[i] * px[j] for j in range(_K)] for i in range(_K)]
        trace = sum(new_p[i][i] for i in range(_K))
        scale = 1.0 / lam if trace / lam <= self._max_trace else 1.0
        self._p = [[v * scale for v in row] for row in new_p]
        self.num_observations += 1
        return predicted

    @property
    def coefficients_s(self) -> tuple[float, ...]:
        return tuple(t / scale for t, scale in zip(self._theta, SCALES, strict=True))


def _least_squares(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """argmin ||X theta - y||^2 + 1e-9 ||theta||^2, by the normal equations (k = 5)."""
    if not xs:
        raise ValueError("a fit needs at least one sample")
    a = [
        [sum(x[i] * x[j] for x in xs) + (1e-9 if i == j else 0.0) for j in range(_K)]
        for i in range(_K)
    ]
    b = [sum(x[i] * y for x, y in zip(xs, ys, strict=True)) for i in range(_K)]
    return _solve(a, b)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is k x k, symmetric positive definite
    up to the ridge term)."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        lead = m[col][col]
        if lead == 0.0:
            continue
        for r in range(col + 1, n):
            factor = m[r][col] / lead
            if factor:
                for c in range(col, n + 1):
                    m[r][c] -= factor * m[col][c]
    theta = [0.0] * n
    for r in range(n - 1, -1, -1):
        lead = m[r][r]
        acc = m[r][n] - sum(m[r][c] * theta[c] for c in range(r + 1, n))
        theta[r] = acc / lead if lead else 0.0
    return theta
