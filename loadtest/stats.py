"""Latency statistics of one load-test run: exact percentiles, per-request metrics, goodput.

Definitions (every figure in a report follows them):

- **percentile(p)**: linear interpolation between the two closest ranks, the default method of
  ``numpy.percentile``: sort the n samples ``x[0] <= ... <= x[n-1]``, let ``r = p/100 * (n-1)``;
  the value is ``x[floor(r)] + (x[ceil(r)] - x[floor(r)]) * (r - floor(r))``. One sample gives
  that sample for every p; no sample gives None.
- **TTFT**: send of the request to arrival of the first message carrying a token.
- **inter-token latency (ITL)**: the gap between two consecutive token-carrying messages of one
  stream. A message carrying k > 1 tokens contributes k samples of ``gap / k`` (so the ITL
  samples of a request sum to ``last_token - first_token`` and number ``output_tokens - k1``,
  k1 being the tokens of the first message, normally 1).
- **TPOT** (time per output token): per request, ``(last_token - first_token) / (n - k1)`` for
  a request with n output tokens, n > k1. The mean of its ITL samples.
- **e2e**: send to the end of the stream.

Latency distributions are computed over requests that finished OK (cancelled, failed and
interrupted requests are counted, not timed), except ITL, which pools the samples of those
same requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from scheduler.slo import attained, time_per_output_token

PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def percentile(samples: Sequence[float], p: float) -> float | None:
    """The p-th percentile (0 <= p <= 100) by linear interpolation; None for no samples."""
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    if not samples:
        return None
    xs = sorted(samples)
    rank = p / 100.0 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(samples: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99, min and max of ``samples`` (None where there are none)."""
    out: dict[str, float | int | None] = {"count": len(samples)}
    out["mean"] = sum(samples) / len(samples) if samples else None
    for p in PERCENTILES:
        out[f"p{p:g}"] = percentile(samples, p)
    out["min"] = min(samples) if samples else None
    out["max"] = max(samples) if samples else None
    return out


class Outcome:
    """How a request ended, from the client's side."""

    OK = "ok"  # the stream ended with a finish message (stop or length)
    CANCELLED = "cancelled"  # the load generator cancelled it on purpose (workload `cancel`)
    FAILED = "failed"  # a gRPC error, or a stream that finished with ERROR / ABORT by the server
    INTERRUPTED = "interrupted"  # still running when the time bound hit; cancelled then


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request. Times are ``time.perf_counter()`` seconds."""

    index: int
    request_id: str
    priority: int
    num_prompt_tokens: int  # as the server reported it (Usage), else as the client sent it
    max_tokens: int
    cancel_after_tokens: int | None
    send_s: float
    outcome: str = Outcome.FAILED
    code: str = "OK"  # gRPC status code name, or FINISH_REASON_* for an in-stream failure
    error: str = ""
    end_s: float = 0.0
    # (arrival time, number of tokens) for each message that carried tokens.
    token_arrivals: list[tuple[float, int]] = field(default_factory=list)
    num_cached_tokens: int = 0
    finish_reason: str = ""

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.token_arrivals)

    @property
    def ttft_s(self) -> float | None:
        return self.token_arrivals[0][0] - self.send_s if self.token_arrivals else None

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def tpot_s(self) -> float | None:
        if not self.token_arrivals:
            return None
        # Tokens after the first message: the first message's k tokens arrived at TTFT.
        first, last = self.token_arrivals[0], self.token_arrivals[-1]
        return time_per_output_token(first[0], last[0], self.num_output_tokens - first[1])

    def itl_samples(self) -> list[float]:
        """Inter-token gaps; a message with k tokens gives k samples of gap / k."""
        out: list[float] = []
        for (t_prev, _), (t, k) in zip(self.token_arrivals, self.token_arrivals[1:], strict=False):
            out.extend([(t - t_prev) / k] * k)
        return out


@dataclass(frozen=True, slots=True)
class SLO:
    """Goodput limits: a request counts when it finished OK within both (None = no limit)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"SLO {name} must be > 0, got {value}")

    def met_by(self, r: RequestResult) -> bool:
        """Finished OK within both limits (a one-token answer has no TPOT to break)."""
        met = attained(r.ttft_s, r.tpot_s, self.ttft_s, self.tpot_s)
        return r.outcome == Outcome.OK and all(met)


def latency_summary(results: Iterable[RequestResult]) -> dict[str, dict[str, float | int | None]]:
    """TTFT / ITL / TPOT / e2e summaries over the requests that finished OK."""
    ok = [r for r in results if r.outcome == Outcome.OK]
    ttft = [t for r in ok if (t := r.ttft_s) is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    itl = [x for r in ok for x in r.itl_samples()]
    e2e = [r.e2e_s for r in ok]
    return {
        "ttft": summarize(ttft),
        "itl": summarize(itl),
        "tpot": summarize(tpot),
        "e2e": summarize(e2e),
    }
