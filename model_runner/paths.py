"""How a step's hidden states are computed: three paths, one chooser.

- ``FusedPath``: every layer of the step in one call of kvserve's CPU kernels (``FusedStep``);
  quantized models on CPU, any mix of prefill chunks, decodes and draft rows.
- ``GraphPath``: decode steps (draft rows included) replayed from CUDA graphs
  (``DecodeGraphs``), padded to the next captured size.
- ``EagerPath``: the model's forward over the attention backend's batch; runs any step.

Each says whether it ``fits`` a step and runs it (``forward``); ``ForwardPaths.choose`` takes
the first that fits, fused, then graphs, then eager (vLLM's ``CudagraphDispatcher.dispatch``
in the same role). A path's limits are constructor arguments (``FusedPath(max_rows=...)``,
the graphs' captured sizes), decided once when the runner starts.

Why every step of a quantized model takes the fused path by default (no row bound): a row's
numbers then never depend on what else is in its batch (the eager path's attention sums in
another order, and an int8 activation near a rounding boundary could then flip a token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from model_runner.block_table import first_key_block
from model_runner.config import ModelConfig
from model_runner.cuda_graphs import DecodeGraphs, capture_sizes, graph_bucket
from model_runner.fused_step import FusedStep
from model_runner.kv_pool import KVPool
from model_runner.lora.backend import TorchBackend
from model_runner.lora.updates import LoraBackend
from model_runner.model import LlamaModel
from model_runner.step import StepRows


class ForwardPath(Protocol):
    name: str

    def fits(self, step: StepRows) -> bool:
        """Whether this path can run ``step``."""
        ...

    def forward(self, step: StepRows) -> torch.Tensor:
        """Hidden states [rows, hidden] of every row of ``step`` (before the final norm);
        writes every layer's K/V of those rows into the pool, with the rows' adapters
        (``step.lora``; ``fits`` said this path takes them)."""
        ...


class EagerPath:
    """The model's forward pass over the attention backend's batch: fits every step. Its
    adapters' updates come from ``lora`` (``lora_backend``, chosen when the
    runner starts)."""

    name = "eager"

    def __init__(self, model: LlamaModel, pool: KVPool, lora: LoraBackend) -> None:
        self.model = model
        self.pool = pool
        self.lora = lora

    def fits(self, step: StepRows) -> bool:
        return True

    def forward(self, step: StepRows) -> torch.Tensor:
        batch = self.model.attention.build(step)
        batch.adapters = self.lora.updates(step)
        return self.model.forward(batch, self.pool)


class FusedPath:
    """Steps of up to ``max_rows`` rows as one ``FusedStep`` call, except those that must
    skip released positions inside the window (``skips_released``)."""

    name = "fused"

    def __init__(self, kernel: FusedStep, sliding_window: int | None, max_rows: int) -> None:
        self.kernel = kernel
        self.sliding_window = sliding_window
        self.max_rows = max_rows

    def fits(self, step: StepRows) -> bool:
        return step.num_rows <= self.max_rows and not skips_released(step, self.sliding_window)

    def forward(self, step: StepRows) -> torch.Tensor:
        return self.kernel.forward(step)


class GraphPath:
    """Decode steps replayed from the graph of the next captured size up (``graph_bucket``)."""

    name = "graphs"

    def __init__(self, graphs: DecodeGraphs) -> None:
        self.graphs = graphs

    def fits(self, step: StepRows) -> bool:
        # No graphs were captured with adapters: a step with adapter rows runs eager.
        return not step.has_adapters and graph_bucket(step, self.graphs.sizes) is not None

    def forward(self, step: StepRows) -> torch.Tensor:
        assert step.lora is None, "a step with adapters never takes the graphs"
        return self.graphs.run(step)


@dataclass(slots=True)
class ForwardPaths:
    """The paths a runner has; ``choose`` picks one per step."""

    eager: EagerPath
    fused: FusedPath | None = None
    graphs: GraphPath | None = None

    def choose(self, step: StepRows) -> ForwardPath:
        """The first path that fits ``step``: fused, graphs, then eager."""
        if self.fused is not None and self.fused.fits(step):
            return self.fused
        if self.graphs is not None and self.graphs.fits(step):
            return self.graphs
        return self.eager

    def forward(self, step: StepRows) -> torch.Tensor:
        return self.choose(step).forward(step)


def graph_sizes(
    cuda_graphs: bool | None, model: LlamaModel, max_decode_rows: int
) -> tuple[int, ...]:
    """The decode batch sizes to capture as CUDA graphs, () for none: ``capture_sizes``
    up to ``max_decode_rows`` when graphs are on. ``cuda_graphs=None``: on when the device is
    CUDA and the attention backend supports graphs; True where they cannot run raises."""
    can_graph = model.device.type == "cuda" and model.attention.graphs
    if cuda_graphs and not can_graph:
        raise ValueError("cuda_graphs=True needs a CUDA device and a backend with graphs")
    if not (can_graph if cuda_graphs is None else cuda_graphs):
        return ()
    return capture_sizes(max_decode_rows)


def make_paths(
    model: LlamaModel,
    pool: KVPool,
    *,
    fused_step: bool | None,
    fused_max_rows: int,
    graph_sizes: tuple[int, ...],
    max_model_len: int,
    scratch_slot: int,
    lora: LoraBackend | None = None,
) -> ForwardPaths:
    """The runner's paths. ``fused_step``: None = when supported, True raises where it is
    not. ``graph_sizes`` (from ``graph_sizes``) are captured here, after the pool exists;
    ``scratch_slot`` is a slot the cache manager never lends (padding rows write there).
    ``lora``: the eager path's adapter backend (default: ``lora_backend``'s for the
    model's device)."""
    spec = model.attention.spec
    if not model.attention.yields_to_fused:
        unsupported: str | None = f"the {model.attention.name} attention backend runs every step"
    elif spec.attention_sinks:
        unsupported = "attention sinks take the chunk path"
    else:  # the last check: it may load the CPU kernels (only for a quantized CPU model)
        unsupported = FusedStep.unsupported(model, pool)
    if fused_step and unsupported is not None:
        raise ValueError(f"fused_step=True but {unsupported}")
    paths = ForwardPaths(EagerPath(model, pool, lora or lora_backend(model.config, model.device)))
    if fused_step is not False and unsupported is None:
        kernel = FusedStep(model, pool, [spec.window(i) for i in range(len(model.layers))])
        paths.fused = FusedPath(kernel, spec.sliding_window, fused_max_rows)
    if graph_sizes:
        graphs = DecodeGraphs(
            model, pool, max_model_len=max_model_len, scratch_slot=scratch_slot, sizes=graph_sizes
        )
        with torch.inference_mode():
            graphs.capture()
        paths.graphs = GraphPath(graphs)
    return paths


