"""What every runner offers the engine. Pure Python: FakeRunner and SimRunner need no torch.

``Runner`` is the contract the server holds a runner to: ``info`` (what the model is),
``constraints`` (structured outputs, None when the runner takes none), ``block_io()`` (its KV
as block bytes, for tier 2), ``execute`` and ``scrub_blocks`` (after a step that raised). The
server reads these and nothing else.

``AheadRunner`` adds ``submit(plan) -> StepHandle``: the step starts and ``submit`` returns,
so the engine can plan the next step while this one runs (vLLM's async scheduling, SGLang's
overlap scheduler); ``handle.result()`` waits for its outputs. ``execute(plan)`` stays, and is
``submit(plan).result()``. ``can_run_ahead`` says whether ``submit`` really returns before the
step is computed (a CUDA device, a step thread); the engine overlaps only then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from cache_manager.sizing import ModelShape
from scheduler.output import ModelOutput, SchedulerOutput

if TYPE_CHECKING:
    from model_runner.constraints import ConstraintTracker


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the server reports about the model behind a runner."""

    name: str
    vocab_size: int
    max_model_len: int
    shape: ModelShape
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    kv_dtype: str = "float32"  # how the KV cache stores keys and values (``shape`` follows it)
    sliding_window: int | None = None  # tokens each position attends to (None = all)
    weights: str = "float"  # "float", or the quantized formats held ("Q4_1+Q8_0", "int8")
    weight_bytes: int = 0  # the weights as held (0: not known)
    # What runs the linear layers ("torch", "onednn", "kvserve-avx512-a16": the kernels, their
    # ISA family and activation bits); "" without a model.
    linear_backend: str = ""
    extra: dict[str, str] = field(default_factory=dict)  # display only: nothing parses it


class BlockIO(Protocol):
    """Whole blocks of a runner's KV as bytes (``model_runner.kv_transfer.PoolBlockIO``)."""

    block_bytes: int

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]: ...

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None: ...


class NullBlockIO:
    """A runner without KV bytes (a simulated one, the fake one without a shadow KV):
    blocks carry no bytes."""

    block_bytes = 0

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return [b""] * len(block_ids)

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None:
        pass


class Runner(Protocol):
    """Computes one step. ``execute`` must not mutate ``plan``."""

    @property
    def info(self) -> ModelInfo: ...

    @property
    def constraints(self) -> ConstraintTracker | None:
        """The matchers of constrained requests (structured outputs); None: none taken."""
        ...

    def block_io(self) -> BlockIO:
        """This runner's KV as block bytes (tier 2 spills and restores through it)."""
        ...

    def execute(self, plan: SchedulerOutput) -> ModelOutput: ...

    def scrub_blocks(self, block_ids: Sequence[int]) -> None:
        """Before the next step reads the KV, zero each of ``block_ids`` that holds a
        non-finite key or value: a step that raised may have left them in its requests'
        blocks, which the engine frees (runners without KV values: nothing to do)."""
        ...


class StepHandle(Protocol):
    """A step a runner has started (``AheadRunner.submit``)."""

    def result(self) -> ModelOutput:
        """Wait for the step's outputs on the host (raises what the step raised)."""
        ...


class DoneStep:
    """The handle of a step computed inside ``submit`` (nothing left to wait for)."""

    __slots__ = ("_output",)

    def __init__(self, output: ModelOutput) -> None:
        self._output = output

    def result(self) -> ModelOutput:
        return self._output


class PendingStep:
    """The handle of a started step: ``finish`` (the runner's) waits for its outputs and
    builds them, the first time ``result`` is asked for."""

    __slots__ = ("_finish", "_output")

    def __init__(self, finish: Callable[[], ModelOutput]) -> None:
        self._finish = finish
        self._output: ModelOutput | None = None

    def result(self) -> ModelOutput:
        if self._output is None:
            self._output = self._finish()
        return self._output


@runtime_checkable
class AheadRunner(Runner, Protocol):
    """A runner that can compute a step while the engine plans the next one.

    ``submit`` contract:

    - it reads from ``plan`` (and the requests' token lists its seqs view) everything the
      step needs before it returns, on the caller's thread: the caller applies the previous
      step's result to those requests as soon as ``submit`` returns;
    - steps run in submission order, and their handles' ``result`` is taken in that order;
    - a decode seq of ``plan`` may carry a placeholder (``ScheduledSeq.has_placeholder``) for
      the token its request samples in the plan submitted just before: the runner takes it
      from that step's sampled ids where they are (``model_runner.future``), never waiting
      for them on the host.
    """

    @property
    def can_run_ahead(self) -> bool:
        """Whether ``submit`` returns before the step is computed (else the engine has
        nothing to overlap and runs ``execute``)."""
        ...

    def submit(self, plan: SchedulerOutput) -> StepHandle:
        """Start computing ``plan``; see the class docstring."""
        ...
