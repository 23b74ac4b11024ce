"""TorchRunner: executes one ``SchedulerOutput`` on the real model over the paged KV pool.

One step::

    plan.block_copies  -> pool.copy_blocks            (copy-on-write, before anything reads)
    plan.prefill/decode -> StepRows.of                 (each seq checked: a bad one fails alone)
                        -> paths.choose(step)          (model_runner.paths: the fused CPU kernel,
                                                        a CUDA graph, or eager: attention.build
                                                        once, model.forward over every layer)
                        -> rows that sample -> final norm + LM head -> sampler
                        -> ModelOutput

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
forward pass has its blocks scrubbed of non-finite keys/values, so whoever gets those blocks
next is not poisoned through masked slots. An exception from the forward pass itself is a
runner failure and propagates.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from model_runner.attention_backends import AttentionSpec, make_attention_backend
from model_runner.base import ModelInfo
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.cuda_graphs import GRAPH_BATCH_SIZES, graph_memory_bytes
from model_runner.device import dtype_name, resolve_dtype, resolve_kv_dtype, select_device
from model_runner.kv_pool import KVPool, default_kv_budget_bytes, num_blocks_for_memory
from model_runner.kv_transfer import PoolBlockIO
from model_runner.model import LlamaModel, rope_inv_freq
from model_runner.paths import graph_sizes, make_paths
from model_runner.sampler import Sampler, SampleResult, apply_token_bitmask
from model_runner.step import StepLimits, StepRows, num_accepted_drafts, verify_rows
from model_runner.weights import StateDict
from scheduler.output import ModelOutput, ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from model_runner.constraints import ConstraintTracker, Masks


class SamplerLike(Protocol):
    """``sampler.Sampler``'s contract: one token (and logprobs) per row of ``logits``."""

    def sample(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> SampleResult: ...


class TorchRunner:
    """The ``Runner`` protocol on a PyTorch LLaMA-family model (CPU or CUDA)."""

    def __init__(
        self,
        config: ModelConfig,
        state_dict: StateDict,
        options: RunnerOptions | None = None,
        *,
        sampler: SamplerLike | None = None,
        constraints: ConstraintTracker | None = None,
    ) -> None:
        """``config``'s model from ``state_dict`` (Hugging Face names; read, not kept), run
        as ``options`` says (``RunnerOptions``; default: every default), over a KV pool
        sized after the weights are on the device. ``sampler``: ``Sampler()`` by default.
        ``constraints``: the matchers of constrained requests (structured outputs); their
        masks are computed on a thread while the model runs."""
        o = options if options is not None else RunnerOptions()
        self.config = config
        self.device = select_device(o.device)
        self.dtype = resolve_dtype(o.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(o.kv_dtype, self.dtype, self.device)
        self.sliding_window = o.sliding_window or config.sliding_window
        self.attention_sinks = o.attention_sinks
        self.block_size = o.block_size
        self.max_model_len = max_len = min(
            o.max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        self.attention = make_attention_backend(o.attention_backend, self._attention_spec())
        self.model = LlamaModel(
            config, state_dict, self.dtype, self.device, self.attention, max_len,
            o.use_onednn, o.activation_bits,
        )  # fmt: skip
        sizes = graph_sizes(o.cuda_graphs, self.model, o.max_decode_rows or GRAPH_BATCH_SIZES[-1])
        self.num_blocks = o.num_blocks or self._num_blocks_for_budget(o.kv_budget_bytes, sizes)
        # With graphs, one more block than the cache manager lends: padding rows write there.
        self.pool = KVPool.from_config(
            config, self.num_blocks + int(bool(sizes)), o.block_size, self.kv_dtype,
            self.device, self.dtype,
        )  # fmt: skip
        self.paths = make_paths(
            self.model,
            self.pool,
            fused_step=o.fused_step,
            fused_max_rows=o.fused_max_rows,
            graph_sizes=sizes,
            max_model_len=max_len,
            scratch_slot=self.num_blocks * o.block_size,
        )
        self.limits = StepLimits(
            o.block_size, self.num_blocks, max_len, self.model.vocab_size, self.sliding_window,
            unbounded_positions=o.attention_sinks > 0,
        )  # fmt: skip
        self.fuse_batches = o.fuse_batches
        self.sampler = sampler if sampler is not None else Sampler()
        self.constraints = constraints
        self._mask_thread: ThreadPoolExecutor | None = None
        self._info = self._model_info(o.name)

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
            rope_inv_freq=rope_inv_freq(c).to(self.device) if self.attention_sinks else None,
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

    def block_io(self) -> PoolBlockIO:
        """The KV pool's blocks as bytes (tier 2)."""
        return PoolBlockIO(self.pool)

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        """Compute ``plan``: KV of every scheduled token into the pool, one sampled token
        for every seq with ``do_sample``. Never mutates ``plan``."""
        t0 = time.perf_counter()
        result = ModelOutput()
        if self.constraints is not None:
            self.constraints.drop(plan.finished_request_ids)
        self._copy_blocks(plan.block_copies)
        step = StepRows.of(plan, self.limits)
        result.failed.update(step.failed)
        if step.is_empty:
            return result
        sampled = step.sampled()
        masks = self._start_masks(sampled)
        if self.fuse_batches or not (step.prefill and step.decode):
            logits = self._forward_logits(step)
            self._sample(logits, sampled, result, masks)
            elapsed = time.perf_counter() - t0
            share = step.num_prefill_rows / step.num_rows
            result.prefill_time_s = elapsed * share
            result.decode_time_s = elapsed - result.prefill_time_s
        else:
            prefill, decode = step.split()
            logits_p = self._forward_logits(prefill)
            self._sync()
            t1 = time.perf_counter()
            logits_d = self._forward_logits(decode)
            self._sync()
            t2 = time.perf_counter()
            self._sample(torch.cat([logits_p, logits_d]), sampled, result, masks)
            t3 = time.perf_counter()
            num_p = len(prefill.sample_rows())
            share = num_p / (num_p + len(decode.sample_rows()) or 1)
            result.prefill_time_s = (t1 - t0) + (t3 - t2) * share
            result.decode_time_s = (t2 - t1) + (t3 - t2) * (1.0 - share)
        if result.failed:
            self._scrub_failed(step, result.failed)
        return result

    @torch.inference_mode()
    def step_logits(self, plan: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Run ``plan`` like ``execute`` but return fp32 logits of EVERY computed position,
        per request (``[num_tokens, V]``), instead of sampling. For tests and tools."""
        self._copy_blocks(plan.block_copies)
        step = StepRows.of(plan, self.limits)
        if step.failed:
            raise ValueError(f"invalid plan: {dict(step.failed)}")
        if step.is_empty:
            return {}
        logits = self.model.compute_logits(self.paths.forward(step))
        out: dict[str, torch.Tensor] = {}
        row = 0
        for s in step.seqs:
            out[s.request_id] = logits[row : row + s.num_tokens]
            row += s.num_tokens
        return out

    # ------------------------------------------------------------------ internals

    def _start_masks(self, seqs: Sequence[ScheduledSeq]) -> Future[Masks] | None:
        """Start computing the constrained rows' masks on the mask thread (llguidance
        releases the GIL), so they are ready when the logits are."""
        tracker = self.constraints
        if tracker is None or not any(s.sampling.constraint is not None for s in seqs):
            return None
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="kvserve-masks")
        return self._mask_thread.submit(tracker.compute_masks, seqs)

    def _copy_blocks(self, block_copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write, before anything reads: a copy outside the pool is a bug."""
        if not block_copies:
            return
        bad = [c for c in block_copies if not all(0 <= b < self.num_blocks for b in c)]
        if bad:
            raise ValueError(f"block copies {bad} outside the pool of {self.num_blocks}")
        self.pool.copy_blocks(block_copies)

    def _forward_logits(self, step: StepRows) -> torch.Tensor:
        """Logits [R, V] of the rows that sample, prefill rows first, in row order."""
        hidden = self.paths.forward(step)
        rows = step.sample_rows()
        if not rows:
            return torch.empty(0, self.model.vocab_size, device=self.device)
        if len(rows) != step.num_rows:
            index = torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
            hidden = hidden.index_select(0, index)
        return self.model.compute_logits(hidden)

    def _sample(
        self,
        logits: torch.Tensor,
        seqs: Sequence[ScheduledSeq],
        result: ModelOutput,
        masks: Future[Masks] | None = None,
    ) -> None:
        """Sample the rows of ``logits`` (one per seq, k + 1 per seq with drafts; see
        ``verify_rows``) and put one token per seq into ``result``, after the drafts it
        accepted (``num_accepted_drafts``). Constrained rows are masked first and their
        matchers advanced by the accepted tokens."""
        if not seqs:
            return
        rows: Sequence[ScheduledSeq] = seqs
        if any(s.num_draft_tokens for s in seqs):
            rows = [r for s in seqs for r in (verify_rows(s) if s.num_draft_tokens else (s,))]
        failed: dict[str, str] = {}
        if masks is not None:
            step_masks = masks.result()
            failed.update(step_masks.failed)
            result.constraint_mask_time_s = step_masks.compute_time_s
            if step_masks.bitmask is not None:
                apply_token_bitmask(logits, torch.from_numpy(step_masks.bitmask))
        sampled = self._sample_rows(logits, rows)
        token_ids, logprobs = sampled.token_ids, sampled.logprobs
        failed.update(sampled.failed)
        result.failed.update(failed)
        row = 0
        for seq in seqs:
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
                if masks is not None:
                    accepted = [*seq.token_ids[1 : 1 + num_accepted], result.sampled_token_ids[rid]]
                    self._advance_constraint(seq, accepted, result)
            row += num_rows

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

    def _sample_rows(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> SampleResult:
        """A token (and logprobs) per row; a row that fails fails its request."""
        try:
            return self.sampler.sample(logits, seqs)
        except Exception:
            # Isolate the culprit: re-sample row by row; only rows that raise fail.
            result = SampleResult(token_ids=[], logprobs=[])
            for i, seq in enumerate(seqs):
                try:
                    row = self.sampler.sample(logits[i : i + 1], [seq])
                except Exception as exc:
                    error = f"sampling failed: {type(exc).__name__}: {exc}"
                    row = SampleResult([0], [None], {seq.request_id: error})
                result.token_ids.extend(row.token_ids)
                result.logprobs.extend(row.logprobs)
                result.failed.update(row.failed)
            return result

    def _scrub_failed(self, step: StepRows, failed: Mapping[str, str]) -> None:
        """Zero non-finite KV left by requests that failed in this step's forward pass."""
        block_ids = [
            b
            for s in step.seqs
            if s.request_id in failed
            for b in s.block_ids[: -(-s.end_pos // self.block_size)]
        ]
        self.pool.scrub_blocks(block_ids)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
