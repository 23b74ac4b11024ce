"""SchedulerConfig: the one frozen, validated configuration of the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("stall-free", "prefill-first", "slo")
QUEUE_ORDERS = ("fcfs", "priority")
PREEMPTION_RULES = ("priority", "newest")
MEMORY_MODES = ("optimistic", "reserve")
SPECULATIVE_MODES = ("off", "ngram")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and strategies of the iteration-level scheduler.

    - ``max_num_seqs``: requests in the running set (prefilling or decoding) at once; the
      decode batch never exceeds it.
    - ``max_num_batched_tokens``: token budget of one step, prefill chunk tokens plus one per
      decode. Must be >= ``max_num_seqs`` so a full decode batch always fits.
    - ``max_model_len``: prompt + ``max_tokens`` must fit in it (checked at admission).
    - ``long_prefill_token_threshold``: the largest prefill chunk one request gets in one
      step (0 = the whole step budget); longer prompts are split across steps.
    - ``policy``: batch formation. ``stall-free`` runs every decode every step and gives the
      leftover budget to prefill chunks (Sarathi-Serve); ``prefill-first`` runs a prefill
      batch whenever one fits and decodes otherwise, but never skips the decodes for more
      than ``max_decode_starvation_steps`` steps in a row; ``slo`` runs every decode every
      step and sizes the prefill chunks to a latency target with an online step-cost model
      (``scheduler.slo``): a step stays under ``itl_slo_ms``, waiting requests are admitted
      earliest TTFT deadline (arrival + ``ttft_slo_ms``) first, and the token budget is only
      a ceiling.
    - ``itl_slo_ms`` / ``ttft_slo_ms``: the default latency targets of the ``slo`` policy
      (a request may carry its own); ``slo_preempt_margin``: ``slo`` preempts decodes only
      when decodes alone are predicted over ``itl_slo_ms * slo_preempt_margin``;
      ``slo_max_stretch``: how far past ``itl_slo_ms`` a step may run for prompts waiting
      for their first token, within the decodes' TPOT slack (``SloStep.stretch``; 1 = never).
    - ``queue_order``: ``fcfs`` (arrival order) or ``priority`` (lower value first, ties by
      arrival) where a request's effective priority improves by 1 per ``aging_steps``
      scheduler steps since it arrived (0 disables aging). Under ``priority`` a waiting
      request may preempt a running one of worse effective priority, whether memory or
      ``max_num_seqs`` is what binds.
    - ``preemption``: the victim rule. ``priority``: the worst effective priority, then the
      fewest computed tokens (least work lost), then the latest arrival. ``newest``: the worst
      effective priority, then the latest arrival.
    - ``max_waiting_requests`` / ``max_waiting_tokens``: admission bounds of the waiting
      queue (requests / prompt tokens still to compute); over them ``add_request`` raises
      ``OverloadError``.
    - ``max_waiting_requests_per_tenant`` / ``max_waiting_tokens_per_tenant``: the same
      bounds for the requests of one tenant (``Request.tenant``; "" is no tenant), so one
      tenant's flood is refused while the others' requests are still admitted.
    - ``memory_mode``: ``optimistic`` allocates blocks as tokens arrive and preempts (by
      recompute) when they run out; ``reserve`` admits a request only when blocks for its
      whole length (prompt + max_tokens) are free and never preempts.
    - ``max_loras``: distinct LoRA adapters among the running requests at once, so in one
      step (``scheduler.lora``): a request whose adapter would pass it waits, and requests
      of running adapters or of the base model go past it, until it has waited
      ``aging_steps`` steps; then only base requests may.
    - ``speculative``: ``ngram`` drafts up to ``num_speculative_tokens`` tokens per decode
      by prompt lookup (the request's last ``ngram_max`` down to ``ngram_min`` tokens,
      matched earlier in its own prompt and output; ``scheduler.spec``). The runner verifies
      them in the decode's forward pass; drafts count in the step's token budget.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 512
    policy: str = "stall-free"
    max_decode_starvation_steps: int = 4
    queue_order: str = "fcfs"
    aging_steps: int = 64
    preemption: str = "priority"
    max_waiting_requests: int = 4096
    max_waiting_tokens: int = 1_000_000
    max_waiting_requests_per_tenant: int = 1024
    max_waiting_tokens_per_tenant: int = 250_000
    memory_mode: str = "optimistic"
    itl_slo_ms: float = 150.0
    ttft_slo_ms: float = 2000.0
    slo_preempt_margin: float = 1.5
    slo_max_stretch: float = 8.0
    max_loras: int = 8
    speculative: str = "off"
    num_speculative_tokens: int = 3
    ngram_max: int = 4
    ngram_min: int = 2

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so that a full decode batch fits a step"
            )
        for name in (
            "long_prefill_token_threshold",
            "aging_steps",
            "max_waiting_requests",
            "max_waiting_tokens",
            "max_waiting_requests_per_tenant",
            "max_waiting_tokens_per_tenant",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("num_speculative_tokens", "ngram_max", "ngram_min", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})"
            )
        if self.max_decode_starvation_steps < 1:
            raise ValueError(
                f"max_decode_starvation_steps must be >= 1, got {self.max_decode_starvation_steps}"
            )
        for name in ("itl_slo_ms", "ttft_slo_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.slo_max_stretch >= 1.0:
            raise ValueError(f"slo_max_stretch must be >= 1, got {self.slo_max_stretch}")
        if not self.slo_preempt_margin >= 1.0:
            raise ValueError(f"slo_preempt_margin must be >= 1, got {self.slo_preempt_margin}")
        _check_choice("policy", self.policy, POLICIES)
        _check_choice("queue_order", self.queue_order, QUEUE_ORDERS)
        _check_choice("preemption", self.preemption, PREEMPTION_RULES)
        _check_choice("memory_mode", self.memory_mode, MEMORY_MODES)
        _check_choice("speculative", self.speculative, SPECULATIVE_MODES)

    @property
    def itl_slo_s(self) -> float:
        return self.itl_slo_ms / 1e3

    @property
    def ttft_slo_s(self) -> float:
        return self.ttft_slo_ms / 1e3

    @property
    def max_decode_rows(self) -> int:
        """The most token rows a step's decode batch holds: one per running request, and
        its drafts with speculation, within the step's token budget (the runner sizes its
        CUDA graphs to it)."""
        per_seq = 1 + self.num_speculative_tokens if self.speculative != "off" else 1
        return min(self.max_num_seqs * per_seq, self.max_num_batched_tokens)

    @property
    def max_chunk_tokens(self) -> int:
        """The largest prefill chunk one request may get in one step."""
        threshold = self.long_prefill_token_threshold
        if threshold == 0:
            return self.max_num_batched_tokens
        return min(threshold, self.max_num_batched_tokens)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
