"""What ``TorchRunner`` keeps of one submitted step, one record per phase (``runner``)::

    _prepare (host)    Prepared: the plan's copies and scrubs, and its Work (None: nothing
                       to compute): rows, forward passes, the seqs that sample, their
                       sampling batch (or RowByRow, when preparing the batch raised), masks
    _run (device)      Launched: the sample on its way to the host (OnTheWay), or already
                       there (Collected, sampled row by row), the StepClock, prompt scores
    _finish (host)     reads both -> ModelOutput

A record is filled once, by its phase, and read by the later ones; only the step's
``ModelOutput`` is written along the way.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from model_runner.prompt_logprobs import PromptScores
from model_runner.sampler import DeviceSample, RowByRow, Sampler, SampleResult, SamplingBatch
from model_runner.step import StepRows
from scheduler.output import ModelOutput, ScheduledSeq

if TYPE_CHECKING:
    from model_runner.constraints import Masks


@dataclass(frozen=True, slots=True, eq=False)
class Work:
    """What a step computes and samples, as ``_prepare`` read it from the plan."""

    rows: StepRows
    # The forward passes (one, or prefill then decode unfused), each with its adapters' plan.
    passes: list[StepRows]
    sampled: list[ScheduledSeq]  # the seqs that sample
    sample_rows: Sequence[ScheduledSeq]  # what the sampler sees (k + 1 per draft seq)
    sampling: SamplingBatch | RowByRow  # RowByRow: the batch's prepare raised
    publishes: bool  # its sampled ids feed the next step's placeholders
    masks: Future[Masks] | None


@dataclass(frozen=True, slots=True, eq=False)
class Prepared:
    """One submitted step as ``_prepare`` read it on the caller's thread (host); ``_run``
    and ``_finish`` fill in its ``result``."""

    t0: float
    result: ModelOutput
    block_copies: list[tuple[int, int]]
    scrub: list[int]  # blocks failed requests left non-finite
    work: Work | None = None  # None: nothing to compute


@dataclass(frozen=True, slots=True, eq=False)
class OnTheWay:
    """A batch's sample on its way to pinned host memory: there once ``copied`` fired (None:
    on the CPU, where it already is)."""

    batch: SamplingBatch
    host: DeviceSample
    copied: torch.cuda.Event | None

    @classmethod
    def start(
        cls, batch: SamplingBatch, sample: DeviceSample, stream: torch.cuda.Stream
    ) -> OnTheWay:
        """Start copying ``sample`` to pinned host memory on ``stream``, after the work
        queued so far on the device's current stream."""
        stream.wait_stream(torch.cuda.current_stream(stream.device))

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # not reused before the copy has read it
            return host

        with torch.cuda.stream(stream):
            host = sample.map(copy)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record(stream)
        return cls(batch, host, copied)

    def collect(self, sampler: Sampler) -> SampleResult:
        """The sample on the host (waits for the copy)."""
        if self.copied is not None:
            self.copied.synchronize()
        return sampler.collect(self.batch, self.host)


@dataclass(frozen=True, slots=True, eq=False)
class Collected:
    """A sample already on the host (sampled row by row)."""

    sampled: SampleResult

    def collect(self, sampler: Sampler) -> SampleResult:
        return self.sampled


class StepClock:
    """Marks along a step: ``perf_counter`` on CPU, CUDA events on the device's stream (read
    once the step is done, so timing never synchronises)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        marks = self._marks
        if self._cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
        return [b - a for a, b in itertools.pairwise(marks)]


@dataclass(frozen=True, slots=True, eq=False)
class Launched:
    """What ``_run`` left of a step for ``_finish``: its sample, its clock, the prompt
    logprobs of the rows that ask (on the device), and the rows whose masks failed."""

    sample: OnTheWay | Collected
    clock: StepClock
    prompt: PromptScores | None
    mask_failed: Mapping[str, str]
