"""The OpenAI protocol: a JSON body -> a ``GenerateRequest``, engine outputs -> OpenAI's JSON
and server-sent events, failures -> OpenAI's error shape. Pure functions and small builders,
with no server: ``server.openai_app`` serves them, and tests table-test them directly.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status from the gRPC code the same failure gets (``frontend.status_of``): 400 invalid,
401 no or a wrong key, 404 unknown model, 409 duplicate id, 429 overloaded, 503 shutting
down, 504 deadline, 500 a failed request.

Fields a request may carry are listed below; any other field with a value is refused with a
400 that names it, so a client never gets silently different behaviour.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from scheduler.request import FinishReason
from server.frontend import status_of
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError

# gRPC code -> (HTTP status, OpenAI error type).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "stalled_stream_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNIMPLEMENTED: (405, "invalid_request_error"),
}
# Validation names gRPC field paths; an HTTP client knows OpenAI's names.
_FIELD_NAMES = {
    "sampling.": "",
    "stopping.": "",
    "chat.messages": "messages",
    "token_ids.ids": "prompt",
}

# Fields both endpoints take, and where each goes in a GenerateRequest.
_SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty")  # fmt: skip
_SAMPLING_INTS = ("top_k", "seed")
_COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "stop", "n", "user", "cache_salt",
    "priority", "ignore_eos", "min_tokens", "stop_token_ids", "logprobs", "slo",
    *_SAMPLING_FLOATS, *_SAMPLING_INTS,
})  # fmt: skip
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}


class HttpError(Exception):
    """Ends an HTTP request with an OpenAI error body; the status comes from ``code``, the
    gRPC code the same failure gets (metrics count both front ends by it)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.status, self.kind = _HTTP_STATUS.get(code, (500, "internal_error"))


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def http_error(exc: BaseException) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    code, details = status_of(exc)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        for grpc_name, http_name in _FIELD_NAMES.items():
            details = details.replace(grpc_name, http_name)
    return HttpError(code, details)


def finish_reason(out: GenerationOutput) -> str | None:
    """OpenAI's ``finish_reason`` of an output: None until the sample ends."""
    if not out.finished:
        return None
    return (out.finish_reason or FinishReason.ERROR).value


# ---------------------------------------------------------------------- JSON -> request
def _typed(body: Mapping[str, Any], key: str, ok: Callable[[Any], bool], what: str) -> Any:
    value = body.get(key)
    if value is None or ok(value):
        return value
    raise InvalidRequestError(f"{key} must be {what}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = _typed(body, key, lambda v: _is_int(v) or isinstance(v, float), "a number")
    return None if value is None else float(value)


def _int(body: Mapping[str, Any], key: str, minimum: int | None = None) -> int | None:
    value: int | None = _typed(body, key, _is_int, "an integer")
    if value is not None and minimum is not None and value < minimum:
        raise InvalidRequestError(f"{key} must be >= {minimum}, got {value}")
    return value


def _bool(body: Mapping[str, Any], key: str) -> bool | None:
    value: bool | None = _typed(body, key, lambda v: isinstance(v, bool), "true or false")
    return value


def _str(body: Mapping[str, Any], key: str) -> str | None:
    value: str | None = _typed(body, key, lambda v: isinstance(v, str), "a string")
    return value


def _token_ids(value: Any, key: str) -> list[int] | None:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return None
    negative = [t for t in value if t < 0]
    if negative:
        raise InvalidRequestError(f"{key} holds a negative token id: {negative[0]}")
    return value


def _check_fields(body: Mapping[str, Any], allowed: frozenset[str], endpoint: str) -> None:
    """Refuse fields this server does not implement, instead of ignoring them."""
    unsupported = sorted(
        k for k, v in body.items()
        if k not in allowed and v is not None and v is not False and v != {} and v != []
    )  # fmt: skip
    if body.get("echo") is True:
        unsupported.append("echo")
    if body.get("best_of") not in (None, 1):
        unsupported.append("best_of")
    if unsupported:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"unsupported field(s) for {endpoint}: {', '.join(unsupported)}; this server takes "
            f"{', '.join(sorted(allowed - {'echo', 'best_of'}))}",
            unsupported[0],
        )


