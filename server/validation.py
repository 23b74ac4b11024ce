"""Turns API messages into engine requests, or says exactly what is wrong with them.

Every check here is pure and cheap (no tokenizer, no model): it runs on the event loop. The
tokenizer part (text / chat -> ids) runs in a thread executor in ``server.frontend``.
Messages name the field, the value received and the allowed range, because they travel to
the client verbatim as gRPC ``INVALID_ARGUMENT`` details.

Value ranges of sampling and stopping parameters live in ``SamplingParams`` alone; this
module adds what only the server knows (the model's context and vocabulary, ``max_n``, size
limits on stop strings) and renames ``SamplingParams``' fields to the request's field paths.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from scheduler.request import Constraint, SamplingParams, SamplingParamsError
from server.rpc import generation_pb2 as pb

CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_BYTES = 256
# The largest request (--max-request-bytes): gRPC's own default bound on a received message,
# and the HTTP front's bound on a body.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_CONSTRAINT_BYTES = 256 * 1024  # a schema or grammar; compiling is the costly part


class InvalidRequestError(ValueError):
    """The request can never be served as sent (gRPC INVALID_ARGUMENT)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What the model and the server allow."""

    vocab_size: int
    max_model_len: int
    max_n: int = 1  # 1 when the scheduler cannot fork samples
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    # Attention sinks (--attention-sinks): the cache holds the sinks and the window, so
    # prompt + max_tokens may exceed the context (the prompt itself must still fit).
    streams_past_context: bool = False


def input_kind(request: pb.GenerateRequest | pb.TokenizeRequest) -> str:
    """``text``, ``token_ids`` or ``chat``; raises when the oneof is unset."""
    kind = request.WhichOneof("input")
    if kind is None:
        allowed = (
            "text, token_ids or chat"
            if isinstance(request, pb.GenerateRequest)
            else ("text or chat")
        )
        raise InvalidRequestError(f"input is required: set one of {allowed}")
    return kind


def chat_messages(chat: pb.ChatMessages, renders_tool_calls: bool = False) -> list[dict[str, Any]]:
    """Chat messages as template input; rejects an empty list and unknown roles.

    An assistant turn's ``tool_calls`` are given to a template that ``renders_tool_calls``
    as a list (each ``function.arguments`` an object where its text is one, as vLLM passes
    them); any other template gets the calls' functions as JSON after the content, so the
    model still sees them. A tool message's ``tool_call_id`` is passed as it is."""
    if not chat.messages:
        raise InvalidRequestError("chat.messages must hold at least one message")
    messages: list[dict[str, Any]] = []
    for i, msg in enumerate(chat.messages):
        if msg.role not in CHAT_ROLES:
            raise InvalidRequestError(
                f"chat.messages[{i}].role must be one of {', '.join(CHAT_ROLES)}; got {msg.role!r}"
            )
        message: dict[str, Any] = {"role": msg.role, "content": msg.content}
        if msg.tool_calls:
            calls = _tool_calls(msg.tool_calls, i, parse_arguments=renders_tool_calls)
            if renders_tool_calls:
                message["tool_calls"] = calls
            else:
                functions = [c.get("function") for c in calls]
                message["content"] = (msg.content + "\n" + json.dumps(functions)).strip()
        if msg.tool_call_id:
            message["tool_call_id"] = msg.tool_call_id
        messages.append(message)
    return messages


def _tool_calls(text: str, i: int, parse_arguments: bool) -> list[dict[str, Any]]:
    try:
        calls = json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(
            f"chat.messages[{i}].tool_calls must be a JSON list: {exc}"
        ) from exc
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise InvalidRequestError(f"chat.messages[{i}].tool_calls must be a JSON list of objects")
    for call in calls if parse_arguments else ():
        function = call.get("function")
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                continue  # not JSON: the template gets the text
            if isinstance(parsed, dict):
                function["arguments"] = parsed
    return calls


def add_generation_prompt(chat: pb.ChatMessages) -> bool:
    return chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True


# Names the chat template renderer sets itself (model_runner.chat_template.render).
_RESERVED_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "tools", "documents")


