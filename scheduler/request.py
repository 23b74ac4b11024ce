"""Request, its sampling/stopping parameters and its lifecycle status. Plain data only."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Literal, get_args

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = get_args(ConstraintKind)


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match (structured outputs), as plain text.

    ``spec`` by kind: ``json_schema`` the schema as JSON text, ``json_object`` empty (any
    JSON object), ``regex`` the pattern, ``choice`` a JSON list of strings, ``grammar`` a
    Lark or GBNF grammar. The scheduler only carries it; the grammar library compiles it at
    the edge (``model_runner.constraints``), and equal constraints share one compilation.
    """

    kind: ConstraintKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(
                f"constraint kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}"
            )


@dataclass(frozen=True, slots=True)
class LoraRef:
    """The LoRA adapter a request runs with (``model_runner.lora``), as plain data.

    ``name`` is what clients call it (the OpenAI ``model``); ``key`` names its weights (the
    name and a digest of its files), so KV made with one adapter is never served to another,
    or to an adapter reloaded under the same name with other weights; ``scale`` multiplies
    its update (llama.cpp's per-request scale; 1 = as trained). The scheduler counts
    adapters by ``name`` (``max_loras``); the runner finds the weights by ``name`` and checks
    ``key``.
    """

    name: str
    key: str
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an adapter needs a name")
        if not math.isfinite(self.scale):
            raise ValueError(f"adapter scale must be finite, got {self.scale}")


class SamplingParamsError(ValueError):
    """A ``SamplingParams`` value outside its range; the ranges live only here.

    The message starts with ``field`` (``"temperature must be >= 0 (0 = greedy), got -1"``),
    so an API edge can name the field its own way: ``field`` + ``detail``.
    """

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(field + detail)
        self.field = field
        self.detail = detail


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated once, at construction
    (``SamplingParamsError``, a ``ValueError``, naming the field, its range and the value).

    ``temperature == 0`` means greedy. ``top_k is None`` disables top-k; ``logprobs is None``
    returns no logprobs (0 returns only the sampled token's logprob). ``prompt_logprobs``
    asks the same of the prompt: each prompt token's logprob given the tokens before it (all
    but the first), with the top n at its position; it is computed in prefill, so such a
    request does not use the prefix cache (a cached prefix has no logits).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    constraint: Constraint | None = None  # structured outputs: the output must match it

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise SamplingParamsError(
                "temperature", f" must be >= 0 (0 = greedy), got {self.temperature:g}"
            )
        if self.top_k is not None and self.top_k < 1:
            raise SamplingParamsError(
                "top_k", f" must be >= 1 (or unset to disable), got {self.top_k}"
            )
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingParamsError("top_p", f" must be in (0, 1], got {self.top_p:g}")
        if not (0.0 <= self.min_p <= 1.0):
            raise SamplingParamsError("min_p", f" must be in [0, 1], got {self.min_p:g}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise SamplingParamsError(
                "repetition_penalty", f" must be > 0, got {self.repetition_penalty:g}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise SamplingParamsError(name, f" must be in [-2, 2], got {value:g}")
        if self.logprobs is not None and not (0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise SamplingParamsError(
                "logprobs", f" must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}"
            )
        if self.prompt_logprobs is not None and not (
            0 <= self.prompt_logprobs <= self.MAX_LOGPROBS
        ):
            raise SamplingParamsError(
                "prompt_logprobs",
                f" must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}",
            )
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f" must be >= 1, got {self.max_tokens}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            limits = f"[0, max_tokens={self.max_tokens}]"
            raise SamplingParamsError("min_tokens", f" must be in {limits}, got {self.min_tokens}")
        for i, token in enumerate(self.stop_token_ids):
            if token < 0:
                raise SamplingParamsError("stop_token_ids", f"[{i}] must be >= 0, got {token}")
        for i, stop in enumerate(self.stop):
            if not stop:
                raise SamplingParamsError("stop", f"[{i}] is empty: stop strings need text")
        if self.n < 1:
            raise SamplingParamsError("n", f" must be >= 1, got {self.n}")
        if self.n > 1 and self.prompt_logprobs is not None:
            # The samples share the prompt's prefill: its scores are one request's.
            raise SamplingParamsError(
                "prompt_logprobs", f" cannot be combined with n > 1 (got n={self.n})"
            )
        if self.constraint is not None and (self.ignore_eos or self.min_tokens):
            # The constraint decides where the output ends (it allows only EOS there).
            which = "ignore_eos" if self.ignore_eos else "min_tokens"
            raise SamplingParamsError(
                which, " cannot be combined with a constraint: the constraint ends the output"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why a request in this status ended (None while it runs or waits)."""
        return _FINISH_REASONS.get(self)


class FinishReason(enum.Enum):
    """Why a request ended, as a client sees it."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the client, a deadline, or an Abort call
    ERROR = "error"  # this request failed; everyone else continues


# A finished status and the reason a client sees: one fact, kept in ``Request.status``.
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class AbortReason(enum.Enum):
    """Why an abort happened; metrics count aborts by this label."""

    CLIENT_CANCEL = "client_cancel"
    DEADLINE = "deadline"
    ABORT_CALL = "abort_call"
    SHUTDOWN = "shutdown"
    STALLED = "stalled"  # the client stopped reading its stream (backpressure timeout)


@dataclass(slots=True, eq=False)
class Request:
    """One generation request as the scheduler tracks it.

    ``num_computed_tokens`` is the single measure of progress: tokens of
    ``all_token_ids`` whose KV is in the cache. Chunked prefill, prefix hits and resumption
    after preemption are all "computed < total"::

        | prompt ..................... | output ....... |
        | computed (incl. cached) | to compute         |
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower value runs first
    arrival_time_s: float = 0.0
    cache_salt: str | None = None
    lora: LoraRef | None = None  # the adapter it runs with; None: the base model
    tenant: str = ""  # who sent it (an API key's owner, a peer): per-tenant queue bounds
    # The request's own latency targets (the ``slo`` policy; None: the server's defaults).
    ttft_slo_s: float | None = None
    itl_slo_s: float | None = None
    # The slo policy's clock when its first decode was planned: its first token was out.
    first_token_s: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    parent_id: str | None = None  # set on forked children (n > 1)
    _all_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if not self._all_token_ids:
            self._all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only for callers; ``append_output_token`` grows it."""
        return self._all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        """Derived from ``status``: never stored twice."""
        return self.status.finish_reason

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)


def stop_status(request: Request, token: int, max_num_tokens: int) -> RequestStatus | None:
    """The finished status ``token`` (just appended) gives ``request``, or None; a stop
    token is kept as its ``stop_reason``. ``max_num_tokens``: prompt + max_tokens.

    A stop (EOS unless ignore_eos, or a stop token id) only counts once min_tokens are
    out; it wins over the length limit when both hold.
    """
    sampling = request.sampling
    if len(request.output_token_ids) >= sampling.min_tokens:
        if token in sampling.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if not sampling.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    return RequestStatus.FINISHED_LENGTH if request.num_tokens >= max_num_tokens else None
