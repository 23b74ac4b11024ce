"""WHO runs each step and AS WHAT (prefill or decode). Pure Python: no torch, no I/O."""

from scheduler.config import SchedulerConfig
from scheduler.errors import OverloadError
from scheduler.output import (
    ModelOutput,
    RequestOutput,
    ScheduledSeq,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from scheduler.request import (
    AbortReason,
    FinishReason,
    LoraRef,
    Request,
    RequestStatus,
    SamplingParams,
)
from scheduler.scheduler import Scheduler

__all__ = [
    "AbortReason",
    "FinishReason",
    "LoraRef",
    "ModelOutput",
    "OverloadError",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "TokenLogprobs",
]