def skips_released(step: StepRows, sliding_window: int | None) -> bool:
    """Whether a seq of ``step`` must skip positions released inside its window (the
    adaptive KV strategy released them to the null block): the fused kernel reads every
    block of the window, so the eager path runs such a step."""
    null = step.null_block_id
    if null is None:
        return False
    bs = step.block_size
    for s in step.seqs:
        if s.block_ids[0] != null:
            continue
        pos = s.start_pos
        live = first_key_block(s.block_ids, pos, bs, None, 0, null)
        if live > first_key_block(s.block_ids, pos, bs, sliding_window, 0, None):
            return True
    return False


# The LoRA backends ``lora_backend`` chooses from ("auto": triton on CUDA, torch elsewhere).
LORA_KINDS = ("auto", "torch", "triton")


def lora_backend(config: ModelConfig, device: torch.device, kind: str = "auto") -> LoraBackend:
    """The eager path's backend: ``kind`` one of ``LORA_KINDS`` ("auto": the Triton kernels on
    CUDA, torch elsewhere; "triton" elsewhere runs them in Triton's interpreter)."""
    if kind not in LORA_KINDS:
        raise ValueError(f"LoRA kernels {kind!r}: use {', '.join(LORA_KINDS)}")
    if kind == "triton" or (kind == "auto" and device.type == "cuda"):
        from model_runner.lora.cuda import TritonBackend  # needs triton

        return TritonBackend(config, device)
    return TorchBackend(config, device)
