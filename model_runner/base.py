"""What every runner offers the engine. Pure Python: FakeRunner and SimRunner need no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from cache_manager.sizing import ModelShape
from scheduler.output import ModelOutput, SchedulerOutput


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
    extra: dict[str, str] = field(default_factory=dict)
    sliding_window: int | None = None  # tokens each position attends to (None = all)


class Runner(Protocol):
    """Computes one step. ``execute`` must not mutate ``plan``."""

    @property
    def info(self) -> ModelInfo: ...

    def execute(self, plan: SchedulerOutput) -> ModelOutput: ...
