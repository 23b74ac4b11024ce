"""The plain-data boundary objects of one engine step.

``schedule() -> SchedulerOutput`` (what to compute), ``runner.execute(plan) -> ModelOutput``
(what was sampled), ``update(plan, result) -> list[RequestOutput]`` (what clients see).
The runner reads a ``SchedulerOutput`` and never mutates it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from cache_manager.stats import KVCacheStats
from scheduler.request import FinishReason, LoraRef, SamplingParams

# A token the step before sampled and the host does not know yet (scheduling one step ahead):
# the runner reads it from that step's sampled ids on the device. Never a real token id.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step, in the prefill batch or in the decode batch.

    ``token_ids`` are the tokens whose keys/values are computed this step, at absolute
    positions ``start_pos .. start_pos + len(token_ids) - 1``; their KV goes into
    ``block_ids`` (the whole block table, position p lives in ``block_ids[p // block_size]``
    at offset ``p % block_size``). A decode entry has exactly one token.
    ``do_sample`` is True when this chunk ends at the last known token, so the runner samples
    the next token from the logits of the chunk's last position (a middle chunk of a long
    prompt samples nothing).

    Speculative decoding: a decode entry may carry ``num_draft_tokens`` drafts after its one
    known token; they are the last ``num_draft_tokens`` of ``token_ids`` and not yet in
    ``all_token_ids``::

        token_ids = [ last known token | draft 0 | draft 1 | ... | draft k-1 ]
        positions   start_pos            + 1       + 2             + k

    The runner computes all k + 1 positions in one pass, samples a token at each (position
    i as output token ``num_output_tokens + i``), accepts the drafts while they equal the
    sampled tokens, and reports how many (``ModelOutput.num_accepted_drafts``) and the
    sampled token after them (``sampled_token_ids``).

    Prompt logprobs (``SamplingParams.prompt_logprobs``): the first ``num_prompt_logprobs``
    rows of a prefill chunk are scored, row ``start_pos + i`` giving the logprob of the
    prompt token after it (at ``start_pos + i + 1``, read from ``all_token_ids``)::

        prompt   | t0 | t1 | t2 | t3 | t4 |      chunk: start_pos 2, 3 tokens (t2 t3 t4)
        scored               t3   t4   --       num_prompt_logprobs 2: t4 is the last

    Scheduling one step ahead: a decode planned while the step that samples its input token
    still runs carries ``PLACEHOLDER_TOKEN_ID`` as its one token (``has_placeholder``). That
    token is output token ``num_output_tokens - 1`` and is not in ``all_token_ids`` yet; the
    runner takes it from the previous step's sampled ids, on the device.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_ids: list[int]
    sampling: SamplingParams
    do_sample: bool
    # Read-only view of prompt + output tokens so far (for penalties); never mutate.
    all_token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # output tokens before this step (seeded sampling keys on it)
    # EOS ids of the request (from Request.eos_token_ids): the sampler masks them, and the
    # stop_token_ids, while num_output_tokens < sampling.min_tokens (unless ignore_eos).
    eos_token_ids: tuple[int, ...] = ()
    num_draft_tokens: int = 0  # speculative drafts at the end of token_ids (decode only)
    lora: LoraRef | None = None  # the request's adapter (None: the base model)
    num_prompt_logprobs: int = 0  # rows scored for prompt logprobs, from the first (above)
    # The sliding layers' own table when they hold one (Gemma 3, ``cache_manager.hybrid``):
    # ids past the global layers' pool; released positions hold the null block. The
    # global layers (and every layer otherwise) read ``block_ids``.
    window_block_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def has_placeholder(self) -> bool:
        """Its input token is the one the previous step samples (see the class docstring):
        ``PLACEHOLDER_TOKEN_ID``, or inside a runner the negative id that stands for it."""
        return self.token_ids[-1] < 0

    @property
    def end_pos(self) -> int:
        """One past the last position computed this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: a prefill batch and a decode batch, either may be empty."""

    step_id: int
    prefill: list[ScheduledSeq] = field(default_factory=list)
    decode: list[ScheduledSeq] = field(default_factory=list)
    # Copy-on-write: copy the KV of block src into block dst before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests that ended since the previous plan; the runner drops any per-request state.
    finished_request_ids: list[str] = field(default_factory=list)
    # The block that released table positions point at (sliding window, attention sinks,
    # adaptive KV strategy); never read: attention skips it. None when none is reserved.
    null_block_id: int | None = None

    @classmethod
    def make_empty(cls, step_id: int = 0) -> SchedulerOutput:
        return cls(step_id=step_id)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.prefill)

    @property
    def num_draft_tokens(self) -> int:
        """Speculative drafts in the decode batch (each decode has 1 token plus its drafts)."""
        return sum(s.num_draft_tokens for s in self.decode)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + len(self.decode) + self.num_draft_tokens

    @property
    def can_run_ahead(self) -> bool:
        """Whether the next step may be planned before this one's tokens are known: not when
        a seq verifies drafts (how many are accepted decides the next positions) or a
        constrained seq samples (its next mask needs the token)."""
        for seq in self.decode:
            if seq.num_draft_tokens or seq.sampling.constraint is not None:
                return False
        return not any(s.do_sample and s.sampling.constraint is not None for s in self.prefill)

    def block_ids_of(self, request_ids: Collection[str]) -> set[int]:
        """Every block in the tables of this step's seqs of ``request_ids``."""
        seqs = [s for s in (*self.prefill, *self.decode) if s.request_id in request_ids]
        ids = {b for s in seqs for b in s.block_ids}
        return ids.union(*(s.window_block_ids for s in seqs if s.window_block_ids))


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives (token_id, logprob); for a
    prompt token, its ``rank`` in its position's distribution (1: the most likely)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


