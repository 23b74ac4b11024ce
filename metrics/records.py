"""What the engine publishes for metrics: plain records, handed to a sink.

The engine loop never calls prometheus-client per token. Once per step it hands the sink a
``StepRecord`` (a snapshot), and once per finished request a ``RequestRecord``; the
Prometheus side turns those into histograms/counters and reads the latest snapshot at scrape
time through a custom Collector.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scheduler.output import SchedulerStats


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step: the scheduler snapshot after it and where the time went."""

    stats: SchedulerStats
    kind: str  # "prefill", "decode", "mixed" (both batches in one step) or "idle"
    step_duration_s: float  # wall time of runner.execute
    schedule_cpu_s: float  # CPU time of scheduler.schedule() + scheduler.update()
    # The whole iteration (schedule to processed outputs: what an inter-token gap is), and
    # what the step-cost model predicted for it (None without one).
    iteration_s: float = 0.0
    predicted_s: float | None = None
    # Structured outputs: this step's mask time (0: no constrained row), and the compile
    # cache's cumulative counts (a snapshot of the runner's ConstraintCompiler).
    constraint_mask_s: float = 0.0
    num_constraint_compiles_total: int = 0
    num_constraint_cache_hits_total: int = 0
    # Model steps that raised, so far (each failed its requests; docs/reliability.md).
    num_failed_steps_total: int = 0


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One finished request (any terminal path), observed once, when it ends.

    Times are ``time.monotonic()`` seconds; a time is None when the request never got there
    (e.g. aborted while waiting has no first token).
    """

    request_id: str
    finish_reason: str  # FinishReason.value: stop, length, abort, error
    abort_reason: str | None  # AbortReason.value when finish_reason == "abort"
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float
    # Gaps between consecutive output tokens (len == num_output_tokens - 1 when complete).
    inter_token_s: list[float] = field(default_factory=list)
    priority: int = 0
    # The request's own latency targets (None: the server's defaults).
    ttft_target_s: float | None = None
    itl_target_s: float | None = None
    constrained: bool = False  # carried a structured-output constraint
    adapter: str | None = None  # the LoRA adapter it ran with (None: the base model)


class MetricsSink(Protocol):
    """Where the engine and the gRPC edge report. Calls must be cheap and never raise."""

    def on_step(self, record: StepRecord) -> None: ...

    def on_request_done(self, record: RequestRecord) -> None: ...

    def on_rejected(self, reason: str) -> None:
        """A request refused before it reached the scheduler ("overload", "invalid")."""

    def on_rpc(self, method: str, code: str) -> None:
        """One finished RPC with its gRPC status code name ("OK", "INVALID_ARGUMENT", ...)."""

    def on_connection_event(self, server: str, event: str) -> None:
        """An HTTP port ("http", "metrics") closed or refused a connection, or could not
        accept one (``server.http_guard.CONNECTION_EVENTS``)."""

    def on_kv_transfer(self, outcome: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        """A decode replica waited ``seconds`` for a prefill replica to publish a request's KV
        (``cluster.pd``): ``outcome`` "ok" (``num_blocks`` blocks, ``num_bytes`` bytes in the
        shared store) or why it recomputes instead ("prefill_failed", "timeout")."""


class NullSink:
    """A sink that drops everything (metrics disabled, or tests that do not look)."""

    def on_step(self, record: StepRecord) -> None:
        pass

    def on_request_done(self, record: RequestRecord) -> None:
        pass

    def on_rejected(self, reason: str) -> None:
        pass

    def on_rpc(self, method: str, code: str) -> None:
        pass

    def on_connection_event(self, server: str, event: str) -> None:
        pass

    def on_kv_transfer(self, outcome: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        pass
