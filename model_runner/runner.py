"""TorchRunner: executes one ``SchedulerOutput`` on the real model over the paged KV pool.

One step, ``submit(plan) -> handle`` then ``handle.result()`` (``execute`` is both)::

    host    _prepare   plan.prefill/decode -> StepRows.of   (each seq checked: a bad one fails
                       alone; a placeholder token becomes the id of last step's sampled row:
                       model_runner.future.Placeholders, which owns every placeholder here)
                       -> sampler.prepare                    (parameters, uniforms, penalties)
                       -> Prepared (its Work: rows, passes, sampling, masks; step_record)
    device  _run       scrub / pool.copy_blocks              (copy-on-write, before any read)
                       -> paths.choose(step)                 (model_runner.paths: the fused CPU
                                                             kernel, a CUDA graph, or eager)
                       -> rows that sample -> final norm + LM head -> sampler.launch
                       -> sampled ids published (Placeholders) and copied to the host on a
                          side stream (CUDA), an event when they are there -> Launched
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

import dataclasses
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from model_runner.attention_backends import AttentionSpec, make_attention_backend
from model_runner.base import ModelInfo, PendingStep, StepHandle
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.cuda_graphs import GRAPH_BATCH_SIZES, graph_memory_bytes
from model_runner.device import dtype_name, resolve_dtype, resolve_kv_dtype, select_device
from model_runner.future import Placeholders
from model_runner.kv_pool import (
    KVPool,
    default_kv_budget_bytes,
    kv_block_bytes,
    num_blocks_for_memory,
)
from model_runner.kv_transfer import PoolBlockIO
from model_runner.lora.files import AdapterFile
from model_runner.lora.layout import LoraWeights, lay_out
from model_runner.lora.registry import LoraRegistry
from model_runner.model import LlamaModel, rope_inv_freq
from model_runner.paths import graph_sizes, make_paths
from model_runner.prompt_logprobs import score_prompts
from model_runner.sampler import (
    DeviceSample,
    RowByRow,
    Sampler,
    SamplingBatch,
    apply_token_bitmask,
)
from model_runner.sampling_ops import to_device
from model_runner.step import StepLimits, StepRows, num_accepted_drafts, verify_rows
from model_runner.step_record import Collected, Launched, OnTheWay, Prepared, StepClock, Work
from model_runner.weights import StateDict
from scheduler.output import ModelOutput, ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from model_runner.constraints import ConstraintTracker, Masks


# The placeholder buffer holds at least this many rows (sampled seqs of one step).
_FUTURE_ROWS = 4096


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
        self.num_window_blocks = o.sliding_layer_blocks
        self.window_layers = _window_layers(config, o.sliding_layer_blocks)
        positions = config.max_position_embeddings
        self.max_model_len = max_len = min(o.max_model_len or positions, positions)
        self.attention = make_attention_backend(o.attention_backend, self._attention_spec())
        max_rows = o.max_decode_rows or GRAPH_BATCH_SIZES[-1]
        # The placeholder tokens of a step planned ahead (the model's embedding resolves them).
        self.placeholders = Placeholders(max(max_rows, _FUTURE_ROWS), self.device)
        self.model = LlamaModel(
            config, state_dict, self.dtype, self.device, self.attention, max_len,
            o.use_onednn, o.activation_bits, future=self.placeholders.future,
        )  # fmt: skip
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
            window_tables=bool(self.window_layers),
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
        if not self.window_layers:
            return num_blocks_for_memory(self.config, self.block_size, self.kv_dtype, budget)
        # The sliding layers' pool first; the other layers' blocks in what is left.
        c, num_window = self.config, len(self.window_layers)
        per_layer = kv_block_bytes(c, self.block_size, self.kv_dtype) // c.num_layers
        rest = budget - self.num_window_blocks * num_window * per_layer
        num_blocks = rest // (per_layer * (c.num_layers - num_window))
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget} bytes holds the sliding layers' "
                f"{self.num_window_blocks} blocks but no block of the other layers"
            )
        return int(num_blocks)

    def _make_pool(self, graphs: bool) -> KVPool:
        """The KV pool: ``num_blocks``, and with CUDA graphs one block more, which the cache
        manager never lends: the graphs' padding rows write there."""
        return KVPool.from_config(
            self.config, self.num_blocks + int(graphs), self.block_size, self.kv_dtype,
            self.device, self.dtype, self.window_layers, self.num_window_blocks,
        )  # fmt: skip

    def _step_limits(self) -> StepLimits:
        """What a step's rows are checked against (``model_runner.step``)."""
        windows = [w for w in self.config.layer_windows if w is not None]
        return StepLimits(
            self.block_size, self.num_blocks, self.max_model_len, self.model.vocab_size,
            self.sliding_window, unbounded_positions=self.attention_sinks > 0,
            num_window_blocks=self.num_window_blocks,
            layer_window=max(windows) if self.window_layers else None,
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
                "sliding_layer_blocks": str(self.num_window_blocks),
                "sliding_layers": str(len(self.window_layers)),
                "sliding_layer_window": str(self.limits.layer_window or 0),
                "num_layers": str(config.num_layers),
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
        n = self.num_blocks + self.num_window_blocks
        self._pending_scrub.extend(b for b in block_ids if 0 <= b < n)

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
            launched = self._step_thread.submit(self._run, step)
            return PendingStep(lambda: self._finish(step, launched.result()))
        done = self._run(step)
        return PendingStep(lambda: self._finish(step, done))

    @torch.inference_mode()
    def step_logits(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run ``plan`` like ``execute`` but return fp32 logits of EVERY computed position,
        per request (``[num_tokens, V]``), instead of sampling. For tests and tools."""
        self._check_copies(plan.block_copies)
        if plan.block_copies:
            self.pool.copy_blocks(plan.block_copies)
        step = StepRows.of(plan, self.limits, adapters=self.lora.weights)
        if step.failed:
            raise ValueError(f"invalid plan: {dict(step.failed)}")
        if step.is_empty:
            return {}
        hidden = self.paths.forward(step)
        logits = self.model.compute_logits(hidden)
        out: dict[str, torch.Tensor] = {}
        row = 0
        for s in step.seqs:
            out[s.request_id] = logits[row : row + s.num_tokens]
            row += s.num_tokens
        return out

    # ------------------------------------------------------------------ host, before

    def _prepare(self, plan: SchedulerOutput) -> Prepared:
        """Everything the step needs from the plan, read now on the caller's thread."""
        t0 = time.perf_counter()
        if self.constraints is not None:
            self.constraints.drop(plan.finished_request_ids)
        self._check_copies(plan.block_copies)
        scrub, self._pending_scrub = self._pending_scrub, []
        step = Prepared(t0, ModelOutput(), list(plan.block_copies), scrub)
        failed = step.result.failed
        rows = StepRows.of(plan, self.limits, self.placeholders, self.lora.weights)
        failed.update(rows.failed)
        if rows.is_empty:
            self.placeholders.advance(None)
            return step
        passes = self._passes(rows)
        sampled = rows.sampled()
        sample_rows: Sequence[ScheduledSeq] = sampled
        drafts = any(s.num_draft_tokens for s in sampled)
        if drafts:
            sample_rows = [
                r for s in sampled for r in (verify_rows(s) if s.num_draft_tokens else (s,))
            ]
        # This step's sampled ids feed the next step's placeholders (one row per seq).
        publishes = self.placeholders.advance(None if drafts else sampled)
        masks = self._start_masks(sampled)
        sampling = self.sampler.prepare_or_isolate(
            sample_rows, self.device, self.model.vocab_size, self.placeholders.history_id
        )
        work = Work(rows, passes, sampled, sample_rows, sampling, publishes, masks)
        return dataclasses.replace(step, work=work)

    def _check_copies(self, block_copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write pairs must lie in the pool: a copy outside it is a bug."""
        n = self.num_blocks + self.num_window_blocks
        bad = [c for c in block_copies if not all(0 <= b < n for b in c)]
        if bad:
            raise ValueError(f"block copies {bad} outside the pool of {n}")

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
    def _run(self, step: Prepared) -> Launched | None:
        """The device's part, in stream order (or on the step thread): scrubs and copies,
        the forward pass, the masks, the sampling, the sampled ids published for the next
        step, and their copy to the host started on the side stream. None: nothing ran."""
        if step.scrub:
            self.pool.scrub_blocks(step.scrub)
        if step.block_copies:
            self.pool.copy_blocks(step.block_copies)
        work = step.work
        if work is None:
            return None
        clock = StepClock(self.device)
        first, *second = work.passes
        hidden = self.paths.forward(first)
        prompt = score_prompts(first, hidden, self.model.compute_logits)
        logits = self._sampled_logits(first, hidden)
        if second:
            clock.mark()
            rows = second[0]
            logits = torch.cat([logits, self._sampled_logits(rows, self.paths.forward(rows))])
        clock.mark()
        mask_failed: Mapping[str, str] = {}
        if work.masks is not None:
            masks = work.masks.result()
            mask_failed = masks.failed
            step.result.constraint_mask_time_s = masks.compute_time_s
            if masks.bitmask is not None:
                apply_token_bitmask(logits, torch.from_numpy(masks.bitmask))
        sampling, resolve = work.sampling, self.placeholders.resolve
        if isinstance(sampling, RowByRow):
            clock.mark()
            sample: OnTheWay | Collected = Collected(
                self.sampler.sample_row_by_row(logits, sampling, resolve)
            )
        else:
            on_device = self.sampler.launch(logits, sampling, resolve)
            if work.publishes:
                self.placeholders.publish(on_device.token_ids)
            clock.mark()
            sample = self._to_host(sampling, on_device)
        return Launched(sample, clock, prompt, mask_failed)

    def _passes(self, rows: StepRows) -> list[StepRows]:
        """The step's forward passes: one, or with ``fuse_batches=False`` the prefill rows
        then the decode rows (each with its rows' adapters)."""
        if self.fuse_batches or not (rows.prefill and rows.decode):
            return [rows]
        return list(rows.split())

    def _sampled_logits(self, step: StepRows, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] of the rows of ``step`` that sample, prefill rows first, in row
        order, from its ``hidden`` states."""
        rows = step.sample_rows()
        if not rows:
            return torch.empty(0, self.model.vocab_size, device=self.device)
        if len(rows) != step.num_rows:
            hidden = hidden.index_select(0, to_device(rows, torch.int64, self.device))
        return self.model.compute_logits(hidden)

    def _to_host(self, batch: SamplingBatch, sample: DeviceSample) -> OnTheWay:
        """Start copying ``batch``'s ``sample`` to the host on the side stream (CUDA); on
        CPU it is there."""
        if self.device.type != "cuda":
            return OnTheWay(batch, sample, None)
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        return OnTheWay.start(batch, sample, self._copy_stream)

    # ------------------------------------------------------------------ host, after

    def _finish(self, step: Prepared, launched: Launched | None) -> ModelOutput:
        """The step's ``ModelOutput`` once its sample is on the host: one token per seq after
        the drafts it accepted, logprobs, constrained rows' matchers advanced, timings."""
        result = step.result
        work = step.work
        if work is None or launched is None:
            result.decode_time_s = time.perf_counter() - step.t0
            return result
        sampled = launched.sample.collect(self.sampler)
        failed = dict(launched.mask_failed)
        failed.update(sampled.failed)
        result.failed.update(failed)
        if launched.prompt is not None:
            result.prompt_logprobs.update(launched.prompt.to_host(result.failed))
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        row = 0
        for seq in work.sampled:
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
                if work.masks is not None:
                    accepted = [*seq.token_ids[1 : 1 + num_accepted], result.sampled_token_ids[rid]]
                    self._advance_constraint(seq, accepted, result)
            row += num_rows
        self._time(result, work.rows, launched.clock)
        if result.failed:
            # Zero the non-finite KV the failed requests left, before the next step runs
            # (their blocks are freed once this result is applied).
            self._pending_scrub.extend(self._blocks_of(work.rows, result.failed))
        return result

    def _time(self, result: ModelOutput, rows: StepRows, clock: StepClock) -> None:
        """Split the step's device time between prefill and decode: by sampled rows' share
        when both ran in one pass, else each pass its own time plus its share of sampling."""
        intervals = clock.intervals()
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
        blocks: list[int] = []
        for s in rows.seqs:
            if s.request_id in failed:
                n = -(-s.end_pos // self.block_size)
                blocks += s.block_ids[:n]
                blocks += (s.window_block_ids or [])[:n]
        return blocks


def _window_layers(config: ModelConfig, num_window_blocks: int) -> tuple[int, ...]:
    """The layers whose KV lives in the sliding layers' own pool of ``num_window_blocks``
    (``RunnerOptions.sliding_layer_blocks``): those with a window, on a model that also has
    global layers; () for none."""
    if not num_window_blocks:
        return ()
    windows = config.layer_windows
    sliding = tuple(i for i, w in enumerate(windows) if w is not None)
    if not sliding or len(sliding) == len(windows) or len(set(windows) - {None}) > 1:
        raise ValueError(
            "sliding_layer_blocks needs a model whose layers are sliding (one window) and "
            f"global, as Gemma 3's; {config.architecture}'s layer windows are "
            f"{sorted(set(windows), key=str)}"
        )
    return sliding