def _chat_content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}] is of type {kind!r}; only text parts are supported"
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts")


@dataclass(slots=True)
class Parsed:
    """An HTTP request as the engine will see it, and how to answer it."""

    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool


def parse_body(body: Any, chat: bool, model_name: str) -> Parsed:
    """Translate a completions / chat completions body into a ``GenerateRequest``."""
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    _check_fields(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS, endpoint)
    model = _str(body, "model")
    if model is not None and model not in (model_name, ""):
        raise HttpError(
            grpc.StatusCode.NOT_FOUND,
            f"the model {model!r} does not exist: this server serves {model_name!r}",
            "model",
        )
    request = pb.GenerateRequest()
    if chat:
        _set_messages(request, body)
    else:
        _set_prompt(request, body)
    _set_sampling(request.sampling, body)
    _set_stopping(request.stopping, body, chat)
    n = _int(body, "n", minimum=1)
    if n is not None:
        request.n = n
    priority = _int(body, "priority")
    if priority is not None:
        request.priority = max(-(2**31), min(priority, 2**31 - 1))
    request.cache_salt = _str(body, "cache_salt") or ""
    _set_slo(request.slo, body)
    logprobs = _set_logprobs(request.sampling, body, chat)
    _str(body, "user")  # accepted (OpenAI's end-user id); kvserve scopes by key or peer
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise InvalidRequestError("stream_options must be an object")
        if not stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true")
        include_usage = bool(_bool(options, "include_usage"))
    return Parsed(request, stream, include_usage, logprobs)


def _set_slo(slo: pb.LatencyTargets, body: Mapping[str, Any]) -> None:
    """The request's own latency targets, a vLLM-style extra field (``extra_body`` in
    OpenAI's clients) shaped as the gRPC ``GenerateRequest.slo``:
    ``"slo": {"ttft_ms": 500, "itl_ms": 50}``; either may be left out (the server's
    default). Their range is checked with every request's (``validation``)."""
    value = body.get("slo")
    if value is None:
        return
    if not isinstance(value, Mapping) or not set(value) <= {"ttft_ms", "itl_ms"}:
        raise InvalidRequestError(
            f'slo must be an object {{"ttft_ms": ..., "itl_ms": ...}} of milliseconds, '
            f"got {value!r}"
        )
    for key in ("ttft_ms", "itl_ms"):
        target = _typed(value, key, lambda v: _is_int(v) or isinstance(v, float), "a number")
        if target is not None:
            setattr(slo, key, float(target))