def chat_template_kwargs(chat: pb.ChatMessages) -> dict[str, Any]:
    """``chat.chat_template_kwargs`` (a JSON object, vLLM's field) as template variables."""
    if not chat.chat_template_kwargs:
        return {}
    try:
        value = json.loads(chat.chat_template_kwargs)
    except ValueError as exc:
        raise InvalidRequestError(f"chat_template_kwargs must be a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequestError(
            f"chat_template_kwargs must be a JSON object, got {type(value).__name__}"
        )
    taken = [k for k in _RESERVED_TEMPLATE_NAMES if k in value]
    if taken:
        raise InvalidRequestError(
            f"chat_template_kwargs must not set {', '.join(taken)}: the server sets "
            f"{', '.join(_RESERVED_TEMPLATE_NAMES)} itself (send tools in their own field)"
        )
    return value


def check_token_ids(ids: Sequence[int], vocab_size: int, field: str = "token_ids") -> list[int]:
    """The ids as a list; every id must be in ``[0, vocab_size)``."""
    for i, token in enumerate(ids):
        if token >= vocab_size:
            raise InvalidRequestError(
                f"{field}[{i}] = {token} is outside the vocabulary: ids must be in "
                f"[0, {vocab_size - 1}]"
            )
    return list(ids)


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
        )


def cache_salt_digest(cache_salt: str) -> str | None:
    """What the cache keeps of a ``cache_salt``: a 128-bit BLAKE2b digest (None: no salt).

    The salt is capped, so a client cannot make the engine hash megabytes per block, and only
    its fixed-size digest travels on: cached blocks never hold a client's string."""
    if not cache_salt:
        return None
    size = len(cache_salt.encode("utf-8"))
    if size > MAX_CACHE_SALT_BYTES:
        raise InvalidRequestError(
            f"cache_salt has {size} bytes; at most {MAX_CACHE_SALT_BYTES} are allowed (a tenant "
            "or session id, e.g. a UUID, is enough: the server keeps only its digest)"
        )
    return hashlib.blake2b(cache_salt.encode("utf-8"), digest_size=16).hexdigest()


def check_prompt_length(num_prompt_tokens: int, limits: Limits) -> None:
    if num_prompt_tokens == 0:
        raise InvalidRequestError("the prompt is empty: it must hold at least one token")
    if num_prompt_tokens >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt has {num_prompt_tokens} tokens but the model's context is "
            f"{limits.max_model_len} tokens: the prompt must be at most "
            f"{limits.max_model_len - 1} tokens to leave room for one output token"
        )


def check_stopping_fields(stopping: pb.StoppingOptions, limits: Limits) -> None:
    """The stopping checks that do not depend on the prompt length."""
    if stopping.HasField("max_tokens") and stopping.max_tokens < 1:
        raise InvalidRequestError(
            f"stopping.max_tokens must be >= 1 (at most {limits.max_model_len - 1}, the context "
            f"minus the prompt), got {stopping.max_tokens}"
        )
    if (
        stopping.HasField("max_tokens")
        and stopping.max_tokens >= limits.max_model_len
        and not limits.streams_past_context
    ):
        raise InvalidRequestError(
            f"stopping.max_tokens = {stopping.max_tokens} is beyond the model's context of "
            f"{limits.max_model_len} tokens (prompt + max_tokens must be <= "
            f"{limits.max_model_len})"
        )
    if len(stopping.stop) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            f"stopping.stop holds {len(stopping.stop)} strings; at most {MAX_STOP_STRINGS} "
            "are allowed"
        )
    for i, stop in enumerate(stopping.stop):
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stopping.stop[{i}] has {len(stop)} characters; at most "
                f"{MAX_STOP_STRING_CHARS} are allowed"
            )
    check_token_ids(stopping.stop_token_ids, limits.vocab_size, "stopping.stop_token_ids")


MAX_SLO_MS = 86_400_000.0  # a day: beyond it a target means nothing


def latency_targets(slo: pb.LatencyTargets) -> tuple[float | None, float | None]:
    """(ttft, itl) targets in seconds from ``slo`` (None: the server's default)."""
    targets: list[float | None] = []
    for name in ("ttft_ms", "itl_ms"):
        if not slo.HasField(name):
            targets.append(None)
            continue
        value = getattr(slo, name)
        if not 0.0 < value <= MAX_SLO_MS:  # NaN fails too
            raise InvalidRequestError(
                f"slo.{name} must be a number of milliseconds in (0, {MAX_SLO_MS:.0f}], got {value}"
            )
        targets.append(value / 1e3)
    return targets[0], targets[1]


