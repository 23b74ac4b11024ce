"""The attention backend interface: bound once at start-up, built once per step, run per layer.

    backend = make_attention_backend(name, spec)   # start-up: the model's attention shape
    batch = backend.build(step)                    # per step: StepRows -> ForwardBatch
    backend.forward(layer, qkv, batch, pool, out)  # per layer

    batch = backend.graph_batch(size, max_pages)   # CUDA graphs: a static batch, captured once
    backend.fill(PaddedDecode(step, size, slot))   # per replay: the step's rows into it

``AttentionSpec`` carries everything fixed at start-up (heads, block size, dtypes, device,
window, sinks), so a step passes only its rows and a layer only its tensors. What a backend
supports is said by class attributes (``graphs``, ``kv_dtypes``, ``sinks``,
``yields_to_fused``), which ``unsupported`` and the runner read, and where it runs by
``available(device)``; nothing checks a name.

A ``ForwardBatch`` holds what every layer shares: the row tensors the model reads (token ids,
positions, KV slots) and the backend's own per-step ``metadata`` (the torch backend's gathers
and masks, the paged backends' page tables). A backend with ``graphs`` also makes the batch a
decode graph is captured on and rewrites it in place before each replay (``graph_batch``,
``fill``: vLLM's ``build_for_cudagraph_capture``, SGLang's
``init_forward_metadata_capture_cuda_graph``), so ``cuda_graphs`` knows no backend's metadata.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Generic, TypeVar

import torch

from model_runner.kv_pool import KVPool
from model_runner.lora.updates import NO_ADAPTERS, StepAdapters
from model_runner.step import StepRows

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """The model's attention as the runner configured it, fixed for the runner's life."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per KV block
    dtype: torch.dtype  # compute: Q, outputs, masks
    kv_dtype: torch.dtype  # the pool's storage
    device: torch.device
    sliding_window: int | None = None  # tokens a query sees, itself included (None = all)
    attention_sinks: int = 0  # first tokens always visible (needs a window)
    # RoPE inverse frequencies [D/2], on ``device``: the torch backend re-rotates sink scores.
    rope_inv_freq: torch.Tensor | None = field(default=None, compare=False)
    # Each layer's own window when the layers differ (Gemma 3; ``ModelConfig.layer_windows``),
    # within ``sliding_window`` when that is set too; empty = every layer's is that one.
    layer_windows: tuple[int | None, ...] = ()
    # The sliding layers (a window in ``layer_windows``) keep their KV in a pool of their
    # own, read through ``ScheduledSeq.window_block_ids`` (``cache_manager.hybrid``).
    window_tables: bool = False

    def __post_init__(self) -> None:
        if self.attention_sinks < 0 or (
            self.attention_sinks and (self.sliding_window is None or self.rope_inv_freq is None)
        ):
            raise ValueError(
                f"attention_sinks={self.attention_sinks} needs a sliding window and the RoPE "
                "frequencies, and must be >= 0"
            )
        if self.attention_sinks and self.layered:
            raise ValueError("attention sinks on a model with per-layer windows are not supported")

    def window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends within (tokens; None = every position)."""
        own = self.layer_windows[layer] if self.layer_windows else None
        if own is None or self.sliding_window is None:
            return own if own is not None else self.sliding_window
        return min(own, self.sliding_window)

    def own_table(self, layer: int) -> bool:
        """Whether ``layer`` reads and writes the sliding layers' own tables."""
        return self.window_tables and self.layer_windows[layer] is not None

    @property
    def layered(self) -> bool:
        """Whether the layers attend within different windows."""
        return len({self.window(i) for i in range(len(self.layer_windows))}) > 1


@dataclass(slots=True)
class ForwardBatch(Generic[M]):
    """The tensors of one forward pass, shared by all layers."""

    num_tokens: int
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    max_position: int  # the largest position in ``positions``
    metadata: M  # the backend's per-step data
    # The step's adapter updates (the eager path's LoRA backend sets them: ``lora.backend``).
    adapters: StepAdapters = NO_ADAPTERS
    # The rows' slots in the sliding layers' own tables (``AttentionSpec.window_tables``).
    window_slot_mapping: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class PaddedDecode:
    """A decode step as the inputs of a CUDA graph of ``batch_size`` rows: ``step``'s rows
    (a decode with k drafts is k + 1 one-token rows over its table), then padding rows that
    write ``scratch_slot`` (a slot the cache manager never lends) and attend to no key::

        rows   | dec 0 | dec 1 | dec 2 | pad | pad | pad | pad | pad |   3 decodes -> graph 8
        token  |  t0   |  t1   |  t2   |  0  ...                          (position 0 alike)
        slot   |  s0   |  s1   |  s2   | scratch slot ...
        keys   |  n0   |  n1   |  n2   |  0  ...                          (zeros written)
    """

    step: StepRows
    batch_size: int
    scratch_slot: int

    def __post_init__(self) -> None:
        if self.step.prefill:
            raise ValueError("a step with prefill rows has no graph")
        if self.num_pad < 0:
            raise ValueError(
                f"{self.step.num_rows} decode rows do not fit a graph of {self.batch_size}"
            )

    @property
    def num_pad(self) -> int:
        return self.batch_size - self.step.num_rows

    def row_ids(self) -> list[int]:
        """Token ids, positions and slots of all ``batch_size`` rows, in one list."""
        step, pad = self.step, [0] * self.num_pad
        slots = [*step.slot_mapping, *[self.scratch_slot] * self.num_pad]
        return [*step.token_ids, *pad, *step.positions, *pad, *slots]


