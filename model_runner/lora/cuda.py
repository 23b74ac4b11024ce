"""A step's adapter updates on CUDA: ``TritonBackend`` (``lora.backend``'s interface) over
the segmented kernels of ``lora.triton_ops``.

The rows of a prefill chunk (and of a chunk over a cached prefix) are one SGMV segment; each
decode row (a draft row too) is a BGMV row. The step's adapters' weights are stacked per
layer and target, zero-padded to the step's largest rank; the stacks are kept while the
same adapters come back step after step (``StackCache``: decode steps repeat their set).

Nothing here reads the device: the segments, decode rows and grids come from the step's host
plan (``StepRows.lora``, made when the step is prepared), and their tables reach the device
in copies from pinned memory that do not block (``sampling_ops.to_device``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_runner.config import ModelConfig
from model_runner.lora import triton_ops
from model_runner.lora.plan import LoraStep
from model_runner.lora.targets import Span, spans
from model_runner.lora.updates import NO_ADAPTERS, PlannedUpdates, StepAdapters
from model_runner.sampling_ops import to_device
from model_runner.step import StepRows


def _columns(rows: Sequence[tuple[int, ...]], width: int) -> list[int]:
    """``rows`` of ``width`` ints, column after column (a [width, len(rows)] table)."""
    return [row[c] for c in range(width) for row in rows]


class StackCache:
    """The stacked weights of the last set of adapters a step ran with."""

    def __init__(self) -> None:
        self.key: tuple[tuple[str, str], ...] = ()
        self.stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = {}

    def for_step(
        self, lora: LoraStep
    ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None]:
        # By name and content: the slots come in name order (``LoraStep.of``), so the same
        # adapters in another row order keep the stacks; a reloaded file that changed does not.
        key = tuple((name, w.digest) for name, w in zip(lora.names, lora.slots, strict=True))
        if key != self.key:
            self.key, self.stacks = key, {}
        return self.stacks


class TritonLora(PlannedUpdates):
    """See the module docstring; ``add_`` runs the kernels."""

    def __init__(
        self,
        lora: LoraStep,
        num_rows: int,
        spans: dict[str, tuple[Span, ...]],
        device: torch.device,
        cache: StackCache | None = None,
    ) -> None:
        super().__init__(lora, spans)
        # The host plan's ints, each table in one copy from pinned memory (non-blocking).
        self.segments = to_device(_columns(lora.segments, 3), torch.int32, device).reshape(3, -1)
        self.longest = lora.longest_segment
        decode = to_device(_columns(lora.decode_rows, 2), torch.int32, device).reshape(2, -1)
        self.rows, self.slots = decode[0], decode[1]
        self.scale = to_device(list(lora.row_scale), torch.float32, device)
        self.num_rows = num_rows
        self.rank = triton_ops.padded_rank(lora.max_rank)
        self._stacks = (cache or StackCache()).for_step(lora)

    def _stack(self, layer: int, target: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (layer, target)
        if key not in self._stacks:
            pairs = [w.layers[layer].get(target) for w in self.lora.slots]
            first = next((p for p in pairs if p is not None), None)
            if first is None:
                self._stacks[key] = None
            else:
                a0, bt0 = first
                a = a0.new_zeros(len(pairs), self.rank, a0.shape[1])
                bt = bt0.new_zeros(len(pairs), self.rank, bt0.shape[1])
                for s, pair in enumerate(pairs):
                    if pair is not None:
                        a[s, : pair[0].shape[0]] = pair[0]
                        bt[s, : pair[1].shape[0]] = pair[1]
                self._stacks[key] = (a, bt)
        return self._stacks[key]

    def add_(self, layer: int, projection: str, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.contiguous()
        for span in self.spans[projection]:
            stack = self._stack(layer, span.target)
            if stack is None:
                continue
            a, bt = stack
            t = torch.zeros(self.num_rows, self.rank, dtype=torch.float32, device=x.device)
            triton_ops.sgmv_shrink(x, a, t, self.segments, self.longest)
            triton_ops.bgmv_shrink(x, a, t, self.rows, self.slots)
            triton_ops.sgmv_expand(t, bt, y, self.scale, self.segments, self.longest, span.col0)
            triton_ops.bgmv_expand(t, bt, y, self.scale, self.rows, self.slots, span.col0)


class TritonBackend:
    """``TritonLora`` per step, with the stacks of the last set of adapters kept."""

    name = "triton"

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.spans = spans(config)
        self.device = device
        self.stacks = StackCache()

    def updates(self, step: StepRows) -> StepAdapters:
        if step.lora is None:
            return NO_ADAPTERS
        return TritonLora(step.lora, step.num_rows, self.spans, self.device, self.stacks)
