"""What every runner offers the engine. Pure Python: FakeRunner and SimRunner need no torch.

``Runner`` is the contract the server holds a runner to: ``info`` (what the model is),
``constraints`` (structured outputs, None when the runner takes none), ``block_io()`` (its KV
as block bytes, for tier 2) and ``execute``. The server reads these and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

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
    # What runs the linear layers ("torch", "onednn", "kvserve-avx512"); "" without a model.
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
