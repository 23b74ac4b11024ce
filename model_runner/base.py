"""What every runner offers the engine. Pure Python: FakeRunner and SimRunner need no torch.

``Runner`` is the contract the server holds a runner to: ``info`` (what the model is),
``constraints`` (structured outputs, None when the runner takes none), ``adapters`` (its LoRA
adapters, None when it takes none), ``block_io()`` (its KV as block bytes, for tier 2),
``submit`` / ``execute`` and ``scrub_blocks`` (after a step that raised). The server reads
these and nothing else: it never asks what type a runner is.

``submit(plan) -> StepHandle`` starts a step and returns, so the engine can plan the next step
while this one runs (vLLM's async scheduling, SGLang's overlap scheduler); ``handle.result()``
waits for its outputs. ``execute(plan)`` is ``submit(plan).result()``. ``can_run_ahead`` says
whether ``submit`` really returns before the step is computed (a CUDA device, a step thread);
the engine overlaps only then. A runner that computes only in ``execute`` takes ``SyncRunner``'s
``submit``: a handle that runs the step when its result is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cache_manager.sizing import ModelShape
from scheduler.output import ModelOutput, SchedulerOutput

if TYPE_CHECKING:
    from pathlib import Path

    from model_runner.constraints import ConstraintTracker
    from model_runner.lora.info import AdapterCounts, AdapterInfo
    from scheduler.request import LoraRef


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


class AdapterSource(Protocol):
    """A runner's LoRA adapters as the server uses them (``model_runner.lora.LoraRegistry``):
    the fronts list, resolve, load and unload them; the engine client pins a request's
    adapter while it runs. Errors are ``model_runner.lora.info``'s."""

    def infos(self) -> list[AdapterInfo]: ...

    def resolve(self, name: str, scale: float = 1.0) -> LoraRef: ...

    def load(self, name: str, path: str | Path) -> AdapterInfo: ...

    def unload(self, name: str) -> AdapterInfo: ...

    def needs_read(self, ref: LoraRef) -> bool:
        """Whether ``acquire(ref)`` reads from disk (blocking: run it in a thread)."""
        ...

    def acquire(self, ref: LoraRef) -> None: ...

    def release(self, ref: LoraRef) -> None: ...

    def counts(self) -> AdapterCounts:
        """Resident adapters, lay-outs and evictions so far (the metrics)."""
        ...


class Runner(Protocol):
    """Computes one step; neither ``submit`` nor ``execute`` mutates ``plan``.

    ``submit`` contract:

    - it reads from ``plan`` (and the requests' token lists its seqs view) everything the
      step needs before it returns, on the caller's thread: the caller applies the previous
      step's result to those requests as soon as ``submit`` returns;
    - steps run in submission order, and their handles' ``result`` is taken in that order;
    - a decode seq of ``plan`` may carry a placeholder (``ScheduledSeq.has_placeholder``) for
      the token its request samples in the plan submitted just before: the runner takes it
      from that step's sampled ids where they are (``model_runner.future``), never waiting
      for them on the host. Only a runner that ``can_run_ahead`` gets such plans.
    """

    @property
    def info(self) -> ModelInfo: ...

    @property
    def constraints(self) -> ConstraintTracker | None:
        """The matchers of constrained requests (structured outputs); None: none taken."""
        ...

    @property
    def adapters(self) -> AdapterSource | None:
        """The LoRA adapters this runner serves, which the fronts resolve requests' names in
        (``server.lora``); None: it takes none."""
        ...

    @property
    def can_run_ahead(self) -> bool:
        """Whether ``submit`` returns before the step is computed (else the engine has
        nothing to overlap and applies each step before it plans the next)."""
        ...

    def block_io(self) -> BlockIO:
        """This runner's KV as block bytes (tier 2 spills and restores through it)."""
        ...

    def submit(self, plan: SchedulerOutput) -> StepHandle:
        """Start computing ``plan``; see the class docstring."""
        ...

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Compute ``plan`` now (``submit(plan).result()``)."""
        ...

    def scrub_blocks(self, block_ids: Sequence[int]) -> None:
        """Before the next step reads the KV, zero each of ``block_ids`` that holds a
        non-finite key or value: a step that raised may have left them in its requests'
        blocks, which the engine frees (runners without KV values: nothing to do)."""
        ...


class StepHandle(Protocol):
    """A step a runner has started (``Runner.submit``)."""

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


class SyncRunner:
    """``submit`` for a runner that computes a step only in ``execute`` (it cannot run ahead):
    the handle runs ``execute`` when its result is asked for."""

    can_run_ahead = False

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        raise NotImplementedError

    def submit(self, plan: SchedulerOutput) -> StepHandle:
        return PendingStep(lambda: self.execute(plan))