@dataclass(slots=True)
class ModelOutput:
    """What the runner computed for one plan.

    ``sampled_token_ids`` has an entry for every scheduled seq with ``do_sample``, except
    those in ``failed`` (request_id -> error message), which finish with ``ERROR`` while the
    rest of the batch continues. For a seq with drafts, ``num_accepted_drafts`` says how
    many of its drafts were accepted (absent: none), and its sampled token follows them.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # Prefill seqs with ``num_prompt_logprobs``: one entry per scored row, in order.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    # Structured outputs: time this step spent computing token masks (overlapped with the
    # forward pass on the torch runner), 0 when no row was constrained.
    constraint_mask_time_s: float = 0.0

    @classmethod
    def make_empty(cls) -> ModelOutput:
        return cls()


@dataclass(slots=True)
class RequestOutput:
    """What ``update`` reports for one request after a step: new tokens, and the end."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    parent_id: str | None = None  # for forked samples (n > 1): the request the client sent
    index: int = 0  # which of the n samples
    # n > 1: samples 1..n-1 in index order, on the parent's first output after the fork
    # (and on its final output when that comes first); see scheduler.fork.
    forked_ids: tuple[str, ...] = ()
    # On the first output of a request with ``prompt_logprobs``: prompt tokens 1 .. P - 1,
    # each given the tokens before it (the first token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """Snapshot after a step; metrics and the gRPC edge read it, never the live scheduler."""

    step_id: int
    num_running: int  # requests holding a place in the running set (prefilling or decoding)
    num_waiting: int  # waiting, including preempted ones
    num_preempted: int  # waiting requests that were preempted at least once and not resumed
    # This step's batch composition.
    num_prefill_tokens: int
    num_prefill_reqs: int
    num_decode_reqs: int
    # Cumulative counters.
    num_steps_prefill_total: int  # steps whose plan had a prefill batch
    num_steps_decode_total: int  # steps whose plan had a decode batch
    num_preemptions_total: int
    num_recomputed_tokens_total: int  # computed tokens discarded by preemption
    num_prompt_tokens_total: int  # prompt tokens of admitted requests
    num_generation_tokens_total: int  # output tokens produced
    num_finished_total: dict[str, int]  # FinishReason.value -> count
    num_waiting_tokens: int  # prompt tokens still to compute across the waiting queue
    kv: KVCacheStats
    num_parked: int = 0  # requests not scheduled because their client stopped reading
    num_spec_draft_tokens_total: int = 0  # speculative drafts verified
    num_spec_accepted_tokens_total: int = 0  # of them, accepted (became output tokens)
    # Requests running / waiting by LoRA adapter ("": the base model; only those with some).
    lora_running: dict[str, int] | None = None
    lora_waiting: dict[str, int] | None = None

    @classmethod
    def make_empty(cls, kv: KVCacheStats | None = None) -> SchedulerStats:
        return cls(
            step_id=0,
            num_running=0,
            num_waiting=0,
            num_preempted=0,
            num_prefill_tokens=0,
            num_prefill_reqs=0,
            num_decode_reqs=0,
            num_steps_prefill_total=0,
            num_steps_decode_total=0,
            num_preemptions_total=0,
            num_recomputed_tokens_total=0,
            num_prompt_tokens_total=0,
            num_generation_tokens_total=0,
            num_finished_total={},
            num_waiting_tokens=0,
            kv=kv if kv is not None else KVCacheStats.make_empty(),
        )
