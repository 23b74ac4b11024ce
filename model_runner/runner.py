"""TorchRunner: executes one ``SchedulerOutput`` on the real model over the paged KV pool.

One step, ``submit(plan) -> handle`` then ``handle.result()`` (``execute`` is both)::

    host    _prepare   plan.prefill/decode -> StepRows.of   (each seq checked: a bad one fails
                       alone; a placeholder token becomes the id of last step's sampled row)
                       -> sampler.prepare                    (parameters, uniforms, penalties)
    device  _run       scrub / pool.copy_blocks              (copy-on-write, before any read)
                       -> paths.choose(step)                 (model_runner.paths: the fused CPU
                                                             kernel, a CUDA graph, or eager)
                       -> rows that sample -> final norm + LM head -> sampler.launch
                       -> sampled ids published (model_runner.future) and copied to the
                          host on a side stream (CUDA), an event when they are there
    host    _finish    sampler.collect -> drafts accepted, matchers advanced -> ModelOutput

``_prepare`` reads everything from the plan on the caller's thread; ``_run`` runs there too
(its kernels are queued on CUDA, so ``submit`` returns at once) or on the CPU step thread
(``use_step_thread``); ``result`` waits only for the copy of the sampled ids. Nothing in a
step synchronises with the device: timings are CUDA events, read after the copy.

Fused or separate: by default both batches of a step go through ONE forward pass (every
linear layer sees prefill and decode tokens together, so weights are read once per step;
attention still takes its own path per batch kind). ``fuse_batches=False`` runs two passes,
which only helps when the timing split between kinds must be exact; with fusion,
``prefill_time_s``/``decode_time_s`` split the step's time by token share.

Speculative decoding: a decode with drafts (``ScheduledSeq.num_draft_tokens``) is verified
in the same pass. Its k + 1 positions are computed like a short prefill chunk attending to the
request's cached KV (the attention backend's chunk path), or, on the fused step, as k + 1
decode rows sharing one block table (every row's K/V is written before any row attends, and
each attends up to its own position). Every position samples (``step.verify_rows``: position i
as output token ``num_output_tokens + i``, with the drafts before it as history), and the
drafts are accepted while they equal the sampled tokens (``step.num_accepted_drafts``).

Failures that belong to one request go to ``ModelOutput.failed`` and the rest of the batch
carries on: a seq whose block table or positions are inconsistent, token ids outside the
vocabulary, non-finite logits (the sampler reports them), or a sampler that raises for one
row (the batch is then re-sampled row by row to isolate it). A request that failed after its
forward pass has its blocks scrubbed of non-finite keys/values at the start of the next step,
so whoever gets those blocks next is not poisoned through masked slots. An exception from the
forward pass itself is a runner failure and propagates.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from model_runner.attention_backends import AttentionSpec, make_attention_backend
from model_runner.base import ModelInfo, PendingStep, StepHandle
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.cuda_graphs import GRAPH_BATCH_SIZES, graph_memory_bytes
from model_runner.device import dtype_name, resolve_dtype, resolve_kv_dtype, select_device
from model_runner.future import FutureTokens
from model_runner.kv_pool import KVPool, default_kv_budget_bytes, num_blocks_for_memory
from model_runner.kv_transfer import PoolBlockIO
from model_runner.lora.files import AdapterFile
from model_runner.lora.layout import LoraWeights, lay_out
from model_runner.lora.registry import LoraRegistry
from model_runner.lora.step import LoraStep, resolve_adapters
from model_runner.model import LlamaModel, rope_inv_freq
from model_runner.paths import graph_sizes, make_paths
from model_runner.prompt_logprobs import PromptScores, score_prompts
from model_runner.sampler import (
    DeviceSample,
    Sampler,
    SampleResult,
    SamplingBatch,
    apply_token_bitmask,
)
from model_runner.sampling_ops import to_device
from model_runner.step import StepLimits, StepRows, num_accepted_drafts, verify_rows
from model_runner.weights import StateDict
from scheduler.output import ModelOutput, ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from model_runner.constraints import ConstraintTracker, Masks


# The placeholder buffer holds at least this many rows (sampled seqs of one step).
_FUTURE_ROWS = 4096


@dataclass(slots=True, eq=False)
class _Step:
    """One submitted step: filled by ``_prepare`` (host), ``_run`` (device) and read by
    ``_finish`` (host)."""

    t0: float
    result: ModelOutput
    block_copies: list[tuple[int, int]]
    scrub: list[int] = field(default_factory=list)  # blocks failed requests left non-finite
    rows: StepRows | None = None  # None: nothing to compute
    sampled: list[ScheduledSeq] = field(default_factory=list)  # seqs that sample
    sample_rows: Sequence[ScheduledSeq] = ()  # what the sampler sees (k + 1 per draft seq)
    placeholders: Mapping[str, int] = field(default_factory=dict)  # request id -> future id
    publishes: bool = False  # its sampled ids feed the next step's placeholders
    masks: Future[Masks] | None = None
    batch: SamplingBatch | None = None  # None: the sampler raised, rows go one by one
    row_batches: list[SamplingBatch | str] = field(default_factory=list)  # or the error
    mask_failed: Mapping[str, str] = field(default_factory=dict)
    clock: _Clock | None = None
    host: DeviceSample | None = None  # the sample, on the host once ``copied`` fired
    copied: torch.cuda.Event | None = None
    collected: SampleResult | None = None  # the one-by-one path's result
    # The forward passes (one, or prefill then decode unfused), each with its adapters' plan.
    passes: list[tuple[StepRows, LoraStep | None]] = field(default_factory=list)
    prompt: PromptScores | None = None  # prompt logprobs of the rows that ask, on the device


class _Clock:
    """Marks along a step: ``perf_counter`` on CPU, CUDA events on the device's stream (read
    once the step is done, so timing never synchronises)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[Any] = []
        self.mark()

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        """Seconds between consecutive marks."""
        marks = self._marks
        if self._cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(marks)]
        return [b - a for a, b in itertools.pairwise(marks)]


