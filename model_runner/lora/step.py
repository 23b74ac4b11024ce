"""One step's adapters: which rows run with which adapter (``LoraStep``), and the grouped
low-rank products of the torch path (``TorchLora``, the eager forward).

The base model's matmul runs once over every row of a step, as without adapters; then each
adapter's update runs for its rows only::

    rows   | chunk a (adapter 0) | chunk b (base) | dec 0 (adapter 1) | dec 1 (adapter 0) |
    slot   |  0  0  0  0  0      | -1 -1 -1       |  1                |  0                |
    y[rows of slot s] += scale * (x[rows of slot s] @ A_s^T) @ Bt_s       per target

On the fused CPU path the same products run inside the kernels (``lora.native``,
``kernels/lora.h``); on CUDA the torch path calls the segmented Triton kernels
(``lora.triton_ops``: SGMV for a prefill chunk's run of rows, BGMV for decode rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from model_runner.config import ModelConfig
from model_runner.lora.layout import LoraWeights
from model_runner.sampling_ops import to_device
from model_runner.step import StepRows
from scheduler.output import ScheduledSeq
from scheduler.request import LoraRef


@dataclass(frozen=True, slots=True)
class LoraStep:
    """The adapters of one step, planned on the host from the step's rows (plain ints, so
    no kernel launch reads a device value back): ``slots`` the distinct adapters,
    ``row_slot`` each row's index into them (-1: the base model), ``row_scale`` each row's
    scale (0 for base rows); for the segmented kernels, ``segments`` the prefill chunks of
    an adapter as ``(first row, rows, slot)`` and ``decode_rows`` the decode rows (draft
    rows too) of an adapter as ``(row, slot)``."""

    slots: tuple[LoraWeights, ...]
    row_slot: tuple[int, ...]
    row_scale: tuple[float, ...]
    segments: tuple[tuple[int, int, int], ...] = ()
    decode_rows: tuple[tuple[int, int], ...] = ()

    @property
    def max_rank(self) -> int:
        return max(w.rank for w in self.slots)

    @property
    def longest_segment(self) -> int:
        """The most rows of one segment (0 without any): the SGMV grid's second axis."""
        return max((length for _, length, _ in self.segments), default=0)

    @classmethod
    def of(cls, step: StepRows, weights: dict[str, LoraWeights]) -> LoraStep | None:
        """The rows of ``step`` by adapter, ``weights`` by adapter name (every adapter of
        the step's seqs); None when every row runs the base model."""
        names: dict[str, int] = {}
        slots: list[LoraWeights] = []
        row_slot: list[int] = []
        row_scale: list[float] = []
        segments: list[tuple[int, int, int]] = []
        decode_rows: list[tuple[int, int]] = []
        num_prefill = len(step.prefill)
        for i, seq in enumerate(step.seqs):
            ref = seq.lora
            if ref is None:
                slot, scale = -1, 0.0
            else:
                slot = names.get(ref.name, -1)
                if slot < 0:
                    slot = names[ref.name] = len(slots)
                    slots.append(weights[ref.name])
                scale = ref.scale
                row = len(row_slot)
                if i < num_prefill:
                    segments.append((row, seq.num_tokens, slot))
                else:
                    decode_rows.extend((row + j, slot) for j in range(seq.num_tokens))
            row_slot.extend([slot] * seq.num_tokens)
            row_scale.extend([scale] * seq.num_tokens)
        if not slots:
            return None
        return cls(
            tuple(slots), tuple(row_slot), tuple(row_scale), tuple(segments), tuple(decode_rows)
        )


def resolve_adapters(
    seqs: Sequence[ScheduledSeq], lookup: Callable[[LoraRef], LoraWeights | None]
) -> tuple[dict[str, LoraWeights], dict[str, str]]:
    """The weights of the adapters ``seqs`` run with, by name, and the seqs whose adapter is
    not resident (request id -> why; they fail alone, the step goes on)."""
    found: dict[str, LoraWeights] = {}
    failed: dict[str, str] = {}
    for seq in seqs:
        ref = seq.lora
        if ref is None or ref.name in found:
            continue
        weights = lookup(ref)
        if weights is None:
            failed[seq.request_id] = f"adapter {ref.name!r} is not loaded on this server"
        else:
            found[ref.name] = weights
    return found, failed


class TorchLora:
    """A step's adapter updates in torch, for ``LlamaModel.forward``: per adapter, its rows
    gathered, two small matmuls, and the result added back to those rows."""

    def __init__(self, lora: LoraStep, config: ModelConfig, device: torch.device) -> None:
        self.set_spans(lora, config)
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

    def set_spans(self, lora: LoraStep, config: ModelConfig) -> None:
        """The column spans of the fused projections' targets, and the step's adapters."""
        h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
        self.qkv_spans = (("q", 0), ("k", h * d), ("v", (h + kvh) * d))
        self.gate_up_spans = (("gate", 0), ("up", config.intermediate_size))
        self.lora = lora

    def touches(self, layer: int, spans: Sequence[tuple[str, int]]) -> bool:
        """Whether an adapter of the step updates one of ``spans``' targets in ``layer``."""
        return any(t in w.layers[layer] for w in self.lora.slots for t, _ in spans)

    def add_(
        self, layer: int, spans: Sequence[tuple[str, int]], x: torch.Tensor, y: torch.Tensor
    ) -> None:
        """``y[rows, col0 : col0 + n] += scale * (x[rows] @ A^T) @ Bt`` for each adapter's
        rows and each ``(target, col0)`` of ``spans`` it updates."""
        for weights, index, factor in self.groups:
            pairs = weights.layers[layer]
            xs: torch.Tensor | None = None
            for target, col0 in spans:
                pair = pairs.get(target)
                if pair is None:
                    continue
                a, bt = (w.to(x.dtype) for w in pair)  # no copy when they match (the usual)
                if xs is None:
                    xs = x if index is None else x.index_select(0, index)
                t = xs @ a.t()
                if factor is not None:
                    t = t * factor.to(t.dtype)
                delta = (t @ bt).to(y.dtype)
                out = y[:, col0 : col0 + bt.shape[1]]
                if index is None:
                    out.add_(delta)
                else:
                    out.index_add_(0, index, delta)
