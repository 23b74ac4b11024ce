"""The gRPC edge: the ``kvserve.v1.Generation`` servicer, health, reflection, shutdown.

The servicer is thin: it validates (``server.validation``), tokenizes in a thread executor,
and streams what ``EngineClient.generate`` yields. Errors map to status codes in one place,
``status_of``::

    InvalidRequestError / admission ValueError -> INVALID_ARGUMENT
    AuthError (no or a wrong API key)          -> UNAUTHENTICATED
    DuplicateRequestError                      -> ALREADY_EXISTS
    OverloadError                              -> RESOURCE_EXHAUSTED
    a request finished with ERROR              -> INTERNAL (that request only)
    EngineDeadError / shutting down / cut off  -> UNAVAILABLE
    at the end of the shutdown grace period
    StalledStreamError (client stopped reading) -> ABORTED
    DeadlineExceededError                      -> DEADLINE_EXCEEDED

Request ids belong to their caller (``server.auth``): the engine sees ``<owner>/<id>``, so
``Abort`` and the duplicate-id check only ever see the caller's own requests.

Requests are decoded with a lenient deserializer, so a malformed message (e.g. a string field
that is not UTF-8) is an ``INVALID_ARGUMENT`` instead of gRPC's ``UNKNOWN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from metrics.records import MetricsSink, NullSink
from scheduler.errors import OverloadError
from scheduler.output import TokenLogprobs
from scheduler.request import AbortReason, FinishReason, Request
from server import validation
from server.auth import AuthError, Security, client_id, grpc_peer_host, scoped_id
from server.engine import EngineDeadError, EngineLoop, StalledStreamError
from server.engine_client import DeadlineExceededError, DuplicateRequestError, EngineClient
from server.kv_tier_rpc import kv_tier_rpc_fields
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError, Limits

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "kvserve.v1.Generation"

_FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


class ServerTokenizer(Protocol):
    """What the server needs from a tokenizer (``model_runner.tokenizer.Tokenizer`` has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What GetModelInfo reports, and the limits requests are checked against."""

    name: str
    max_model_len: int  # the effective context (model and scheduler limits)
    vocab_size: int
    block_size: int
    num_blocks: int
    kv_memory_bytes: int
    dtype: str
    device: str
    eos_token_ids: tuple[int, ...]
    max_n: int = 1  # > 1 only when the scheduler forks samples
    weights: str = "float"  # "float", or the quantized formats held ("Q4_1+Q8_0", "int8")
    weight_bytes: int = 0
    kv_dtype: str = "float32"  # KV cache precision (kv_memory_bytes counts it)
    streams_past_context: bool = False  # attention sinks: max_tokens may pass the context

    @property
    def limits(self) -> Limits:
        return Limits(
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            max_n=self.max_n,
            streams_past_context=self.streams_past_context,
        )


def encode_chat(
    tokenizer: ServerTokenizer, chat: pb.ChatMessages, add_special_tokens: bool
) -> list[int]:
    """Chat messages rendered with the model's template, then tokenized."""
    text = tokenizer.apply_chat_template(
        validation.chat_messages(chat),
        add_generation_prompt=validation.add_generation_prompt(chat),
    )
    return tokenizer.encode(text, add_special_tokens)


def prompt_token_ids(tokenizer: ServerTokenizer, request: pb.GenerateRequest) -> list[int]:
    """A Generate request's prompt as token ids (text, chat or ids); blocking.

    One home for what a prompt means: the servicer runs it in a thread, and the cluster
    router runs it to find the replica that holds the prompt's prefix.
    """
    kind = validation.input_kind(request)
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "text":
        if not request.text:
            raise InvalidRequestError("the prompt is empty: text must not be empty")
        return list(tokenizer.encode(request.text, True))
    return list(encode_chat(tokenizer, request.chat, False))


@dataclass(slots=True)
class _Undecodable:
    """Stands in for a request message protobuf could not parse."""

    error: str


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return _Undecodable(str(exc))

    return deserialize


class _RpcError(Exception):
    """Ends an RPC with ``code`` and ``details`` (raised inside handlers, mapped once)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, _RpcError):
        return exc.code, exc.details
    if isinstance(exc, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, ValueError):  # InvalidRequestError, or the scheduler's admission check
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, OverloadError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, f"server overloaded, retry later: {exc}"
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, DeadlineExceededError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc)
    if isinstance(exc, StalledStreamError):
        return grpc.StatusCode.ABORTED, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


class GenerationServicer:
    """``kvserve.v1.Generation`` over one ``EngineClient``."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: ServerTokenizer,
        model: ServedModel,
        *,
        sink: MetricsSink | None = None,
        executor: Executor | None = None,
        security: Security | None = None,
    ) -> None:
        self.client = client
        self.security = security if security is not None else Security()
        self.tokenizer = tokenizer
        self.model = model
        self.limits = model.limits
        self.sink: MetricsSink = sink if sink is not None else NullSink()
        self._executor = executor
        self.accepting = True  # False while draining: new Generate calls get UNAVAILABLE

    # ------------------------------------------------------------------ helpers
    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _encode_chat(self, chat: pb.ChatMessages, add_special_tokens: bool) -> list[int]:
        return encode_chat(self.tokenizer, chat, add_special_tokens)

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        if validation.input_kind(request) == "token_ids":
            return list(request.token_ids.ids)
        return await self._in_thread(prompt_token_ids, self.tokenizer, request)

    def _check_decoded(self, request: Any) -> None:
        if isinstance(request, _Undecodable):
            raise InvalidRequestError(f"malformed request message: {request.error}")

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        """Who sent this call (the auth interceptor has already checked the key)."""
        metadata = dict(context.invocation_metadata() or ())
        authorization = metadata.get("authorization")
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        return self.security.owner(authorization, grpc_peer_host(context.peer()))

    def _record(self, method: str, code: grpc.StatusCode) -> None:
        self.sink.on_rpc(method, code.name)

    async def _unary(
        self, method: str, context: grpc.aio.ServicerContext, body: Awaitable[Any]
    ) -> Any:
        try:
            response = await body
        except asyncio.CancelledError:
            self._record(method, grpc.StatusCode.CANCELLED)
            raise
        except Exception as exc:
            code, details = status_of(exc)
            if code is grpc.StatusCode.INTERNAL:
                logger.exception("%s failed", method)
            self._record(method, code)
            await context.abort(code, details)
        self._record(method, grpc.StatusCode.OK)
        return response

    # ------------------------------------------------------------------ Generate
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        code = grpc.StatusCode.OK
        details = ""
        try:
            async with contextlib.aclosing(self._generate(request, context)) as responses:
                async for response in responses:
                    yield response
        except (asyncio.CancelledError, GeneratorExit):  # GeneratorExit: closed mid-yield
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            code, details = status_of(exc)
            if code is grpc.StatusCode.INTERNAL and not isinstance(exc, _RpcError):
                logger.exception("Generate failed")
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                self.sink.on_rejected("invalid")
            elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.sink.on_rejected("overload")
        finally:
            self._record("Generate", code)
        if code is not grpc.StatusCode.OK:
            await context.abort(code, details)

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._check_decoded(request)
        owner = self._owner(context)
        engine_request = await self.engine_request(request, owner)
        remaining = context.time_remaining()
        deadline_s = None if remaining is None else time.monotonic() + remaining
        want_logprobs = engine_request.sampling.logprobs is not None
        outputs = self.stream(engine_request, deadline_s)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield self._response(out, want_logprobs)

    async def engine_request(
        self, request: pb.GenerateRequest, owner: str, default_max_tokens: int | None = None
    ) -> Request:
        """Validate, tokenize and build the engine's request: one path for both front ends
        (the HTTP front translates its JSON into a ``GenerateRequest`` first).
        ``default_max_tokens``: for an unset ``max_tokens`` (always capped by the context)."""
        if not self.accepting:
            raise _RpcError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        limits = self.limits
        if default_max_tokens is not None:
            limits = replace(limits, default_max_tokens=default_max_tokens)
        validation.check_request_fields(request, limits)
        cache_salt = validation.cache_salt_digest(request.cache_salt)
        prompt_ids = await self._prompt_ids(request)
        sampling = validation.sampling_params(request, len(prompt_ids), limits)
        ttft_slo_s, itl_slo_s = validation.latency_targets(request.slo)
        return Request(
            request_id=scoped_id(owner, request.request_id or uuid.uuid4().hex),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            eos_token_ids=self.model.eos_token_ids,
            priority=request.priority,
            arrival_time_s=time.monotonic(),
            cache_salt=cache_salt,
            ttft_slo_s=ttft_slo_s,
            itl_slo_s=itl_slo_s,
        )

    async def stream(
        self, request: Request, deadline_s: float | None = None
    ) -> AsyncGenerator[GenerationOutput, None]:
        """The engine's outputs for ``request``; a sample that failed raises INTERNAL."""
        # aclosing: an error in one sample closes the engine stream at once, which aborts the
        # request's other samples now rather than whenever the generator is collected.
        outputs = self.client.generate(request, deadline_s=deadline_s)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                if out.finish_reason is FinishReason.ERROR:
                    raise _RpcError(
                        grpc.StatusCode.INTERNAL,
                        f"request {client_id(request.request_id)!r} failed: "
                        f"{out.error or 'unknown error'}",
                    )
                yield out

    def _response(self, out: GenerationOutput, want_logprobs: bool) -> pb.GenerateResponse:
        response = pb.GenerateResponse(
            request_id=client_id(out.request_id),
            index=out.index,
            token_ids=out.token_ids,
            text=out.text,
            finished=out.finished,
        )
        if want_logprobs and out.logprobs:
            response.logprobs.extend(self._logprobs(lp) for lp in out.logprobs)
        if out.finished:
            response.finish_reason = _FINISH_REASONS.get(
                out.finish_reason or FinishReason.ERROR, pb.FINISH_REASON_UNSPECIFIED
            )
            if out.stop_reason is not None:
                response.stop_reason = str(out.stop_reason)
            response.usage.prompt_tokens = out.num_prompt_tokens
            response.usage.completion_tokens = out.num_output_tokens
            response.usage.cached_prompt_tokens = out.num_cached_tokens
            t = response.timings
            t.e2e_time_s = out.e2e_time_s or 0.0
            t.queue_time_s = out.queue_time_s or 0.0
            t.time_to_first_token_s = out.time_to_first_token_s or 0.0
        return response

    def _logprobs(self, lp: TokenLogprobs) -> pb.TokenLogprobs:
        def tok(token_id: int) -> str:
            return self.tokenizer.id_to_token(token_id) or ""

        return pb.TokenLogprobs(
            sampled=pb.TokenLogprob(
                token_id=lp.token_id, logprob=lp.logprob, token=tok(lp.token_id)
            ),
            top=[pb.TokenLogprob(token_id=t, logprob=p, token=tok(t)) for t, p in lp.top],
        )

    # ------------------------------------------------------------------ unary methods
    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        return await self._unary("Tokenize", context, self._tokenize(request))

    async def _tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        self._check_decoded(request)
        kind = validation.input_kind(request)
        if kind == "text":
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else True
            )
            ids = await self._in_thread(self.tokenizer.encode, request.text, add_special)
        else:
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else False
            )
            ids = await self._in_thread(self._encode_chat, request.chat, add_special)
        tokens = [self.tokenizer.id_to_token(i) or "" for i in ids]
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return await self._unary("GetModelInfo", context, self._model_info(request))

    async def _model_info(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:
        self._check_decoded(request)
        m = self.model
        return pb.ModelInfo(
            model=m.name,
            max_context_length=m.max_model_len,
            vocab_size=m.vocab_size,
            kv_block_size=m.block_size,
            kv_num_blocks=m.num_blocks,
            dtype=m.dtype,
            device=m.device,
            eos_token_ids=list(m.eos_token_ids),
            kv_memory_bytes=m.kv_memory_bytes,
            weights=m.weights,
            weight_bytes=m.weight_bytes,
        )

    async def GetKVCacheStats(
        self, request: pb.GetKVCacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVCacheStats:
        return await self._unary("GetKVCacheStats", context, self._kv_stats(request))

    async def _kv_stats(self, request: pb.GetKVCacheStatsRequest) -> pb.KVCacheStats:
        self._check_decoded(request)
        stats = self.client.engine.latest_stats  # a snapshot: never the live scheduler
        kv = stats.kv
        return pb.KVCacheStats(
            total_sequences=kv.total_sequences,
            total_memory_bytes=kv.total_memory_bytes,
            average_sequence_length=kv.average_sequence_length,
            cache_hit_rate=kv.cache_hit_rate,
            cache_efficiency=kv.cache_efficiency,
            block_size=kv.block_size,
            num_blocks_total=kv.num_blocks_total,
            num_blocks_used=kv.num_blocks_used,
            num_blocks_cached_free=kv.num_blocks_cached_free,
            num_blocks_free=kv.num_blocks_free,
            total_tokens=kv.total_tokens,
            used_memory_bytes=kv.used_memory_bytes,
            usage=kv.usage,
            prefix_queries_tokens_total=kv.prefix_queries_tokens_total,
            prefix_hits_tokens_total=kv.prefix_hits_tokens_total,
            evictions_total=kv.evictions_total,
            cow_copies_total=kv.cow_copies_total,
            preemptions_total=stats.num_preemptions_total,  # the scheduler preempts
            num_blocks_reserved=kv.num_blocks_reserved,
            block_bytes=kv.block_bytes,
            kv_strategy=kv.kv_strategy,
            strategy_dropped_tokens_total=kv.strategy_dropped_tokens_total,
            strategy_windowed_tokens_total=kv.strategy_windowed_tokens_total,
            **kv_tier_rpc_fields(kv),
        )

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return await self._unary("Abort", context, self._abort(request, context))

    async def _abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        self._check_decoded(request)
        if not request.request_id:
            raise InvalidRequestError("request_id is required")
        rid = scoped_id(self._owner(context), request.request_id)
        found = self.client.abort(rid, AbortReason.ABORT_CALL)
        return pb.AbortResponse(found=found)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every method but health needs ``authorization: Bearer <key>`` when keys are set;
    without a valid one the call ends with UNAUTHENTICATED before its handler runs."""

    def __init__(self, security: Security, sink: MetricsSink) -> None:
        self.security = security
        self.sink = sink

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        metadata = dict(details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        try:
            self.security.authenticate(authorization)
        except AuthError as exc:
            self.sink.on_rpc(details.method, grpc.StatusCode.UNAUTHENTICATED.name)
            return _deny(handler, str(exc))
        return handler


_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _deny(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - abort raises

    codec = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **codec)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **codec)
    return grpc.unary_unary_rpc_method_handler(deny, **codec)


def generation_handler(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers, with lenient request deserializers."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_lenient(pb.GenerateRequest.FromString),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            servicer.Tokenize,
            request_deserializer=_lenient(pb.TokenizeRequest.FromString),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            servicer.GetModelInfo,
            request_deserializer=_lenient(pb.GetModelInfoRequest.FromString),
            response_serializer=pb.ModelInfo.SerializeToString,
        ),
        "GetKVCacheStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetKVCacheStats,
            request_deserializer=_lenient(pb.GetKVCacheStatsRequest.FromString),
            response_serializer=pb.KVCacheStats.SerializeToString,
        ),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort,
            request_deserializer=_lenient(pb.AbortRequest.FromString),
            response_serializer=pb.AbortResponse.SerializeToString,
        ),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class KVServeServer:
    """A grpc.aio server around one engine: Generation + health + reflection.

    Lifecycle: ``await start(host, port, http_port=...)`` (returns the bound gRPC port; the
    HTTP front's is ``http_port``) -> ``await wait()`` (returns the exit code: 0 after a
    graceful ``shutdown``, 1 when the engine died) and ``await shutdown(grace_s)`` from a
    signal handler or a test. ``security`` sets TLS and API keys for both front ends.
    """

    def __init__(
        self,
        engine: EngineLoop,
        tokenizer: ServerTokenizer,
        model: ServedModel,
        *,
        sink: MetricsSink | None = None,
        executor: Executor | None = None,
        death_grace_s: float = 1.0,
        security: Security | None = None,
    ) -> None:
        self.engine = engine
        self.model = model
        self.security = security if security is not None else Security()
        self.sink: MetricsSink = sink if sink is not None else NullSink()
        self.client = EngineClient(engine)
        self.servicer = GenerationServicer(
            self.client, tokenizer, model, sink=sink, executor=executor, security=self.security
        )
        self.http: Any = None  # server.http.AsgiServer once started
        self.http_port = 0
        self.health = health_aio.HealthServicer()
        self._death_grace_s = death_grace_s
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._exit_code = 0
        self._stopping = False
        self.port = 0

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, http_port: int | None = None
    ) -> int:
        """Bind, start the engine thread and the server; health SERVING. Returns the gRPC
        port. ``http_port`` (0: a free one; None: no HTTP) starts the OpenAI-compatible front
        on the same host and engine."""
        self._loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0)],
            interceptors=[AuthInterceptor(self.security, self.sink)],
        )
        server.add_generic_rpc_handlers((generation_handler(self.servicer),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        tls = self.security.tls
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            cert, key, client_ca = tls.read()
            credentials = grpc.ssl_server_credentials(
                [(key, cert)],
                root_certificates=client_ca,
                require_client_auth=client_ca is not None,
            )
            bound = server.add_secure_port(address, credentials)
        if bound == 0:
            raise OSError(f"could not bind {address}")
        self.port = bound
        self._server = server
        if http_port is not None:
            from server.http import OpenAIFront, start_asgi_server

            front = OpenAIFront(self.servicer, self.security, self.sink)
            self.http = await start_asgi_server(front.app, host, http_port, self.security)
            self.http_port = self.http.port
        self.engine.set_on_death(self._on_engine_death_threadsafe)
        if not self.engine.started:
            self.engine.start()
        await server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return bound

    async def _set_health(self, status: int) -> None:
        await self.health.set("", status)
        await self.health.set(SERVICE_NAME, status)

    def _on_engine_death_threadsafe(self, exc: BaseException) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(lambda: loop.create_task(self._on_engine_death(exc)))

    async def _on_engine_death(self, exc: BaseException) -> None:
        logger.error("runner died, the server stops serving: %r", exc)
        self.servicer.accepting = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._exit_code = 1
        if self._done is not None:
            self._done.set()

    async def wait(self) -> int:
        """Block until shutdown finished or the engine died; the process exit code."""
        assert self._done is not None, "start() first"
        await self._done.wait()
        return self._exit_code

    @property
    def exit_code(self) -> int:
        return self._exit_code

    async def shutdown(self, grace_s: float = 10.0) -> None:
        """Health NOT_SERVING, refuse new calls, drain in-flight up to ``grace_s``, stop."""
        if self._stopping:
            return
        self._stopping = True
        self.servicer.accepting = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        drained = await self.client.wait_idle(grace_s)
        if not drained:
            logger.warning(
                "grace period of %.1fs passed with %d requests in flight; aborting them",
                grace_s,
                self.client.num_in_flight,
            )
            self.abort_all()
            await self.client.wait_idle(self._death_grace_s)
        if self.http is not None:
            await self.http.stop(self._death_grace_s)
        if self._server is not None:
            await self._server.stop(self._death_grace_s)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop)
        if self._done is not None:
            self._done.set()

    def abort_all(self) -> None:
        """Abort every in-flight request (reason SHUTDOWN); their calls end with UNAVAILABLE
        (an HTTP stream with an error event)."""
        for rid in self.client.active_request_ids():
            self.client.abort(rid, AbortReason.SHUTDOWN)

    async def close_after_death(self) -> None:
        """After the engine died: let in-flight calls get UNAVAILABLE, then stop serving."""
        if self.http is not None:
            await self.http.stop(self._death_grace_s)
        if self._server is not None:
            await self._server.stop(self._death_grace_s)
        self.engine.stop(timeout_s=0.5)
