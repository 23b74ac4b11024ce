"""What a step's adapter updates answer (``StepAdapters``), the backend that makes them
(``LoraBackend``), and the updates of a step without adapters (``NO_ADAPTERS``); the
backends themselves are ``lora.backend`` (torch) and ``lora.cuda`` (Triton)."""

from __future__ import annotations

from typing import Protocol

import torch

from model_runner.lora.plan import LoraStep
from model_runner.lora.targets import Span
from model_runner.step import StepRows


class StepAdapters(Protocol):
    """One step's adapter updates, as the model's forward applies them."""

    def touches(self, layer: int, projection: str) -> bool:
        """Whether an adapter of the step updates a target of ``projection`` in ``layer``."""
        ...

    def add_(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[rows, span] += scale * (x[rows] @ A^T) @ Bt`` for each adapter's rows and
        each target of ``projection`` (``lora.targets``) it updates in ``layer``; ``x`` is
        the projection's input, ``y`` its output."""
        ...


class NoAdapters:
    """The updates of a step whose rows all run the base model: none."""

    def touches(self, layer: int, projection: str) -> bool:
        return False

    def add_(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        return None


NO_ADAPTERS = NoAdapters()


class LoraBackend(Protocol):
    name: str

    def updates(self, step: StepRows) -> StepAdapters:
        """``step``'s adapter updates (``NO_ADAPTERS`` when ``step.lora`` is None)."""
        ...


class PlannedUpdates:
    """What every backend's updates share: the step's plan and each projection's spans."""

    def __init__(self, lora: LoraStep, spans: dict[str, tuple[Span, ...]]) -> None:
        self.lora = lora
        self.spans = spans

    def touches(self, layer: int, projection: str) -> bool:
        parts = self.spans[projection]
        return any(s.target in w.layers[layer] for w in self.lora.slots for s in parts)
