"""One step's adapters as the host plans them (``LoraStep``): which rows run with which
adapter, made in the pass that builds the step's rows (``StepRows.of``) and carried by them
(``StepRows.lora``), so every backend (``lora.backend``, ``lora.native``) reads one plan::

    rows   | chunk a (adapter 0) | chunk b (base) | dec 0 (adapter 1) | dec 1 (adapter 0) |
    slot   |  0  0  0  0  0      | -1 -1 -1       |  1                |  0                |
    y[rows of slot s] += scale * (x[rows of slot s] @ A_s^T) @ Bt_s       per target

Plain ints and references (no torch), so no kernel launch reads a device value back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.output import ScheduledSeq

if TYPE_CHECKING:
    from model_runner.lora.layout import LoraWeights


def not_loaded(name: str) -> str:
    """Why a seq whose adapter is not resident fails (alone: the step goes on)."""
    return f"adapter {name!r} is not loaded on this server"


@dataclass(frozen=True, slots=True)
class LoraStep:
    """The adapters of one step: ``slots`` the distinct adapters (``names`` theirs, in
    name order),
    ``row_slot`` each row's index into them (-1: the base model), ``row_scale`` each row's
    scale (0 for base rows); for the segmented kernels, ``segments`` the prefill chunks of
    an adapter as ``(first row, rows, slot)`` and ``decode_rows`` the decode rows (draft
    rows too) of an adapter as ``(row, slot)``."""

    names: tuple[str, ...]
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

    @property
    def weights(self) -> dict[str, LoraWeights]:
        """The step's adapters by name."""
        return dict(zip(self.names, self.slots, strict=True))

    @classmethod
    def of(
        cls,
        prefill: Sequence[ScheduledSeq],
        decode: Sequence[ScheduledSeq],
        weights: Mapping[str, LoraWeights],
    ) -> LoraStep | None:
        """The rows of ``prefill`` then ``decode`` by adapter, ``weights`` by adapter name
        (every adapter of those seqs); None when every row runs the base model."""
        names: dict[str, int] = {}
        slots: list[LoraWeights] = []
        row_slot: list[int] = []
        row_scale: list[float] = []
        segments: list[tuple[int, int, int]] = []
        decode_rows: list[tuple[int, int]] = []
        for i, seq in enumerate((*prefill, *decode)):
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
                if i < len(prefill):
                    segments.append((row, seq.num_tokens, slot))
                else:
                    decode_rows.extend((row + j, slot) for j in range(seq.num_tokens))
            row_slot.extend([slot] * seq.num_tokens)
            row_scale.extend([scale] * seq.num_tokens)
        if not slots:
            return None
        # Slots in name order, whatever order the rows name them in: the same adapters give
        # the same slots step after step (the CUDA backend keeps its stacks while they do).
        order = sorted(names, key=lambda n: n)
        new = {names[n]: i for i, n in enumerate(order)}
        return cls(
            tuple(order),
            tuple(slots[names[n]] for n in order),
            tuple(new.get(s, -1) for s in row_slot),
            tuple(row_scale),
            tuple((row, length, new[s]) for row, length, s in segments),
            tuple((row, new[s]) for row, s in decode_rows),
        )