class AttentionBackend(ABC, Generic[M]):
    """One layer's attention over a step, and the step's metadata; chosen once at start-up."""

    name: ClassVar[str]
    graphs: ClassVar[bool] = False  # decode steps may be captured as CUDA graphs
    kv_dtypes: ClassVar[frozenset[torch.dtype] | None] = None  # pool dtypes read; None: any
    sinks: ClassVar[bool] = False  # attention sinks
    window_tables: ClassVar[bool] = False  # the sliding layers' own tables (AttentionSpec)
    # Steps the fused CPU kernel fits run there instead (its attention is this one's).
    yields_to_fused: ClassVar[bool] = False

    def __init__(self, spec: AttentionSpec) -> None:
        reason = self.unsupported(spec)
        where = self.unavailable(spec.device)
        if reason is not None or where is not None:
            raise ValueError(reason or f"the {self.name} backend {where}")
        self.spec = spec

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` ("runs on CUDA, not cpu", "needs ...
        installed"), or None: where it runs, whatever the model."""
        return None

    @classmethod
    def available(cls, device: torch.device) -> bool:
        """Whether this backend can run on ``device``."""
        return cls.unavailable(device) is None

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        """Why this backend cannot serve ``spec``, or None."""
        if cls.kv_dtypes is not None and spec.kv_dtype not in cls.kv_dtypes:
            return f"the {cls.name} backend reads float KV pools, not {spec.kv_dtype}"
        if spec.attention_sinks and not cls.sinks:
            return f"the {cls.name} backend has no attention sinks (use --attention-backend torch)"
        if spec.window_tables and not cls.window_tables:
            return (
                f"the {cls.name} backend reads one block table for every layer "
                "(use --attention-backend torch, or --sliding-layer-blocks off)"
            )
        return None

    @abstractmethod
    def build(self, step: StepRows) -> ForwardBatch[M]:
        """The step's batch: rows in ``step``'s order, metadata every layer shares."""

    def forward(
        self, layer: int, qkv: torch.Tensor, batch: ForwardBatch[M], pool: KVPool, out: torch.Tensor
    ) -> None:
        """Store the step's K/V into the pool, then write the attention of every row into
        ``out`` [T, H * head_dim]. ``qkv`` is [T, H + 2 kvh, D] with RoPE applied to Q and
        K, Q pre-scaled (attention runs with scale 1). Every row's key is stored before any
        row attends, so each reads its own from wherever it reads keys."""
        slots = batch.slot_mapping
        if batch.window_slot_mapping is not None and self.spec.own_table(layer):
            slots = batch.window_slot_mapping
        pool.write(layer, qkv[:, self.spec.num_heads :], slots)
        self.attend(layer, qkv, batch.metadata, pool, out)

    @abstractmethod
    def attend(
        self, layer: int, qkv: torch.Tensor, meta: M, pool: KVPool, out: torch.Tensor
    ) -> None:
        """``forward`` after the K/V are stored."""

    def graph_batch(self, size: int, max_pages: int) -> ForwardBatch[M]:
        """The batch a decode graph of ``size`` rows is captured on (backends with
        ``graphs``): static tensors, each row reading at most ``max_pages`` blocks, that
        ``fill`` rewrites in place before every replay. One batch per size."""
        raise NotImplementedError(f"the {self.name} backend has no CUDA graphs")

    def fill(self, padded: PaddedDecode) -> None:
        """Write ``padded``'s rows into the graph batch of ``padded.batch_size`` (made by
        ``graph_batch``), in place: the captured graph reads those tensors."""
        raise NotImplementedError(f"the {self.name} backend has no CUDA graphs")


def row_tensors(
    step: StepRows, device: torch.device, extra: Sequence[int] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, positions and slots of ``step``'s rows, and ``extra`` (a backend's own
    indices), as int64 on ``device`` in one host-to-device copy."""
    n = step.num_rows
    flat = torch.tensor(
        step.token_ids + step.positions + step.slot_mapping + list(extra), dtype=torch.int64
    ).to(device, non_blocking=True)
    return flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n], flat[3 * n :]
