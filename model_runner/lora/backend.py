"""A step's adapter updates behind one backend, chosen when the runner starts
(``paths.lora_backend``) and held by the eager path; the model never asks which.

The base model's matmul runs once over every row of a step, as without adapters; then each
adapter's update runs for its rows only (the step's plan: ``lora.plan.LoraStep``, carried by
``StepRows.lora``). Per step the backend gives a ``StepAdapters``, which rides on the forward
batch (``ForwardBatch.adapters``); the model calls its ``add_`` after every projection and
asks ``touches`` only to choose the MLP's epilogue (an update of gate or up goes in before
the activation). A step without adapters gets ``NO_ADAPTERS``, which adds nothing (these
interfaces: ``lora.updates``).

The backends:

- ``TorchBackend``: per adapter, its rows gathered, two small matmuls, the result added back
  (CPU's eager path);
- ``lora.cuda.TritonBackend``: the segmented Triton kernels (``lora.triton_ops``: SGMV for a
  prefill chunk's run of rows, BGMV for decode rows), on CUDA (the tests run them in Triton's
  interpreter on CPU);
- the fused CPU kernels' whole-step call reads the same plan itself (``lora.native``,
  ``kernels/lora.h``).

Each projection's targets and column spans come from ``lora.targets``.
"""

from __future__ import annotations

import torch

from model_runner.config import ModelConfig
from model_runner.lora.layout import LoraWeights
from model_runner.lora.plan import LoraStep
from model_runner.lora.targets import Span, spans
from model_runner.lora.updates import NO_ADAPTERS, PlannedUpdates, StepAdapters
from model_runner.sampling_ops import to_device
from model_runner.step import StepRows


class TorchLora(PlannedUpdates):
    """A step's updates in torch: per adapter, its rows gathered, two small matmuls, and the
    result added back to those rows."""

    def __init__(
        self, lora: LoraStep, spans: dict[str, tuple[Span, ...]], device: torch.device
    ) -> None:
        super().__init__(lora, spans)
        # Each adapter's rows and scales, from the host plan (pinned, non-blocking copies).
        self.groups: list[tuple[LoraWeights, torch.Tensor | None, torch.Tensor | None]] = []
        for s, weights in enumerate(lora.slots):
            rows = [r for r, slot in enumerate(lora.row_slot) if slot == s]
            index = (
                None if len(rows) == len(lora.row_slot) else to_device(rows, torch.int64, device)
            )
            scale = [lora.row_scale[r] for r in rows]
            factor = None
            if any(x != 1.0 for x in scale):
                factor = to_device(scale, torch.float32, device).unsqueeze(1)
            self.groups.append((weights, index, factor))

    def add_(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        for weights, index, factor in self.groups:
            pairs = weights.layers[layer]
            xs: torch.Tensor | None = None
            for span in self.spans[projection]:
                pair = pairs.get(span.target)
                if pair is None:
                    continue
                a, bt = (w.to(x.dtype) for w in pair)  # no copy when they match (the usual)
                if xs is None:
                    xs = x if index is None else x.index_select(0, index)
                t = xs @ a.t()
                if factor is not None:
                    t = t * factor.to(t.dtype)
                delta = (t @ bt).to(y.dtype)
                out = y[:, span.col0 : span.col0 + span.width]
                if index is None:
                    out.add_(delta)
                else:
                    out.index_add_(0, index, delta)


class TorchBackend:
    """The grouped matmuls of ``TorchLora`` (CPU's eager path)."""

    name = "torch"

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.spans = spans(config)
        self.device = device

    def updates(self, step: StepRows) -> StepAdapters:
        if step.lora is None:
            return NO_ADAPTERS
        return TorchLora(step.lora, self.spans, self.device)
