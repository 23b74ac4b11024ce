"""The gRPC front: the ``kvserve.v1.Generation`` servicer, its auth interceptor and its
method table, over the shared ``server.frontend.Frontend``.

The servicer is thin: it validates and tokenizes through the front-end core and streams what
the engine yields; a failure's status comes from ``frontend.status_of``. Requests are decoded
with a lenient deserializer, so a malformed message (e.g. a string field that is not UTF-8)
is an ``INVALID_ARGUMENT`` instead of gRPC's ``UNKNOWN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from metrics.records import MetricsSink, NullSink
from scheduler.output import TokenLogprobs
from scheduler.request import AbortReason, FinishReason
from server import validation
from server.auth import AuthError, Security, client_id, grpc_peer_host, scoped_id
from server.engine_client import DEADLINE_SLACK_S
from server.frontend import Frontend, RpcError, encode_chat, status_of
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "kvserve.v1.Generation"


def finish_reason_pb(reason: FinishReason | None) -> int:
    """The wire enum of a finish reason (a sample that ended without one failed)."""
    return int(pb.FinishReason.Value(f"FINISH_REASON_{(reason or FinishReason.ERROR).name}"))


def authorization(metadata: Any) -> str | None:
    """The ``authorization`` header of a call's metadata, as text."""
    value = dict(metadata or ()).get("authorization")
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


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


class GenerationServicer:
    """``kvserve.v1.Generation`` over one ``Frontend``."""

    def __init__(
        self,
        frontend: Frontend,
        *,
        sink: MetricsSink | None = None,
        security: Security | None = None,
    ) -> None:
        self.frontend = frontend
        self.security = security if security is not None else Security()
        self.sink: MetricsSink = sink if sink is not None else NullSink()

    # ------------------------------------------------------------------ helpers
    def _check_decoded(self, request: Any) -> None:
        if isinstance(request, _Undecodable):
            raise InvalidRequestError(f"malformed request message: {request.error}")

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        """Who sent this call (the auth interceptor has already checked the key)."""
        return self.security.owner(
            authorization(context.invocation_metadata()), grpc_peer_host(context.peer())
        )

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
            code = _cancel_code(context)
            raise
        except Exception as exc:
            code, details = status_of(exc)
            if code is grpc.StatusCode.INTERNAL and not isinstance(exc, RpcError):
                logger.exception("Generate failed")
            if code is grpc.StatusCode.INVALID_ARGUMENT:
                self.sink.on_rejected("invalid")
            elif code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.sink.on_rejected("overload")
        finally:
            self._record("Generate", code)
        # A call its client (or gRPC's deadline) already ended takes no status: sending one
        # fails in the core, which logs an ERROR with a traceback.
        if code is not grpc.StatusCode.OK and not context.cancelled():
            await context.abort(code, details)

    async def _generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        self._check_decoded(request)
        owner = self._owner(context)
        engine_request = await self.frontend.engine_request(request, owner)
        remaining = context.time_remaining()
        deadline_s = None if remaining is None else time.monotonic() + remaining
        want_logprobs = engine_request.sampling.logprobs is not None
        outputs = self.frontend.stream(engine_request, deadline_s)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield self._response(out, want_logprobs)

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
        if out.prompt_logprobs:
            response.prompt_logprobs.extend(self._logprobs(lp) for lp in out.prompt_logprobs)
        if out.finished:
            response.finish_reason = finish_reason_pb(out.finish_reason)
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
        tok = self.frontend.token
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
            ids = await self.frontend.in_thread(
                self.frontend.tokenizer.encode, request.text, add_special
            )
        else:
            add_special = (
                request.add_special_tokens if request.HasField("add_special_tokens") else False
            )
            ids = await self.frontend.in_thread(
                encode_chat, self.frontend.tokenizer, request.chat, add_special
            )
        return pb.TokenizeResponse(token_ids=ids, tokens=[self.frontend.token(i) for i in ids])

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        return await self._unary("GetModelInfo", context, self._model_info(request))

    async def _model_info(self, request: pb.GetModelInfoRequest) -> pb.ModelInfo:
        self._check_decoded(request)
        m = self.frontend.model
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
            adapters=[
                pb.LoraAdapter(
                    name=a.name,
                    rank=a.rank,
                    alpha=a.alpha,
                    target_modules=a.target_modules,
                    format=a.kind,
                    digest=a.digest,
                )
                for a in self.frontend.adapters.infos()
            ],
        )

    async def GetKVCacheStats(
        self, request: pb.GetKVCacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVCacheStats:
        return await self._unary("GetKVCacheStats", context, self._kv_stats(request, context))

    async def _kv_stats(
        self, request: pb.GetKVCacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> pb.KVCacheStats:
        """Every tenant's figures: with API keys on, an admin key only."""
        self._check_decoded(request)
        self.security.authenticate_admin(authorization(context.invocation_metadata()))
        stats = self.frontend.client.engine.latest_stats  # a snapshot: never the live scheduler
        # preemptions_total: the scheduler preempts, so it is not a cache manager field
        return pb.KVCacheStats(**asdict(stats.kv), preemptions_total=stats.num_preemptions_total)

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
        found = self.frontend.client.abort(rid, AbortReason.ABORT_CALL)
        return pb.AbortResponse(found=found)


def _cancel_code(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """Why a call was cancelled, as its client saw it: at its deadline (within the engine
    client's ``DEADLINE_SLACK_S``: the client's clock runs ahead) or by the client."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


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
        try:
            self.security.authenticate(authorization(details.invocation_metadata))
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


# Each method: (request message, response message); every one is unary but Generate.
_METHODS: Mapping[str, tuple[Any, Any]] = {
    "Generate": (pb.GenerateRequest, pb.GenerateResponse),
    "Tokenize": (pb.TokenizeRequest, pb.TokenizeResponse),
    "GetModelInfo": (pb.GetModelInfoRequest, pb.ModelInfo),
    "GetKVCacheStats": (pb.GetKVCacheStatsRequest, pb.KVCacheStats),
    "Abort": (pb.AbortRequest, pb.AbortResponse),
}


def generation_handler(servicer: Any) -> grpc.GenericRpcHandler:
    """The service's method handlers over ``servicer``, with lenient request deserializers."""
    handlers = {
        name: (
            grpc.unary_stream_rpc_method_handler
            if name == "Generate"
            else grpc.unary_unary_rpc_method_handler
        )(
            getattr(servicer, name),
            request_deserializer=_lenient(request_type.FromString),
            response_serializer=response_type.SerializeToString,
        )
        for name, (request_type, response_type) in _METHODS.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
