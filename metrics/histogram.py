"""Histogram buckets and the lock-free bucket counter the Prometheus sink keeps.

The histograms are kept by the sink (bucket counts under its one lock) rather than as
prometheus-client ``Histogram`` objects: one lock per step instead of one per observation, a
request's inter-token gaps are observed in one call, and the exposition carries no
``_created`` series.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client.utils import floatToGoString

# --- histogram buckets (upper bounds). They span a GPU (ms steps) and a CPU (s steps). ---
TTFT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
INTER_TOKEN_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
TOKEN_COUNT_BUCKETS = (
    1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip
STEP_DURATION_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
SCHEDULER_CPU_BUCKETS_S = (
    0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
    0.025, 0.05, 0.1,
)  # fmt: skip
STEP_PREFILL_TOKEN_BUCKETS = (
    0, 1, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)  # fmt: skip
STEP_REQUEST_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
PREDICTION_ERROR_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class Histogram:
    """Bucket counts and a sum; the owner serializes access with its lock."""

    __slots__ = ("counts", "le_labels", "sum", "upper_bounds")

    def __init__(self, upper_bounds: Sequence[float]) -> None:
        bounds = tuple(float(b) for b in upper_bounds)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"bucket bounds must be strictly increasing, got {bounds}")
        self.upper_bounds = bounds
        self.le_labels = [_go_float(b) for b in bounds]  # the "le" label values, made once
        self.counts = [0] * (len(bounds) + 1)  # last slot: above the largest bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return
        # bisect_left: the first bound >= value, i.e. the "le" bucket the value belongs to.
        self.counts[bisect_left(self.upper_bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: Iterable[float]) -> None:
        counts, bounds = self.counts, self.upper_bounds
        total = 0.0
        for value in values:
            if math.isnan(value):
                continue
            value = max(0.0, value)
            counts[bisect_left(bounds, value)] += 1
            total += value
        self.sum += total

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        buckets: list[tuple[str, float]] = []
        running = 0
        for le, count in zip(self.le_labels, self.counts, strict=False):
            running += count
            buckets.append((le, float(running)))
        running += self.counts[-1]
        buckets.append(("+Inf", float(running)))
        return buckets, self.sum


def _go_float(value: float) -> str:
    """A bucket bound as Prometheus clients write it ("0.005", "1.0", "1e-05")."""
    return str(floatToGoString(value))  # type: ignore[no-untyped-call]