def _set_messages(request: pb.GenerateRequest, body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object with role, content")
        role = msg.get("role")
        request.chat.messages.add(
            role=str(role or ""), content=_chat_content(msg.get("content"), i)
        )


def _set_prompt(request: pb.GenerateRequest, body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    ids = _token_ids(prompt, "prompt")
    if isinstance(prompt, str):
        request.text = prompt
    elif ids is not None and ids:
        request.token_ids.ids.extend(ids)
    elif isinstance(prompt, list) and prompt:
        raise InvalidRequestError(
            "prompt: batches of prompts are not supported; send one request per prompt"
        )
    else:
        raise InvalidRequestError("prompt is required: a string or a list of token ids")


def _set_sampling(sampling: pb.SamplingOptions, body: Mapping[str, Any]) -> None:
    for key in _SAMPLING_FLOATS:
        value = _number(body, key)
        if value is not None:
            setattr(sampling, key, value)
    # Ranges are SamplingParams' (one home): a bad value fails in validation, named as here.
    top_k = _int(body, "top_k")
    if top_k is not None:
        sampling.top_k = top_k
    seed = _int(body, "seed")
    if seed is not None:
        sampling.seed = seed & 0xFFFFFFFFFFFFFFFF  # OpenAI seeds may be negative: same bits


def _set_stopping(stopping: pb.StoppingOptions, body: Mapping[str, Any], chat: bool) -> None:
    max_tokens = _int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is not None:
        stopping.max_tokens = max(-(2**31), min(max_tokens, 2**31 - 1))  # the proto's int32
    min_tokens = _int(body, "min_tokens")
    if min_tokens is not None:
        stopping.min_tokens = min_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        stopping.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        stopping.stop.extend(stop)
    elif stop is not None:
        raise InvalidRequestError("stop must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = _token_ids(stop_ids, "stop_token_ids")
        if ids is None:
            raise InvalidRequestError("stop_token_ids must be a list of token ids")
        stopping.stop_token_ids.extend(ids)
    if _bool(body, "ignore_eos"):
        stopping.ignore_eos = True


def _set_logprobs(sampling: pb.SamplingOptions, body: Mapping[str, Any], chat: bool) -> bool:
    """Whether the answer carries logprobs (``sampling.logprobs``: how many top ones)."""
    if chat:
        if _bool(body, "logprobs"):
            # Checked here: SamplingParams would name it logprobs, OpenAI's chat top_logprobs.
            sampling.logprobs = _int(body, "top_logprobs", minimum=0) or 0
            return True
        if body.get("top_logprobs") is not None:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        return False
    top = _int(body, "logprobs")
    if top is None:
        return False
    sampling.logprobs = top
    return True


# ---------------------------------------------------------------------- outputs -> JSON
@dataclass(slots=True)
class Usage:
    """Token counts of one answer (the samples' outputs summed, the prompt's once)."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, out: GenerationOutput) -> None:
        """Count a finished sample's last output."""
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_output_tokens += out.num_output_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


class Choices:
    """Per-sample text, logprobs and finish reason of a non-streamed answer, and the usage."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.finish: dict[int, str | None] = {}
        self.usage = Usage()

    def add(self, out: GenerationOutput) -> None:
        self.texts.setdefault(out.index, []).append(out.text)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.finished:
            self.finish[out.index] = finish_reason(out)
            self.usage.add(out)


def sse(obj: Mapping[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Answer:
    """Builds one request's response objects (whole, or as stream chunks)."""

    def __init__(
        self,
        parsed: Parsed,
        chat: bool,
        request_id: str,
        model_name: str,
        num_prompt_tokens: int,
        token: Callable[[int], str],
    ) -> None:
        self.id = request_id
        self.chat = chat
        self.parsed = parsed
        self.created = int(time.time())
        self.model = model_name
        self.started: set[int] = set()
        self.usage = Usage(num_prompt_tokens=num_prompt_tokens)
        self._token = token

    def _logprobs(self, lps: Iterable[Any]) -> dict[str, Any] | None:
        lps = list(lps)
        if not self.parsed.logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self._token(lp.token_id).encode()),
                        "top_logprobs": [
                            {
                                "token": self._token(t),
                                "logprob": p,
                                "bytes": list(self._token(t).encode()),
                            }
                            for t, p in lp.top
                        ],
                    }
                    for lp in lps
                ]
            }
        return {
            "tokens": [self._token(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(t): p for t, p in lp.top} for lp in lps],
        }

    def _base(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, choices: Choices) -> dict[str, Any]:
        body = self._base(chunk=False)
        items = []
        for index in sorted(choices.texts):
            text = "".join(choices.texts[index])
            item: dict[str, Any] = {"index": index}
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
            else:
                item["text"] = text
            item["logprobs"] = self._logprobs(choices.logprobs[index])
            item["finish_reason"] = choices.finish.get(index)
            items.append(item)
        body["choices"] = items
        body["usage"] = choices.usage.body()
        return body

    def chunks(self, out: GenerationOutput) -> list[str]:
        """The SSE events for one engine output (chat opens each choice with its role)."""
        events = []
        if self.chat and out.index not in self.started:
            self.started.add(out.index)
            events.append(self._chunk(out.index, {"role": "assistant", "content": ""}))
        reason = None
        reason = finish_reason(out)
        if out.finished:
            self.usage.add(out)
        if out.text or out.logprobs or reason is not None:
            delta = {"content": out.text} if out.text else {}
            events.append(
                self._chunk(out.index, delta if self.chat else out.text, out.logprobs, reason)
            )
        return events

    def _chunk(
        self,
        index: int,
        content: Any,
        logprobs: Iterable[Any] = (),
        finish_reason: str | None = None,
    ) -> str:
        body = self._base(chunk=True)
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self.chat else "text"] = content
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        if self.parsed.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self) -> dict[str, Any]:
        body = self._base(chunk=True)
        body["choices"] = []
        body["usage"] = self.usage.body()
        return body