def check_request_fields(request: pb.GenerateRequest, limits: Limits) -> None:
    """Everything checkable before tokenizing: runs on the event loop."""
    input_kind(request)
    check_request_id(request.request_id)
    check_stopping_fields(request.stopping, limits)
    latency_targets(request.slo)
    if request.HasField("n") and request.n > limits.max_n:
        if limits.max_n == 1:
            raise InvalidRequestError("n > 1 is not supported by this server")
        raise InvalidRequestError(f"n must be in [1, {limits.max_n}], got {request.n}")
    if request.WhichOneof("input") == "token_ids":
        check_token_ids(request.token_ids.ids, limits.vocab_size, "token_ids.ids")
    elif request.WhichOneof("input") == "chat":
        chat_messages(request.chat)


def constraint_of(request: pb.GenerateRequest) -> Constraint | None:
    """The request's ``constraint`` oneof as a ``Constraint`` (None when unset); checks its
    shape only (the grammar library compiles it: ``Frontend.engine_request``)."""
    kind = request.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not request.json_object:
            raise InvalidRequestError("json_object must be true when set (unset it for none)")
        return Constraint("json_object")
    if kind == "choice":
        choices = list(request.choice.choices)
        if not choices or not all(choices):
            raise InvalidRequestError("choice.choices must hold at least one non-empty string")
        spec = json.dumps(choices)
    else:
        spec = getattr(request, kind)
        if not spec:
            raise InvalidRequestError(f"{kind} must not be empty")
    size = len(spec.encode("utf-8"))
    if size > MAX_CONSTRAINT_BYTES:
        raise InvalidRequestError(
            f"{kind} has {size} bytes; at most {MAX_CONSTRAINT_BYTES} are allowed"
        )
    return Constraint(kind, spec)


def with_constraint(sampling: SamplingParams, constraint: Constraint | None) -> SamplingParams:
    """``sampling`` with ``constraint``; names the stopping field that conflicts with it."""
    if constraint is None:
        return sampling
    try:
        return replace(sampling, constraint=constraint)
    except SamplingParamsError as exc:
        raise InvalidRequestError(_REQUEST_FIELDS.get(exc.field, exc.field) + exc.detail) from exc


def sampling_params(
    request: pb.GenerateRequest, num_prompt_tokens: int, limits: Limits
) -> SamplingParams:
    """SamplingParams for a prompt of ``num_prompt_tokens`` tokens (already length-checked).

    An unset ``max_tokens`` is ``default_max_tokens`` capped by the room left in the context;
    an explicit one beyond that room is an error (the client asked for something impossible).
    """
    check_prompt_length(num_prompt_tokens, limits)
    room = limits.max_model_len - num_prompt_tokens
    stopping = request.stopping
    if stopping.HasField("max_tokens"):
        max_tokens = stopping.max_tokens
        if max_tokens > room and not limits.streams_past_context:
            raise InvalidRequestError(
                f"stopping.max_tokens = {max_tokens} is beyond the context: the prompt has "
                f"{num_prompt_tokens} tokens and the model's context is {limits.max_model_len}, "
                f"so max_tokens must be in [1, {room}] (only a server started with "
                "--attention-sinks and --sliding-window generates past the context)"
            )
    else:
        max_tokens = min(limits.default_max_tokens, room)
    min_tokens = stopping.min_tokens if stopping.HasField("min_tokens") else 0
    s = request.sampling
    try:
        return SamplingParams(
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else None,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            min_p=s.min_p if s.HasField("min_p") else 0.0,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
            frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
            seed=s.seed if s.HasField("seed") else None,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_token_ids=tuple(stopping.stop_token_ids),
            stop=tuple(stopping.stop),
            ignore_eos=stopping.ignore_eos,
            n=request.n if request.HasField("n") else 1,
        )
    except SamplingParamsError as exc:
        raise InvalidRequestError(_REQUEST_FIELDS.get(exc.field, exc.field) + exc.detail) from exc


# Where each SamplingParams field travels in a GenerateRequest.
_REQUEST_FIELDS = {
    **{f: f"sampling.{f}" for f in ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs")},
    "prompt_logprobs": "sampling.prompt_logprobs",
    **{f: f"sampling.{f}" for f in ("repetition_penalty", "presence_penalty", "frequency_penalty")},
    **{f: f"stopping.{f}" for f in ("max_tokens", "min_tokens", "stop_token_ids", "stop")},
    "ignore_eos": "stopping.ignore_eos",
}
