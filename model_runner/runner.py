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
from model_runner.config import ModelConfig
from model_runner.cuda_graphs import GRAPH_BATCH_SIZES, graph_memory_bytes
from model_runner.device import dtype_name, resolve_dtype, resolve_kv_dtype, select_device
from model_runner.kv_pool import KVPool, default_kv_budget_bytes, num_blocks_for_memory
from model_runner.kv_transfer import PoolBlockIO
from model_runner.lora.files import AdapterFile
from model_runner.lora.layout import LoraWeights, lay_out
from model_runner.lora.registry import LoraRegistry
from model_runner.lora.step import LoraStep, resolve_adapters
from model_runner.model import LlamaModel, rope_inv_freq
from model_runner.paths import graph_sizes, make_paths
from model_runner.quant import QuantWeight
from model_runner.sampler import Sampler, SampleResult, apply_token_bitmask
from model_runner.step import StepLimits, StepRows, num_accepted_drafts, verify_rows
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
        state_dict: Mapping[str, torch.Tensor | QuantWeight],
        num_blocks: int | None = None,
        block_size: int = 16,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        *,
        kv_budget_bytes: int | None = None,
        kv_dtype: torch.dtype | str | None = None,
        max_model_len: int | None = None,
        sampler: SamplerLike | None = None,
        fuse_batches: bool = True,
        use_onednn: bool | None = None,
        name: str | None = None,
        fused_step: bool | None = None,
        fused_max_rows: int = 1 << 30,
        sliding_window: int | None = None,
        attention_sinks: int = 0,
        attention_backend: str = "auto",
        cuda_graphs: bool | None = None,
        max_decode_rows: int = GRAPH_BATCH_SIZES[-1],
        constraints: ConstraintTracker | None = None,
        activation_bits: int = 16,
        max_lora_rank: int = 64,
        max_cpu_loras: int = 8,
    ) -> None:
        """``num_blocks=None`` sizes the pool from ``kv_budget_bytes`` (default: see
        ``kv_pool.default_kv_budget_bytes``), measured after the weights are on the device.
        ``max_model_len`` (default and cap: the config's ``max_position_embeddings``) bounds
        positions and sizes the RoPE table. ``state_dict`` uses Hugging Face names; it is read,
        not kept. ``use_onednn=None`` uses oneDNN-packed linear layers on CPU when they pass a
        self-check; ``fuse_batches`` runs prefill and decode in one forward pass.
        ``kv_dtype`` is the KV cache's storage precision (``device.resolve_kv_dtype``;
        default ``"auto"``: float16 on CPU for a float32 model, else the model's dtype); it
        sizes the pool, and attention still computes in ``dtype``. ``sliding_window``
        (tokens) overrides the config's window; ``attention_sinks`` (tokens, needs a window)
        keeps the first tokens visible and lets positions run past ``max_model_len``
        (see ``attention_backends.torch_backend``). ``attention_backend``: see
        ``model_runner.attention_backends`` (``auto``: torch on CPU). The paths a step may
        take (``model_runner.paths``): ``fused_step`` runs steps of up to ``fused_max_rows``
        rows in one CPU kernel call (None = when supported); ``cuda_graphs`` replays decode
        steps from CUDA graphs captured up to ``max_decode_rows`` rows (``max_num_seqs``,
        times 1 + k with speculation; None = on CUDA with a backend that has graphs).
        ``constraints``: the matchers of constrained requests (structured outputs); their
        masks are computed on a thread while the model runs. ``activation_bits``: the
        quantized kernels' activation precision (16, the default, keeps the answers of the
        dequantized model; 8 is ggml's; see ``quant.ACTIVATION_BITS``). ``max_lora_rank``
        and ``max_cpu_loras``: the adapters ``self.lora`` accepts, and how many it keeps
        laid out while unused (``lora.registry``)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.sliding_window = sliding_window or config.sliding_window
        self.attention_sinks = attention_sinks
        if attention_sinks < 0 or (attention_sinks and self.sliding_window is None):
            raise ValueError(
                f"attention_sinks={attention_sinks} needs a sliding window and must be >= 0"
            )
        self.device = select_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(kv_dtype, self.dtype, self.device)
        max_len = min(
            max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        self.config = config
        spec = AttentionSpec(
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            device=self.device,
            sliding_window=self.sliding_window,
            attention_sinks=attention_sinks,
            rope_inv_freq=rope_inv_freq(config).to(self.device) if attention_sinks else None,
        )
        self.attention = make_attention_backend(attention_backend, spec)
        self.model = LlamaModel(
            config,
            state_dict,
            self.dtype,
            self.device,
            self.attention,
            max_len,
            use_onednn,
            activation_bits=activation_bits,
        )
        sizes = graph_sizes(cuda_graphs, self.model, max_decode_rows)
        if num_blocks is None:
            # The graphs' memory comes out of the budget BEFORE the pool is sized.
            reserve = 1 << 30
            if sizes:
                reserve += graph_memory_bytes(config, sizes[-1], self.dtype.itemsize)
            budget = kv_budget_bytes or default_kv_budget_bytes(
                self.device, activation_reserve_bytes=reserve
            )
            num_blocks = num_blocks_for_memory(config, block_size, self.kv_dtype, budget)
        # With graphs, one more block than the cache manager lends: padding rows write there.
        num_pool_blocks = num_blocks + int(bool(sizes))
        self.pool = KVPool.from_config(
            config, num_pool_blocks, block_size, self.kv_dtype, self.device, self.dtype
        )
        self.paths = make_paths(
            self.model,
            self.pool,
            fused_step=fused_step,
            fused_max_rows=fused_max_rows,
            graph_sizes=sizes,
            max_model_len=max_len,
            scratch_slot=num_blocks * block_size,
        )
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_len
        self.limits = StepLimits(
            block_size,
            num_blocks,
            max_len,
            self.model.vocab_size,
            self.sliding_window,
            unbounded_positions=attention_sinks > 0,
        )
        self.fuse_batches = fuse_batches
        self.sampler = sampler if sampler is not None else Sampler()
        self.constraints = constraints
        self._mask_thread: ThreadPoolExecutor | None = None
        self._info = ModelInfo(
            name=name or config.name or config.architecture,
            vocab_size=config.vocab_size,
            max_model_len=max_len,
            shape=config.kv_shape(dtype_name(self.kv_dtype)),
            eos_token_ids=config.eos_token_ids,
            bos_token_id=config.bos_token_id,
            dtype=dtype_name(self.dtype),
            device=str(self.device),
            sliding_window=self.sliding_window,
            kv_dtype=dtype_name(self.kv_dtype),
            weights=self.model.weights_format,
            weight_bytes=self.model.weight_bytes,
            linear_backend=self._linear_backend(),
            extra={
                "architecture": config.architecture,
                "num_blocks": str(num_blocks),
                "block_size": str(block_size),
                "kv_pool_bytes": str(self.pool.num_bytes),
                "fused_step": str(self.paths.fused is not None).lower(),
                "fuse_batches": str(fuse_batches).lower(),
                "attention_backend": self.attention.name,
                "cuda_graphs": str(self.paths.graphs is not None).lower(),
            },
        )

        # LoRA adapters: fp16 for the fused kernels (half the bytes a step reads; their
        # error is far below the 4-bit weights'), the model's dtype elsewhere.
        self.lora_dtype = torch.float16 if self.paths.fused is not None else self.dtype
        self.lora = LoraRegistry(
            config,
            self._lay_out_adapter,
            max_rank=max_lora_rank,
            max_loaded=max_cpu_loras,
            base_name=self._info.name,
        )

    @property
    def info(self) -> ModelInfo:
        return self._info

    def _lay_out_adapter(self, adapter: AdapterFile) -> LoraWeights:
        return lay_out(adapter, self.config, self.lora_dtype, self.device)

    def block_io(self) -> PoolBlockIO:
        """The KV pool's blocks as bytes (tier 2)."""
        return PoolBlockIO(self.pool)

    def _linear_backend(self) -> str:
        if self.model.weights_format != "float":
            from model_runner import kernels

            return f"kvserve-{kernels.isa()}-a{self.model.activation_bits}"
        return "onednn" if self.model.use_onednn else "torch"

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
        step, adapters = self._adapters(step, result.failed)
        if step.is_empty:
            return result
        sampled = step.sampled()
        masks = self._start_masks(sampled)
        if self.fuse_batches or not (step.prefill and step.decode):
            logits = self._forward_logits(step, adapters)
            self._sample(logits, sampled, result, masks)
            elapsed = time.perf_counter() - t0
            share = step.num_prefill_rows / step.num_rows
            result.prefill_time_s = elapsed * share
            result.decode_time_s = elapsed - result.prefill_time_s
        else:
            prefill, decode = step.split()
            logits_p = self._forward_logits(prefill, adapters)
            self._sync()
            t1 = time.perf_counter()
            logits_d = self._forward_logits(decode, adapters)
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

    def _forward_logits(self, step: StepRows, adapters: dict[str, LoraWeights]) -> torch.Tensor:
        """Logits [R, V] of the rows that sample, prefill rows first, in row order."""
        lora = LoraStep.of(step, adapters) if adapters else None
        hidden = self.paths.forward(step, lora)
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
