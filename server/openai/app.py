"""The OpenAI-compatible HTTP front: a Starlette app over the shared ``Frontend``.

A thin adapter over the same engine as gRPC. A JSON body becomes a ``GenerateRequest``
(``parse.parse_body``) and takes the gRPC path (``Frontend.engine_request``: one
validation, one tokenizer call, one engine client); the outputs become OpenAI's JSON or
server-sent events (``answer.Answer``). Each generation API is an ``Api``: a parser into
that one request and a ``Writer`` of its answers, over one pipeline (``generate``)::

    POST /v1/completions       prompt (text or token ids)       -> text_completion
    POST /v1/chat/completions  messages (chat template)         -> chat.completion
    POST /v1/responses         OpenAI's Responses API           -> response (``responses``)
    POST /v1/messages          Anthropic's Messages API         -> message (``anthropic``)
    POST /v1/messages/count_tokens                              -> {"input_tokens"}
    POST /tokenize, /detokenize  vLLM's tokenizer routes        (``tokenize``)
    GET  /v1/models            the served model and its LoRA adapters (``parent``)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter, GET/POST /lora-adapters
                               the adapters (``server.openai.lora``; admin key to change)
    GET  /health               200 serving / 503 shutting down (no key needed)
    GET  /openapi.json         this API as an OpenAPI document (no key needed)

A body over ``max_request_bytes`` is a 413, refused by its declared Content-Length before a
byte of it is read, or (chunked) as soon as the bytes read pass the bound: never buffered
whole.

With the reasoning parser on (``--reasoning-parser``), chat, Responses and Messages answers
carry a ``<think>`` model's thought apart (``reasoning``), and a thought budget cuts it
(``budget``).

A key comes in ``Authorization: Bearer`` or Anthropic's ``x-api-key``. A stream that fails
after its first event (cut off at the end of the shutdown grace period, say) sends its API's
error event (``data: {"error": ...}`` for chat) and ends. ``server.asgi`` serves the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from metrics.records import MetricsSink, NullSink
from scheduler.request import Request
from server.auth import AuthError, Security
from server.frontend import Frontend, prompt_token_ids
from server.openai.answer import Answer, ChatWriter, Choices, Echo, Writer
from server.openai.anthropic import MessagesWriter, parse_messages
from server.openai.anthropic import error_body as anthropic_error_body
from server.openai.budget import CLOSE_TEXT, budgeted
from server.openai.fields import HttpError, body_too_large, error_body, http_error
from server.openai.lora import LoraRoutes, model_entries
from server.openai.openapi import openapi_document
from server.openai.parse import Parsed, load_body, parse_body
from server.openai.reasoning import Reasoning, opens_thought, reasoning_enabled
from server.openai.responses import ResponsesWriter, parse_responses
from server.openai.tokenize import parse_detokenize, parse_tokenize, tokenize, tokenize_answer
from server.openai.tools import tool_call_format
from server.outputs import GenerationOutput
from server.validation import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_REQUEST_ID_CHARS,
    InvalidRequestError,
)

logger = logging.getLogger(__name__)

# An output -> (the output, its text the answer's content; the thought's text).
Split = Callable[[GenerationOutput], tuple[GenerationOutput, str]]


def _unsplit(out: GenerationOutput) -> tuple[GenerationOutput, str]:
    return out, ""


def _json_error(error: HttpError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.kind, error.param), error.status, headers)


def authorization(request: HttpRequest) -> str | None:
    """The request's key as an ``Authorization`` value: that header, else Anthropic's
    ``x-api-key`` (the same keys, tenants and limits either way)."""
    header = request.headers.get("authorization")
    key = request.headers.get("x-api-key")
    return header if header or not key else f"Bearer {key}"


def openai_error(error: HttpError) -> Response:
    return _json_error(error)


def anthropic_error(error: HttpError) -> Response:
    return JSONResponse(anthropic_error_body(error), error.status)


@dataclass(frozen=True, slots=True)
class Api:
    """One generation API over the shared pipeline (``OpenAIFront.generate``): its body ->
    the shared ``Parsed`` request, its ``Writer``, its error shape; ``method`` names it in
    the metrics; ``default_max_tokens`` for an unset limit (None: the server's)."""

    method: str
    id_prefix: str
    parse: Callable[[Any], Parsed]
    writer: Callable[[Parsed, str, list[int]], Writer]  # (parsed, request id, prompt ids)
    error_response: Callable[[HttpError], Response]
    default_max_tokens: int | None = None
    reasons: bool = True  # a reasoning model's thought is split off (not /v1/completions)


class OpenAIFront:
    """The Starlette app over one ``Frontend``; see the module docstring."""

    def __init__(
        self,
        frontend: Frontend,
        security: Security | None = None,
        sink: MetricsSink | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        reasoning_parser: str = "auto",
    ) -> None:
        """``reasoning_parser``: auto / none / think (``server.openai.reasoning``)."""
        self.frontend = frontend
        self.max_request_bytes = max_request_bytes
        self.security = security if security is not None else Security()
        self.sink: MetricsSink = sink if sink is not None else NullSink()
        self.model = frontend.model
        self.created = int(time.time())
        self._openapi = openapi_document(self.model.name)
        # tool_choice "auto" needs a template that renders tools (server.openai.tools).
        tokenizer = frontend.tokenizer
        self._tool_format = tool_call_format(tokenizer.tool_use_template or tokenizer.chat_template)
        self.reasoning = reasoning_enabled(reasoning_parser, tokenizer.chat_template)
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                *LoraRoutes(frontend, self.security).routes(),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    # ------------------------------------------------------------------ routes
    async def health(self, request: HttpRequest) -> Response:
        if self.frontend.accepting:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "shutting down"}, 503)

    async def openapi(self, request: HttpRequest) -> Response:
        return JSONResponse(self._openapi)

    async def models(self, request: HttpRequest) -> Response:
        try:
            self._owner(request)
        except AuthError as exc:
            return _json_error(http_error(exc))
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
                    },
                    *model_entries(self.frontend, self.created),
                ],
            }
        )

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, chat=True)

    async def responses(self, request: HttpRequest) -> Response:
        def parse(body: Any) -> Parsed:
            names = self.frontend.adapters.names()
            return parse_responses(body, self.model.name, self._tool_format, names)

        def writer(parsed: Parsed, request_id: str, prompt_ids: list[int]) -> Writer:
            return ResponsesWriter(parsed, request_id, self.model.name, len(prompt_ids))

        api = Api("Responses", "resp", parse, writer, openai_error, default_max_tokens=2**31 - 1)
        return await self.generate(request, api)

    async def messages(self, request: HttpRequest) -> Response:
        def parse(body: Any) -> Parsed:
            names = self.frontend.adapters.names()
            return parse_messages(body, self.model.name, self._tool_format, names)

        def writer(parsed: Parsed, request_id: str, prompt_ids: list[int]) -> Writer:
            return MessagesWriter(parsed, request_id, self.model.name, len(prompt_ids))

        return await self.generate(request, Api("Messages", "msg", parse, writer, anthropic_error))

    async def count_tokens(self, request: HttpRequest) -> Response:
        try:
            self._owner(request)
            body = load_body(await self._read_body(request))
            names = self.frontend.adapters.names()
            parsed = parse_messages(body, self.model.name, self._tool_format, names, True)
            tokenizer = self.frontend.tokenizer
            ids = await self.frontend.in_thread(prompt_token_ids, tokenizer, parsed.request)
        except Exception as exc:
            return anthropic_error(http_error(exc))
        return JSONResponse({"input_tokens": len(ids)})

    async def tokenize(self, request: HttpRequest) -> Response:
        try:
            self._owner(request)
            body = load_body(await self._read_body(request))
            read = parse_tokenize(body, self.model.name, self.frontend.adapters.names())
            tokenizer = self.frontend.tokenizer
            ids = await self.frontend.in_thread(tokenize, read, tokenizer)
        except Exception as exc:
            return openai_error(http_error(exc))
        return JSONResponse(tokenize_answer(ids, self.model.max_model_len, read, tokenizer))

    async def detokenize(self, request: HttpRequest) -> Response:
        try:
            self._owner(request)
            body = load_body(await self._read_body(request))
            names = self.frontend.adapters.names()
            ids = parse_detokenize(body, self.model.name, self.model.vocab_size, names)
            text = await self.frontend.in_thread(self.frontend.tokenizer.decode, ids)
        except Exception as exc:
            return openai_error(http_error(exc))
        return JSONResponse({"prompt": text})

    async def _not_found(self, request: HttpRequest, exc: Exception) -> Response:
        return _json_error(
            HttpError(grpc.StatusCode.NOT_FOUND, f"no route {request.url.path}; see GET /v1/models")
        )

    async def _not_allowed(self, request: HttpRequest, exc: Exception) -> Response:
        # Starlette's exception carries the Allow header (RFC 9110 requires it on a 405), its
        # methods in a set's order: sorted here, so the header is the same on every run.
        headers = dict(getattr(exc, "headers", None) or {})
        if "Allow" in headers:
            headers["Allow"] = ", ".join(sorted(m.strip() for m in headers["Allow"].split(",")))
        return _json_error(
            HttpError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"{request.method} is not allowed on {request.url.path}",
            ),
            headers or None,
        )

    # ------------------------------------------------------------------ generation
    async def _read_body(self, http: HttpRequest) -> bytes:
        """The body, at most ``max_request_bytes`` of it: a 413 (``HttpError``) as soon as
        the declared length or the bytes received pass the bound; the rest is never read
        (uvicorn drops it)."""
        limit = self.max_request_bytes
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise body_too_large(int(declared), limit, declared=True)
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(size, limit, declared=False)
            chunks.append(chunk)
        return b"".join(chunks)

    def _owner(self, request: HttpRequest) -> str:
        """Raises ``AuthError`` (401) without a valid key."""
        host = request.client.host if request.client is not None else "unknown"
        return self.security.owner(authorization(request), host)

    async def _generate(self, http: HttpRequest, chat: bool) -> Response:
        def parse(body: Any) -> Parsed:
            return parse_body(
                body, chat, self.model.name, self._tool_format, self.frontend.adapters.names()
            )

        def writer(parsed: Parsed, request_id: str, prompt_ids: list[int]) -> Writer:
            return ChatWriter(
                Answer(
                    parsed, chat, request_id, self.model.name, len(prompt_ids),
                    self.frontend.token, self._echo(parsed, prompt_ids), self._piece,
                )
            )  # fmt: skip

        api = Api(
            "ChatCompletions" if chat else "Completions", "chatcmpl" if chat else "cmpl",
            parse, writer, openai_error,
            # OpenAI's defaults: 16 tokens for a completion, the rest of the context for chat
            default_max_tokens=2**31 - 1 if chat else None, reasons=chat,
        )  # fmt: skip
        return await self.generate(http, api)

    async def generate(self, http: HttpRequest, api: Api) -> Response:
        """One generation through ``api``: its body parsed into the shared request, the
        engine's outputs written in its shape, whole or streamed."""
        method = api.method
        try:
            owner = self._owner(http)
            parsed = api.parse(load_body(await self._read_body(http)))
            request_id = http.headers.get("x-request-id") or f"{api.id_prefix}-{uuid.uuid4().hex}"
            if len(request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidRequestError(
                    f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} characters"
                )
            parsed.request.request_id = request_id
            engine_request = await self.frontend.engine_request(
                parsed.request, owner, default_max_tokens=api.default_max_tokens
            )
            split = self._reasoning(parsed, api, engine_request.prompt_token_ids)
            outputs = self._outputs(parsed, engine_request)
            # The first output before any header: a refusal (overload) is still a status.
            try:
                first = await anext(outputs)
            except BaseException:
                await outputs.aclose()
                raise
        except ClientDisconnect:
            # Hung up mid-body: a cancel, not a failure of ours (nobody reads an answer).
            self.sink.on_rpc(method, "CANCELLED")
            return Response(status_code=499)
        except Exception as exc:
            error = http_error(exc)
            self.sink.on_rpc(method, self._count_failure(method, error, exc))
            return api.error_response(error)
        writer = api.writer(parsed, request_id, list(engine_request.prompt_token_ids))
        if parsed.stream:
            return StreamingResponse(
                self._events(writer, first, outputs, method, split),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        try:
            choices = Choices()

            def add(out: GenerationOutput) -> None:
                choices.add(*split(out))

            add(first)
            if not first.closes_stream and not await _collect_unless_disconnected(
                http, outputs, add
            ):
                self.sink.on_rpc(method, "CANCELLED")
                return Response(status_code=499)  # nobody is listening any more
        except Exception as exc:
            error = http_error(exc)
            self.sink.on_rpc(method, self._count_failure(method, error, exc))
            return api.error_response(error)
        finally:
            await outputs.aclose()
        self.sink.on_rpc(method, "OK")
        return JSONResponse(writer.whole(choices), headers={"X-Request-Id": request_id})

    def _reasoning(self, parsed: Parsed, api: Api, prompt_ids: list[int]) -> Split:
        """How this request's outputs split into (output with the content, thought): with
        the parser on, a ``<think>`` thought comes apart, opened already when the prompt
        ends with ``<think>``; else nothing does."""
        if not (self.reasoning and api.reasons):
            if parsed.thinking_budget is not None:
                raise InvalidRequestError(
                    "a thinking budget (max_thinking_tokens, reasoning_effort, thinking) needs "
                    "a reasoning model: this server runs no reasoning parser (start it with "
                    "--reasoning-parser think)"
                )
            return _unsplit
        parsed.reasoning = True
        tail = self.frontend.tokenizer.decode(prompt_ids[-8:])  # type: ignore[attr-defined]
        return Reasoning(inside=opens_thought(tail)).split

    def _outputs(self, parsed: Parsed, request: Request) -> AsyncGenerator[GenerationOutput, None]:
        """The engine's outputs, the thought cut at the request's budget (``budget``)."""
        budget = parsed.thinking_budget
        if budget is None:
            return self.frontend.stream(request)
        if request.sampling.n > 1:
            raise InvalidRequestError(
                f"a thinking budget takes n = 1, got n = {request.sampling.n}"
            )
        tokenizer = self.frontend.tokenizer
        close_ids = list(tokenizer.encode(CLOSE_TEXT, add_special_tokens=False))
        return budgeted(self.frontend.stream, request, budget, close_ids)

    def _echo(self, parsed: Parsed, prompt_ids: list[int]) -> Echo | None:
        """The prompt an echo answer starts with: as sent, or its ids decoded."""
        if not parsed.echo:
            return None
        request = parsed.request
        text = request.text if request.WhichOneof("input") == "text" else None
        if text is None:
            text = self.frontend.tokenizer.decode(prompt_ids)  # type: ignore[attr-defined]
        return Echo(text, prompt_ids)

    def _piece(self, token_id: int) -> str:
        """A token's decoded text (text_offset counts it)."""
        return str(self.frontend.tokenizer.decode([token_id]))  # type: ignore[attr-defined]

    async def _events(
        self,
        writer: Writer,
        first: GenerationOutput,
        outputs: AsyncGenerator[GenerationOutput, None],
        method: str,
        split: Split,
    ) -> AsyncIterator[str]:
        code = "OK"
        try:
            for event in writer.events(*split(first)):
                yield event
            if not first.closes_stream:
                async for out in outputs:
                    for event in writer.events(*split(out)):
                        yield event
            closing = writer.end()
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        except Exception as exc:
            error = http_error(exc)
            code = self._count_failure(method, error, exc)
            closing = writer.failed(error)
        finally:
            with contextlib.suppress(Exception):
                await outputs.aclose()
            self.sink.on_rpc(method, code)
        for event in closing:
            yield event

    def _count_failure(self, method: str, error: HttpError, exc: BaseException) -> str:
        """Log an internal failure and count a rejection as gRPC's would be; the caller
        records the call under the returned code name."""
        if error.code is grpc.StatusCode.INTERNAL:
            logger.error("%s failed: %r", method, exc, exc_info=exc)
        if error.code is grpc.StatusCode.INVALID_ARGUMENT:
            self.sink.on_rejected("invalid")
        elif error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.sink.on_rejected("overload")
        return error.code.name


async def _collect_unless_disconnected(
    http: HttpRequest,
    outputs: AsyncGenerator[GenerationOutput, None],
    add: Callable[[GenerationOutput], None],
) -> bool:
    """Collect the rest of a non-streamed answer; False when the client hung up first (the
    request is then aborted: closing its stream does that)."""

    async def collect() -> None:
        async for out in outputs:
            add(out)

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
