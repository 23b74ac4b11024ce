"""The OpenAI-compatible HTTP front: Starlette on uvicorn, in the server's own event loop.

A thin adapter over the same engine as gRPC. A JSON body becomes a ``GenerateRequest`` and
takes the gRPC path (``GenerationServicer.engine_request``: one validation, one tokenizer
call, one engine client); the outputs become OpenAI's JSON or server-sent events::

    POST /v1/completions       prompt (text or token ids)       -> text_completion
    POST /v1/chat/completions  messages (chat template)         -> chat.completion
    GET  /v1/models            the served model
    GET  /health               200 serving / 503 shutting down (no key needed)

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status from the gRPC code the same failure gets (``service.status_of``): 400 invalid,
401 no or a wrong key, 404 unknown model, 409 duplicate id, 429 overloaded, 503 shutting
down, 504 deadline, 500 a failed request. A stream that fails after its first event (cut off
at the end of the shutdown grace period, say) sends ``data: {"error": ...}`` and ends.

Fields a request may carry are listed below; any other field with a value is refused with a
400 that names it, so a client never gets silently different behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from metrics.records import MetricsSink, NullSink
from scheduler.request import FinishReason, Request
from server.auth import AuthError, Security
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb
from server.service import GenerationServicer, status_of
from server.validation import MAX_REQUEST_ID_CHARS, InvalidRequestError

logger = logging.getLogger(__name__)

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
_FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
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
    "priority", "ignore_eos", "min_tokens", "stop_token_ids", "logprobs",
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


def _http_error(exc: BaseException) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    code, details = status_of(exc)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        for grpc_name, http_name in _FIELD_NAMES.items():
            details = details.replace(grpc_name, http_name)
    return HttpError(code, details)


def _json_error(error: HttpError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.kind, error.param), error.status)


# ---------------------------------------------------------------------- JSON -> request
def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(f"{key} must be a number, got {value!r}")
    return float(value)


def _int(body: Mapping[str, Any], key: str, minimum: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{key} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise InvalidRequestError(f"{key} must be >= {minimum}, got {value}")
    return value


def _bool(body: Mapping[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{key} must be true or false, got {value!r}")
    return value


def _str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequestError(f"{key} must be a string, got {value!r}")
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
class _Parsed:
    """An HTTP request as the engine will see it, and how to answer it."""

    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool


def parse_body(body: Any, chat: bool, model_name: str) -> _Parsed:
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
    else:
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
    s, t = request.sampling, request.stopping
    for key in _SAMPLING_FLOATS:
        value = _number(body, key)
        if value is not None:
            setattr(s, key, value)
    top_k = _int(body, "top_k", minimum=1)
    if top_k is not None:
        s.top_k = top_k
    seed = _int(body, "seed")
    if seed is not None:
        s.seed = seed & 0xFFFFFFFFFFFFFFFF  # OpenAI seeds may be negative: same bits
    max_tokens = _int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is not None:
        if max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {max_tokens}")
        t.max_tokens = min(max_tokens, 2**31 - 1)
    min_tokens = _int(body, "min_tokens", minimum=0)
    if min_tokens is not None:
        t.min_tokens = min_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        t.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        t.stop.extend(stop)
    elif stop is not None:
        raise InvalidRequestError("stop must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = _token_ids(stop_ids, "stop_token_ids")
        if ids is None:
            raise InvalidRequestError("stop_token_ids must be a list of token ids")
        t.stop_token_ids.extend(ids)
    if _bool(body, "ignore_eos"):
        t.ignore_eos = True
    n = _int(body, "n", minimum=1)
    if n is not None:
        request.n = n
    priority = _int(body, "priority")
    if priority is not None:
        request.priority = max(-(2**31), min(priority, 2**31 - 1))
    request.cache_salt = _str(body, "cache_salt") or ""
    logprobs = False
    if chat:
        if _bool(body, "logprobs"):
            logprobs = True
            s.logprobs = _int(body, "top_logprobs", minimum=0) or 0
        elif body.get("top_logprobs") is not None:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
    else:
        top = _int(body, "logprobs", minimum=0)
        if top is not None:
            logprobs = True
            s.logprobs = top
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
    return _Parsed(request, stream, include_usage, logprobs)


# ---------------------------------------------------------------------- outputs -> JSON
class _Choices:
    """Per-sample text, tokens and logprobs of a non-streamed answer, and the usage."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.finish: dict[int, str] = {}
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_tokens = 0

    def add(self, out: GenerationOutput) -> None:
        self.texts.setdefault(out.index, []).append(out.text)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.finished:
            self.finish[out.index] = _FINISH_REASONS.get(
                out.finish_reason or FinishReason.ERROR, "error"
            )
            self.num_prompt_tokens = out.num_prompt_tokens
            self.num_cached_tokens = out.num_cached_tokens
            self.num_output_tokens += out.num_output_tokens

    def usage(self) -> dict[str, Any]:
        return usage_body(self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens)