class TorchRunner:
    """The ``Runner`` protocol on a PyTorch LLaMA-family model (CPU or CUDA)."""

    def __init__(
        self,
        config: ModelConfig,
        state_dict: StateDict,
        options: RunnerOptions | None = None,
        *,
        sampler: Sampler | None = None,
        constraints: ConstraintTracker | None = None,
    ) -> None:
        """``config``'s model from ``state_dict`` (Hugging Face names; read, not kept), run as
        ``options`` says (default: every default), over a KV pool sized once the weights are
        on the device. ``sampler``: ``Sampler()`` by default. ``constraints``: the matchers of
        structured outputs; their masks are computed on a thread while the model runs."""
        o = options if options is not None else RunnerOptions()
        self.config = config
        self.device = select_device(o.device)
        self.dtype = resolve_dtype(o.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(o.kv_dtype, self.dtype, self.device)
        self.sliding_window = o.sliding_window or config.sliding_window
        self.attention_sinks = o.attention_sinks
        self.block_size = o.block_size
        positions = config.max_position_embeddings
        self.max_model_len = max_len = min(o.max_model_len or positions, positions)
        self.attention = make_attention_backend(o.attention_backend, self._attention_spec())
        self.model = LlamaModel(
            config, state_dict, self.dtype, self.device, self.attention, max_len,
            o.use_onednn, o.activation_bits,
        )  # fmt: skip
        max_rows = o.max_decode_rows or GRAPH_BATCH_SIZES[-1]
        # Placeholder tokens of a step planned ahead resolve here (set before graph capture).
        self.future = self.model.future = FutureTokens(max(max_rows, _FUTURE_ROWS), self.device)
        sizes = graph_sizes(o.cuda_graphs, self.model, max_rows)
        self.num_blocks = o.num_blocks or self._num_blocks_for_budget(o.kv_budget_bytes, sizes)
        self.pool = self._make_pool(bool(sizes))
        self.paths = make_paths(
            self.model,
            self.pool,
            fused_step=o.fused_step,
            fused_max_rows=o.fused_max_rows,
            graph_sizes=sizes,
            max_model_len=max_len,
            scratch_slot=self.num_blocks * o.block_size,
        )
        self.limits = self._step_limits()
        self.fuse_batches = o.fuse_batches
        self.sampler = sampler if sampler is not None else Sampler()
        self.constraints = constraints
        self._mask_thread: ThreadPoolExecutor | None = None
        self._step_thread: ThreadPoolExecutor | None = None  # see use_step_thread
        self._copy_stream: torch.cuda.Stream | None = None  # CUDA: sampled ids to the host
        self._future_index: dict[str, int] = {}  # last step's sampled rows, for placeholders
        self._pending_scrub: list[int] = []  # blocks to scrub before the next step
        self._info = self._model_info(o.name)
        self.lora = LoraRegistry(
            config, self._lay_out_adapter, max_rank=o.max_lora_rank,
            max_loaded=o.max_cpu_loras, base_name=self._info.name,
        )  # fmt: skip

    def _attention_spec(self) -> AttentionSpec:
        """The model's attention as this runner runs it (``__init__``'s first step)."""
        c = self.config
        return AttentionSpec(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            device=self.device,
            sliding_window=self.sliding_window,
            attention_sinks=self.attention_sinks,
            layer_windows=c.layer_windows,
            rope_inv_freq=(
                rope_inv_freq(c, self.max_model_len).to(self.device)
                if self.attention_sinks
                else None
            ),
        )

    def _num_blocks_for_budget(self, budget_bytes: int | None, sizes: tuple[int, ...]) -> int:
        """The pool's blocks in ``budget_bytes`` (default: what the device has left, less
        1 GiB of activations and the graphs' memory, taken out BEFORE the pool is sized)."""
        reserve = 1 << 30
        if sizes:
            reserve += graph_memory_bytes(self.config, sizes[-1], self.dtype.itemsize)
        budget = budget_bytes or default_kv_budget_bytes(
            self.device, activation_reserve_bytes=reserve
        )
        return num_blocks_for_memory(self.config, self.block_size, self.kv_dtype, budget)

    def _make_pool(self, graphs: bool) -> KVPool:
        """The KV pool: ``num_blocks``, and with CUDA graphs one block more, which the cache
        manager never lends: the graphs' padding rows write there."""
        return KVPool.from_config(
            self.config, self.num_blocks + int(graphs), self.block_size, self.kv_dtype,
            self.device, self.dtype,
        )  # fmt: skip

    def _step_limits(self) -> StepLimits:
        """What a step's rows are checked against (``model_runner.step``)."""
        return StepLimits(
            self.block_size, self.num_blocks, self.max_model_len, self.model.vocab_size,
            self.sliding_window, unbounded_positions=self.attention_sinks > 0,
        )  # fmt: skip

    def _model_info(self, name: str | None) -> ModelInfo:
        config = self.config
        return ModelInfo(
            name=name or config.name or config.architecture,
            vocab_size=config.vocab_size,
            max_model_len=self.max_model_len,
            shape=config.kv_shape(dtype_name(self.kv_dtype)),
            eos_token_ids=config.eos_token_ids,
            bos_token_id=config.bos_token_id,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            sliding_window=self.sliding_window,
            kv_dtype=dtype_name(self.kv_dtype),
            weights=self.model.weights_format,
            weight_bytes=self.model.weight_bytes,
            linear_backend=self.model.linear_backend,
            extra={
                "architecture": config.architecture,
                "num_blocks": str(self.num_blocks),
                "block_size": str(self.block_size),
                "kv_pool_bytes": str(self.pool.num_bytes),
                "fused_step": str(self.paths.fused is not None).lower(),
                "fuse_batches": str(self.fuse_batches).lower(),
                "attention_backend": self.attention.name,
                "cuda_graphs": str(self.paths.graphs is not None).lower(),
            },
        )

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def adapters(self) -> LoraRegistry:
        """The LoRA adapters this runner serves (``Runner.adapters``)."""
        return self.lora

    @property
    def lora_dtype(self) -> torch.dtype:
        """The LoRA adapters' dtype: fp16 for the fused kernels (half the bytes a step reads;
        their error is far below the 4-bit weights'), the model's dtype elsewhere."""
        return torch.float16 if self.paths.fused is not None else self.dtype

    def _lay_out_adapter(self, adapter: AdapterFile) -> LoraWeights:
        return lay_out(adapter, self.config, self.lora_dtype, self.device)

    def block_io(self) -> PoolBlockIO:
        """The KV pool's blocks as bytes (tier 2)."""
        return PoolBlockIO(self.pool)

    # ------------------------------------------------------------------ the step

    @property
    def can_run_ahead(self) -> bool:
        """Whether ``submit`` returns while the step still runs: on CUDA, or on a CPU step
        thread (``use_step_thread``)."""
        return self.device.type == "cuda" or self._step_thread is not None

    def use_step_thread(self, on: bool = True) -> None:
        """Run CPU steps on a thread of their own, so ``submit`` returns at once and the
        engine plans the next step meanwhile (torch and the kernels release the GIL)."""
        if on and self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-step")
        elif not on and self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None

    def scrub_blocks(self, block_ids: Sequence[int]) -> None:
        """Zero those of ``block_ids`` (in the pool) that hold a non-finite key or value at
        the start of the next step, before it reads the KV (after a step that raised: the
        engine frees its requests' blocks, which a NaN it wrote would poison)."""
        self._pending_scrub.extend(b for b in block_ids if 0 <= b < self.num_blocks)

    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Compute ``plan``: KV of every scheduled token into the pool, one sampled token
        for every seq with ``do_sample``. Never mutates ``plan``."""
        return self.submit(plan).result()

    def submit(self, plan: SchedulerOutput) -> StepHandle:
        """Start computing ``plan`` (``base.Runner.submit``'s contract): everything is read
        from the plan here; the forward pass and the sampling are launched on the device (or
        queued on the step thread); the sampled ids are copied to the host on a side stream.
        A placeholder token is read from the previous step's sampled ids on the device."""
        step = self._prepare(plan)
        if self._step_thread is not None:
            future = self._step_thread.submit(self._run, step)
            return PendingStep(lambda: self._finish(future.result()))
        self._run(step)
        return PendingStep(lambda: self._finish(step))

    @torch.inference_mode()
    def step_logits(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run ``plan`` like ``execute`` but return fp32 logits of EVERY computed position,
        per request (``[num_tokens, V]``), instead of sampling. For tests and tools."""
        self._check_copies(plan.block_copies)
        if plan.block_copies:
            self.pool.copy_blocks(plan.block_copies)
        step = StepRows.of(plan, self.limits)
        failed = dict(step.failed)
        step, adapters = self._adapters(step, failed)
        if failed:
            raise ValueError(f"invalid plan: {failed}")
        if step.is_empty:
            return {}
        hidden = self.paths.forward(step, LoraStep.of(step, adapters) if adapters else None)
        logits = self.model.compute_logits(hidden)
        out: dict[str, torch.Tensor] = {}
        row = 0
        for s in step.seqs:
            out[s.request_id] = logits[row : row + s.num_tokens]
            row += s.num_tokens
        return out

    # ------------------------------------------------------------------ host, before

    def _prepare(self, plan: SchedulerOutput) -> _Step:
        """Everything the step needs from the plan, read now on the caller's thread."""
        step = _Step(time.perf_counter(), ModelOutput(), list(plan.block_copies))
        if self.constraints is not None:
            self.constraints.drop(plan.finished_request_ids)
        self._check_copies(step.block_copies)
        step.scrub, self._pending_scrub = self._pending_scrub, []
        placeholders = self._future_index
        rows = StepRows.of(plan, self.limits, placeholders)
        step.result.failed.update(rows.failed)
        rows, adapters = self._adapters(rows, step.result.failed)
        self._future_index = {}
        if rows.is_empty:
            return step
        step.rows = rows
        step.passes = self._passes(rows, adapters)
        sampled = rows.sampled()
        step.sampled = sampled
        step.sample_rows = sampled
        if any(s.num_draft_tokens for s in sampled):
            step.sample_rows = [
                r for s in sampled for r in (verify_rows(s) if s.num_draft_tokens else (s,))
            ]
        else:
            # This step's sampled ids feed the next step's placeholders (row j -> -(j + 1)).
            step.publishes = True
            num = min(len(sampled), self.future.capacity)
            self._future_index = {sampled[j].request_id: FutureTokens.encode(j) for j in range(num)}
        step.placeholders = placeholders
        step.masks = self._start_masks(sampled)
        prepare = self.sampler.prepare
        vocab_size = self.model.vocab_size
        try:
            step.batch = prepare(step.sample_rows, self.device, vocab_size, placeholders)
        except Exception:
            # Row by row, so only the culprit fails (an error path).
            for seq in step.sample_rows:
                try:
                    batch = prepare([seq], self.device, vocab_size, placeholders)
                except Exception as exc:
                    step.row_batches.append(f"sampling failed: {type(exc).__name__}: {exc}")
                else:
                    step.row_batches.append(batch)
        return step

    def _check_copies(self, block_copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write pairs must lie in the pool: a copy outside it is a bug."""
        bad = [c for c in block_copies if not all(0 <= b < self.num_blocks for b in c)]
        if bad:
            raise ValueError(f"block copies {bad} outside the pool of {self.num_blocks}")

    def _start_masks(self, seqs: Sequence[ScheduledSeq]) -> Future[Masks] | None:
        """Start computing the constrained rows' masks on the mask thread (llguidance
        releases the GIL), so they are ready when the logits are."""
        tracker = self.constraints
        if tracker is None or not any(s.sampling.constraint is not None for s in seqs):
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
        return self._mask_thread.submit(tracker.compute_masks, seqs)

    # ------------------------------------------------------------------ device

    @torch.inference_mode()
    def _run(self, step: _Step) -> _Step:
        """The device's part, in stream order (or on the step thread): scrubs and copies,
        the forward pass, the masks, the sampling, the sampled ids published for the next
        step, and their copy to the host started on the side stream."""
        if step.scrub:
            self.pool.scrub_blocks(step.scrub)
        if step.block_copies:
            self.pool.copy_blocks(step.block_copies)
        if step.rows is None:
            return step
        clock = step.clock = _Clock(self.device)
        (first, lora), *second = step.passes
        logits = self._forward_logits(first, lora, step)
        if second:
            clock.mark()
            logits = torch.cat([logits, self._forward_logits(*second[0])])
        clock.mark()
        if step.masks is not None:
            masks = step.masks.result()
            step.mask_failed = masks.failed
            step.result.constraint_mask_time_s = masks.compute_time_s
            if masks.bitmask is not None:
                apply_token_bitmask(logits, torch.from_numpy(masks.bitmask))
        if step.batch is not None:
            sample = self.sampler.launch(logits, step.batch, self.future.resolve)
            if step.publishes:
                self.future.publish(sample.token_ids)
            clock.mark()
            step.host, step.copied = self._to_host(sample)
        else:
            clock.mark()
            step.collected = self._sample_one_by_one(logits, step)
        return step

    def _adapters(
        self, step: StepRows, failed: dict[str, str]
    ) -> tuple[StepRows, dict[str, LoraWeights]]:
        """The weights of the step's adapters by name; seqs whose adapter is not resident
        go to ``failed`` and out of the step (the rest of it runs)."""
        if not step.has_adapters:
            return step, {}
        adapters, missing = resolve_adapters(step.seqs, self.lora.weights)
        if missing:
            failed.update(missing)
            step = StepRows.from_seqs(
                [s for s in step.prefill if s.request_id not in missing],
                [s for s in step.decode if s.request_id not in missing],
                step.block_size,
                step.null_block_id,
                step.failed,
            )
        return step, adapters

    def _passes(
        self, rows: StepRows, adapters: dict[str, LoraWeights]
    ) -> list[tuple[StepRows, LoraStep | None]]:
        """The step's forward passes: one, or with ``fuse_batches=False`` the prefill rows
        then the decode rows; each with its adapters planned here, on the host."""
        parts = (rows,) if self.fuse_batches or not (rows.prefill and rows.decode) else rows.split()
        return [(p, LoraStep.of(p, adapters) if adapters else None) for p in parts]

    def _forward_logits(
        self, step: StepRows, lora: LoraStep | None, scores: _Step | None = None
    ) -> torch.Tensor:
        """Logits [R, V] of the rows that sample, prefill rows first, in row order; the
        prompt logprobs of the rows that ask go to ``scores.prompt``."""
        hidden = self.paths.forward(step, lora)
        if scores is not None:
            scores.prompt = score_prompts(step, hidden, self.model.compute_logits)
        rows = step.sample_rows()
        if not rows:
            return torch.empty(0, self.model.vocab_size, device=self.device)
        if len(rows) != step.num_rows:
            hidden = hidden.index_select(0, to_device(rows, torch.int64, self.device))
        return self.model.compute_logits(hidden)

    def _to_host(self, sample: DeviceSample) -> tuple[DeviceSample, torch.cuda.Event | None]:
        """Start copying ``sample`` to pinned host memory on the side stream, after the step's
        work on the main stream; the event says when it is there. On CPU: the sample."""
        if self.device.type != "cuda":
            return sample, None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))

        def copy(tensor: torch.Tensor) -> torch.Tensor:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # not reused before the copy has read it
            return host

        with torch.cuda.stream(stream):
            host = sample.map(copy)
            copied = torch.cuda.Event()
            copied.record(stream)
        return host, copied

    def _sample_one_by_one(self, logits: torch.Tensor, step: _Step) -> SampleResult:
        """The sampler raised for the batch: sample each row alone, and fail only the rows
        that raise (an error path: it waits for each row's token)."""
        result = SampleResult(token_ids=[], logprobs=[])
        sampler = self.sampler
        for i, (seq, batch) in enumerate(zip(step.sample_rows, step.row_batches, strict=True)):
            if isinstance(batch, str):  # its inputs could not be prepared
                row = SampleResult([0], [None], {seq.request_id: batch})
            else:
                try:
                    sample = sampler.launch(logits[i : i + 1], batch, self.future.resolve)
                    row = sampler.collect(batch, sample.map(lambda t: t.cpu()))
                except Exception as exc:
                    error = f"sampling failed: {type(exc).__name__}: {exc}"
                    row = SampleResult([0], [None], {seq.request_id: error})
            result.token_ids.extend(row.token_ids)
            result.logprobs.extend(row.logprobs)
            result.failed.update(row.failed)
        return result

    # ------------------------------------------------------------------ host, after

    def _finish(self, step: _Step) -> ModelOutput:
        """The step's ``ModelOutput`` once its sample is on the host: one token per seq after
        the drafts it accepted, logprobs, constrained rows' matchers advanced, timings."""
        result = step.result
        if step.rows is None:
            result.decode_time_s = time.perf_counter() - step.t0
            return result
        if step.copied is not None:
            step.copied.synchronize()
        if step.collected is not None:
            sampled = step.collected
        else:
            assert step.batch is not None and step.host is not None
            sampled = self.sampler.collect(step.batch, step.host)
        failed = dict(step.mask_failed)
        failed.update(sampled.failed)
        result.failed.update(failed)
        if step.prompt is not None:
            result.prompt_logprobs.update(step.prompt.to_host(result.failed))
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        row = 0
        for seq in step.sampled:
            rid = seq.request_id
            num_rows = 1 + seq.num_draft_tokens
            if rid not in failed:
                num_accepted = 0
                if seq.num_draft_tokens:
                    num_accepted = num_accepted_drafts(seq, token_ids[row : row + num_rows])
                    result.num_accepted_drafts[rid] = num_accepted
                    result.sampled_token_ids[rid] = int(token_ids[row + num_accepted])
                else:
                    result.sampled_token_ids[rid] = int(token_ids[row])
                    token_logprobs = logprobs[row]
                    if token_logprobs is not None:
                        result.logprobs[rid] = token_logprobs
                if step.masks is not None:
                    accepted = [*seq.token_ids[1 : 1 + num_accepted], result.sampled_token_ids[rid]]
                    self._advance_constraint(seq, accepted, result)
            row += num_rows
        self._time(step)
        if result.failed:
            # Zero the non-finite KV the failed requests left, before the next step runs
            # (their blocks are freed once this result is applied).
            self._pending_scrub.extend(self._blocks_of(step.rows, result.failed))
        return result

    def _time(self, step: _Step) -> None:
        """Split the step's device time between prefill and decode: by sampled rows' share
        when both ran in one pass, else each pass its own time plus its share of sampling."""
        assert step.rows is not None and step.clock is not None
        result = step.result
        intervals = step.clock.intervals()
        rows = step.rows
        if len(intervals) == 3:  # prefill pass | decode pass | sampling
            prefill, decode = rows.split()
            num_p = len(prefill.sample_rows())
            share = num_p / (num_p + len(decode.sample_rows()) or 1)
            result.prefill_time_s = intervals[0] + intervals[2] * share
            result.decode_time_s = intervals[1] + intervals[2] * (1.0 - share)
            return
        elapsed = sum(intervals)
        result.prefill_time_s = elapsed * rows.num_prefill_rows / rows.num_rows
        result.decode_time_s = elapsed - result.prefill_time_s

    def _advance_constraint(
        self, seq: ScheduledSeq, token_ids: list[int], result: ModelOutput
    ) -> None:
        """Feed this step's tokens to ``seq``'s matcher; a token it refuses fails the request."""
        assert self.constraints is not None
        error = self.constraints.accept(seq, token_ids)
        if error is not None:
            rid = seq.request_id
            result.failed[rid] = error
            result.sampled_token_ids.pop(rid, None)
            result.num_accepted_drafts.pop(rid, None)
            result.logprobs.pop(rid, None)

    def _blocks_of(self, rows: StepRows, failed: Mapping[str, str]) -> list[int]:
        """The blocks the failed seqs of ``rows`` wrote (to scrub of non-finite KV)."""
        return [
            b
            for s in rows.seqs
            if s.request_id in failed
            for b in s.block_ids[: -(-s.end_pos // self.block_size)]
        ]
