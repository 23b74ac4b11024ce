"""The OpenAI-compatible HTTP front: a Starlette app over the shared ``Frontend``.

A thin adapter over the same engine as gRPC. A JSON body becomes a ``GenerateRequest``
(``parse.parse_body``) and takes the gRPC path (``Frontend.engine_request``: one
validation, one tokenizer call, one engine client); the outputs become OpenAI's JSON or
server-sent events (``answer.Answer``)::

    POST /v1/completions       prompt (text or token ids)       -> text_completion
    POST /v1/chat/completions  messages (chat template)         -> chat.completion
    GET  /v1/models            the served model and its LoRA adapters (``parent``)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter, GET/POST /lora-adapters
                               the adapters (``server.openai.lora``; admin key to change)
    GET  /health               200 serving / 503 shutting down (no key needed)
    GET  /openapi.json         this API as an OpenAPI document (no key needed)

A body over ``max_request_bytes`` is a 413, refused by its declared Content-Length before a
byte of it is read, or (chunked) as soon as the bytes read pass the bound: never buffered
whole.

A stream that fails after its first event (cut off at the end of the shutdown grace period,
say) sends ``data: {"error": ...}`` and ends. ``server.asgi`` serves the app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from metrics.records import MetricsSink, NullSink
from server.auth import AuthError, Security
from server.frontend import Frontend
from server.openai.answer import Answer, Choices, Echo, sse
from server.openai.fields import HttpError, body_too_large, error_body, http_error
from server.openai.lora import LoraRoutes, model_entries
from server.openai.openapi import openapi_document
from server.openai.parse import Parsed, load_body, parse_body
from server.openai.tools import tool_call_format
from server.outputs import GenerationOutput
from server.validation import (
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_REQUEST_ID_CHARS,
    InvalidRequestError,
)

logger = logging.getLogger(__name__)


def _json_error(error: HttpError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.kind, error.param), error.status, headers)


class OpenAIFront:
    """The Starlette app over one ``Frontend``; see the module docstring."""

    def __init__(
        self,
        frontend: Frontend,
        security: Security | None = None,
        sink: MetricsSink | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    ) -> None:
        self.frontend = frontend
        self.max_request_bytes = max_request_bytes
        self.security = security if security is not None else Security()
        self.sink: MetricsSink = sink if sink is not None else NullSink()
        self.model = frontend.model
        self.created = int(time.time())
        self._openapi = openapi_document(self.model.name)
        # tool_choice "auto" needs a template that renders tools (server.openai.tools).
        self._tool_format = tool_call_format(frontend.tokenizer.chat_template)
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
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
        return self.security.owner(request.headers.get("authorization"), host)

    async def _generate(self, http: HttpRequest, chat: bool) -> Response:
        method = "ChatCompletions" if chat else "Completions"
        try:
            owner = self._owner(http)
            body = load_body(await self._read_body(http))
            parsed = parse_body(
                body, chat, self.model.name, self._tool_format, self.frontend.adapters.names()
            )
            request_id = http.headers.get("x-request-id") or (
                f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            )
            if len(request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidRequestError(
                    f"X-Request-Id must be at most {MAX_REQUEST_ID_CHARS} characters"
                )
            parsed.request.request_id = request_id
            engine_request = await self.frontend.engine_request(
                # OpenAI's defaults: 16 tokens for a completion, the rest of the context for chat
                parsed.request, owner, default_max_tokens=2**31 - 1 if chat else None,
            )  # fmt: skip
            outputs = self.frontend.stream(engine_request)
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
            return _json_error(error)
        answer = Answer(
            parsed, chat, request_id, self.model.name,
            len(engine_request.prompt_token_ids), self.frontend.token,
            self._echo(parsed, engine_request.prompt_token_ids), self._piece,
        )  # fmt: skip
        if parsed.stream:
            return StreamingResponse(
                self._events(answer, first, outputs, method),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        try:
            choices = Choices()
            choices.add(first)
            if not first.closes_stream and not await _collect_unless_disconnected(
                http, outputs, choices
            ):
                self.sink.on_rpc(method, "CANCELLED")
                return Response(status_code=499)  # nobody is listening any more
        except Exception as exc:
            error = http_error(exc)
            self.sink.on_rpc(method, self._count_failure(method, error, exc))
            return _json_error(error)
        finally:
            await outputs.aclose()
        self.sink.on_rpc(method, "OK")
        return JSONResponse(answer.whole(choices), headers={"X-Request-Id": request_id})

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
        answer: Answer,
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
                yield sse(answer.usage_chunk())
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        except Exception as exc:
            error = http_error(exc)
            code = self._count_failure(method, error, exc)
            yield sse(error_body(error.message, error.kind, error.param))
        finally:
            with contextlib.suppress(Exception):
                await outputs.aclose()
            self.sink.on_rpc(method, code)
        yield "data: [DONE]\n\n"

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
    http: HttpRequest, outputs: AsyncGenerator[GenerationOutput, None], choices: Choices
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