def usage_body(num_prompt: int, num_cached: int, num_output: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
        "prompt_tokens_details": {"cached_tokens": num_cached},
    }


class OpenAIFront:
    """The Starlette app over one ``GenerationServicer``; see the module docstring."""

    def __init__(
        self,
        servicer: GenerationServicer,
        security: Security | None = None,
        sink: MetricsSink | None = None,
    ) -> None:
        self.servicer = servicer
        self.security = security if security is not None else Security()
        self.sink: MetricsSink = sink if sink is not None else NullSink()
        self.model = servicer.model
        self.created = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # ------------------------------------------------------------------ routes
    async def health(self, request: HttpRequest) -> Response:
        if self.servicer.accepting:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "shutting down"}, 503)

    async def models(self, request: HttpRequest) -> Response:
        try:
            self._owner(request)
        except AuthError as exc:
            return _json_error(_http_error(exc))
        m = self.model
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": m.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kvserve",
                        "max_model_len": m.max_model_len,
                        # llama.cpp's extension; kvserve loadtest reads the vocabulary here.
                        "meta": {"n_vocab": m.vocab_size, "n_ctx": m.max_model_len},
                    }
                ],
            }
        )

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=True)

    async def _not_found(self, request: HttpRequest, exc: Exception) -> Response:
        return _json_error(
            HttpError(grpc.StatusCode.NOT_FOUND, f"no route {request.url.path}; see GET /v1/models")
        )

    async def _not_allowed(self, request: HttpRequest, exc: Exception) -> Response:
        return _json_error(
            HttpError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{request.method} is not allowed on {request.url.path}",
            )
        )

    # ------------------------------------------------------------------ generation
    def _owner(self, request: HttpRequest) -> str:
        """Raises ``AuthError`` (401) without a valid key."""
        host = request.client.host if request.client is not None else "unknown"
        return self.security.owner(request.headers.get("authorization"), host)

    async def _generate(self, http: HttpRequest, chat: bool) -> Response:
        method = "ChatCompletions" if chat else "Completions"
        try:
            owner = self._owner(http)
            try:
                body = await http.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
            parsed = parse_body(body, chat, self.model.name)
            request_id = http.headers.get("x-request-id") or (
                f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            )
            if len(request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidRequestError(
                    f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} characters"
                )
            parsed.request.request_id = request_id
            engine_request = await self.servicer.engine_request(
                # OpenAI's defaults: 16 tokens for a completion, the rest of the context for chat
                parsed.request, owner, default_max_tokens=2**31 - 1 if chat else None,
            )  # fmt: skip
            outputs = self.servicer.stream(engine_request)
            # The first output before any header: a refusal (overload) is still a status.
            try:
                first = await anext(outputs)
            except BaseException:
                await outputs.aclose()
                raise
        except Exception as exc:
            error = _http_error(exc)
            self._record(method, error, exc)
            return _json_error(error)
        answer = _Answer(self, engine_request, request_id, chat, parsed)
        if parsed.stream:
            return StreamingResponse(
                self._events(answer, first, outputs, method),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        try:
            choices = _Choices()
            choices.add(first)
            if not first.closes_stream and not await _collect_unless_disconnected(
                http, outputs, choices
            ):
                self.sink.on_rpc(method, "CANCELLED")
                return Response(status_code=499)  # nobody is listening any more
        except Exception as exc:
            error = _http_error(exc)
            self._record(method, error, exc)
            return _json_error(error)
        finally:
            await outputs.aclose()
        self.sink.on_rpc(method, "OK")
        return JSONResponse(answer.whole(choices), headers={"X-Request-Id": request_id})

    async def _events(
        self,
        answer: _Answer,
        first: GenerationOutput,
        outputs: AsyncGenerator[GenerationOutput, None],
        method: str,
    ) -> AsyncIterator[str]:
        code = "OK"
        try:
            for event in answer.chunks(first):
                yield event
            if not first.closes_stream:
                async for out in outputs:
                    for event in answer.chunks(out):
                        yield event
            if answer.parsed.include_usage:
                yield _sse(answer.usage_chunk())
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        except Exception as exc:
            error = _http_error(exc)
            code = self._record(method, error, exc, record=False)
            yield _sse(error_body(error.message, error.kind, error.param))
        finally:
            with contextlib.suppress(Exception):
                await outputs.aclose()
            self.sink.on_rpc(method, code)
        yield "data: [DONE]\n\n"

    def _record(
        self, method: str, error: HttpError, exc: BaseException, record: bool = True
    ) -> str:
        """Count a failed call as gRPC's would be; returns its code name."""
        name = error.code.name
        if error.code is grpc.StatusCode.INTERNAL:
            logger.error("%s failed: %r", method, exc, exc_info=exc)
        if name == "INVALID_ARGUMENT":
            self.sink.on_rejected("invalid")
        elif name == "RESOURCE_EXHAUSTED":
            self.sink.on_rejected("overload")
        if record:
            self.sink.on_rpc(method, name)
        return name


async def _collect_unless_disconnected(
    http: HttpRequest, outputs: AsyncGenerator[GenerationOutput, None], choices: _Choices
) -> bool:
    """Collect the rest of a non-streamed answer; False when the client hung up first (the
    request is then aborted: closing its stream does that)."""

    async def collect() -> None:
        async for out in outputs:
            choices.add(out)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await collecting
    if collecting.cancelled():
        return False
    collecting.result()  # raises what ended the request
    return True


def _sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Answer:
    """Builds one request's response objects (whole, or as stream chunks)."""

    def __init__(
        self, front: OpenAIFront, request: Request, request_id: str, chat: bool, parsed: _Parsed
    ) -> None:
        self.front = front
        self.id = request_id
        self.chat = chat
        self.parsed = parsed
        self.created = int(time.time())
        self.model = front.model.name
        self.started: set[int] = set()
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_cached_tokens = 0
        self.num_output_tokens = 0

    def _token(self, token_id: int) -> str:
        return self.front.servicer.tokenizer.id_to_token(token_id) or ""

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

    def whole(self, choices: _Choices) -> dict[str, Any]:
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
        body["usage"] = choices.usage()
        return body

    def chunks(self, out: GenerationOutput) -> list[str]:
        """The SSE events for one engine output (chat opens each choice with its role)."""
        events = []
        if self.chat and out.index not in self.started:
            self.started.add(out.index)
            events.append(self._chunk(out.index, {"role": "assistant", "content": ""}))
        reason = None
        if out.finished:
            reason = _FINISH_REASONS.get(out.finish_reason or FinishReason.ERROR, "error")
            self.num_cached_tokens = out.num_cached_tokens
            self.num_prompt_tokens = out.num_prompt_tokens
            self.num_output_tokens += out.num_output_tokens
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
        return _sse(body)

    def usage_chunk(self) -> dict[str, Any]:
        body = self._base(chunk=True)
        body["choices"] = []
        body["usage"] = usage_body(
            self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens
        )
        return body


# ---------------------------------------------------------------------- uvicorn in our loop
class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: ``kvserve serve`` owns SIGTERM / SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


@dataclass(slots=True)
class AsgiServer:
    """An ASGI app served by uvicorn as a task of the running event loop."""

    server: uvicorn.Server
    task: asyncio.Task[None]
    port: int

    async def stop(self, timeout_s: float = 5.0) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


async def start_asgi_server(
    app: ASGIApp,
    host: str,
    port: int,
    security: Security | None = None,
    *,
    limit_concurrency: int | None = None,
    name: str = "http",
) -> AsgiServer:
    """Bind ``host:port`` (0: a free port) and serve ``app`` from this event loop, with TLS
    when ``security.tls`` is set. Over ``limit_concurrency`` open connections uvicorn
    answers 503 at once instead of starting more work."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind {name} to {host}:{port}: {exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    tls = security.tls if security is not None else None
    kwargs: dict[str, Any] = {}
    if tls is not None:
        import ssl

        kwargs = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
        if tls.client_ca is not None:
            kwargs.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        access_log=False,
        limit_concurrency=limit_concurrency,
        timeout_graceful_shutdown=1,
        **kwargs,
    )
    server = _Server(config)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name=name)
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise OSError(f"{name} server stopped during start-up")
        await asyncio.sleep(0.01)
    return AsgiServer(server, task, int(sock.getsockname()[1]))


# Scrapes served at once; over it uvicorn answers 503 instead of taking more work.
METRICS_MAX_CONNECTIONS = 8


class _KeyGate:
    """ASGI middleware: every path but the open ones needs a valid API key."""

    def __init__(self, app: ASGIApp, security: Security, open_paths: frozenset[str]) -> None:
        self.app, self.security, self.open_paths = app, security, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = dict(scope.get("headers") or ())
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            try:
                self.security.authenticate(authorization)
            except AuthError as exc:
                response = JSONResponse(error_body(str(exc), "authentication_error"), 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def metrics_app(registry: Any, security: Security | None = None) -> ASGIApp:
    """prometheus-client's ASGI app for ``registry``, behind the API key when asked."""
    from prometheus_client import make_asgi_app

    app: ASGIApp = make_asgi_app(registry)
    if security is not None and security.auth_enabled and security.metrics_require_key:
        app = _KeyGate(app, security, frozenset())
    return app
