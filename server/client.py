"""KVServeClient: a small asyncio client for the ``kvserve.v1.Generation`` API.

    async with KVServeClient("127.0.0.1:50051") as client:
        async for chunk in client.generate("The capital of France is", max_tokens=16):
            print(chunk.text, end="", flush=True)

``generate`` yields ``GenerateResponse`` messages (new ``token_ids``, ``text`` delta; the last
one has ``finished``, ``finish_reason``, ``usage`` and ``timings``). Leaving the loop early
cancels the call, which aborts the request on the server. Errors arrive as
``grpc.aio.AioRpcError`` with the server's status code and message.

Defaults: this client is greedy (``temperature=0``) like ``kvserve generate``; pass a
temperature > 0 to sample, or ``temperature=None`` for the server's default (1.0, which a raw
gRPC request with no temperature gets). Every other unset option takes the server's default.
``connect()`` fails fast with ``NoServerError`` when nothing answers at the address.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc

_SAMPLING_FIELDS = frozenset(pb.SamplingOptions.DESCRIPTOR.fields_by_name)
_STOPPING_FIELDS = frozenset(pb.StoppingOptions.DESCRIPTOR.fields_by_name)

ChatInput = Sequence[Mapping[str, str] | tuple[str, str]]

# Greedy, as `kvserve generate`: one default for the CLI and this client.
DEFAULT_TEMPERATURE = 0.0
# How long connect() waits for a server before it says there is none.
CONNECT_TIMEOUT_S = 3.0


class NoServerError(ConnectionError):
    """Nothing answers as kvserve at ``address`` (refused, unreachable, or another service)."""

    def __init__(self, address: str) -> None:
        super().__init__(f"no kvserve at {address}: start one with `make serve`, or pass --address")
        self.address = address


def chat_messages(
    messages: ChatInput, add_generation_prompt: bool | None = None
) -> pb.ChatMessages:
    """``[{"role": "user", "content": "hi"}]`` or ``[("user", "hi")]`` -> ChatMessages."""
    chat = pb.ChatMessages()
    for msg in messages:
        role, content = (msg["role"], msg["content"]) if isinstance(msg, Mapping) else msg
        chat.messages.add(role=role, content=content)
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    return chat


def build_generate_request(
    prompt: str | Sequence[int] | None = None,
    *,
    chat: ChatInput | None = None,
    request_id: str = "",
    priority: int = 0,
    cache_salt: str = "",
    n: int | None = None,
    temperature: float | None = DEFAULT_TEMPERATURE,
    **options: Any,
) -> pb.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt (or ``chat``) and keyword options.

    ``temperature`` defaults to 0 (greedy, as ``kvserve generate``); None leaves it unset, so
    the server samples at its default 1.0. With n > 1 and temperature 0 every sample is the
    same. Options are the other fields of SamplingOptions (top_k, top_p, min_p, seed,
    logprobs, ...) and StoppingOptions (max_tokens, min_tokens, stop, stop_token_ids,
    ignore_eos); unset ones take the server defaults. One constraint (structured outputs)
    may be given: ``json_schema`` (text), ``json_object=True``, ``regex``, ``choice`` (a list
    of strings) or ``grammar``. ``adapter`` names a LoRA adapter the server loaded
    (``adapter_scale`` scales its update).
    """
    request = pb.GenerateRequest(request_id=request_id, priority=priority, cache_salt=cache_salt)
    if temperature is not None:
        request.sampling.temperature = temperature
    if chat is not None:
        if prompt is not None:
            raise ValueError("give either a prompt or chat messages, not both")
        request.chat.CopyFrom(chat_messages(chat))
    elif isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    else:
        raise ValueError("a prompt (text or token ids) or chat messages are required")
    if n is not None:
        request.n = n
    for key, value in options.items():
        if value is None:
            continue
        if key in _SAMPLING_FIELDS:
            setattr(request.sampling, key, value)
        elif key in ("stop", "stop_token_ids"):
            getattr(request.stopping, key).extend([value] if isinstance(value, str) else value)
        elif key in _STOPPING_FIELDS:
            setattr(request.stopping, key, value)
        elif key == "choice":
            request.choice.choices.extend(value)
        elif key in ("json_schema", "json_object", "regex", "grammar", "adapter", "adapter_scale"):
            setattr(request, key, value)
        else:
            known = sorted(_SAMPLING_FIELDS | _STOPPING_FIELDS)
            raise TypeError(f"unknown option {key!r}; known: {', '.join(known)}")
    return request


class KVServeClient:
    """Async client over one channel. Use ``async with`` or call ``close()``."""

    def __init__(
        self,
        address: str = "127.0.0.1:50051",
        *,
        channel: grpc.aio.Channel | None = None,
        options: Iterable[tuple[str, Any]] | None = None,
        api_key: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        """``api_key`` goes with every call as ``authorization: Bearer KEY``; ``tls_ca`` (PEM)
        connects over TLS, trusting that CA."""
        self.address = address
        self._own_channel = channel is None
        opts = list(options or ())
        if channel is None and tls_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca)
            channel = grpc.aio.secure_channel(address, creds, options=opts)
        self.channel = channel if channel is not None else grpc.aio.insecure_channel(address, opts)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self._metadata = None if api_key is None else (("authorization", f"Bearer {api_key}"),)

    async def __aenter__(self) -> KVServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_channel:
            await self.channel.close()

    async def connect(self, timeout_s: float = CONNECT_TIMEOUT_S) -> pb.ModelInfo:
        """The server's ModelInfo, waiting up to ``timeout_s`` for it to answer.

        Raises ``NoServerError`` when nothing answers in time (no server, a wrong address) or
        the server there is not kvserve (UNIMPLEMENTED); other errors as they come.
        """
        try:
            return await self.stub.GetModelInfo(
                pb.GetModelInfoRequest(),
                timeout=timeout_s,
                wait_for_ready=True,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.UNIMPLEMENTED,
            ):
                raise NoServerError(self.address) from exc
            raise

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until the channel connects (raises ``TimeoutError``)."""
        async with asyncio.timeout(timeout_s):
            await self.channel.channel_ready()

    async def generate(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        chat: ChatInput | None = None,
        timeout_s: float | None = None,
        **options: Any,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Stream a generation; see ``build_generate_request`` for the options."""
        request = build_generate_request(prompt, chat=chat, **options)
        call = self.stub.Generate(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for response in call:
                yield response
        finally:
            call.cancel()  # no-op when the stream already ended; aborts it otherwise

    async def generate_text(
        self, prompt: str | Sequence[int] | None = None, **kwargs: Any
    ) -> tuple[str, pb.GenerateResponse]:
        """The whole text of one generation, and its last message (usage, finish reason)."""
        parts: list[str] = []
        last = pb.GenerateResponse()
        async for response in self.generate(prompt, **kwargs):
            parts.append(response.text)
            last = response
        return "".join(parts), last

    async def tokenize(
        self,
        text: str | None = None,
        *,
        chat: ChatInput | None = None,
        add_special_tokens: bool | None = None,
        timeout_s: float | None = 10.0,
    ) -> pb.TokenizeResponse:
        request = pb.TokenizeRequest()
        if chat is not None:
            request.chat.CopyFrom(chat_messages(chat))
        elif text is not None:
            request.text = text
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        return await self.stub.Tokenize(request, timeout=timeout_s, metadata=self._metadata)

    async def model_info(self, timeout_s: float | None = 10.0) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(
            pb.GetModelInfoRequest(), timeout=timeout_s, metadata=self._metadata
        )

    async def kv_cache_stats(self, timeout_s: float | None = 10.0) -> pb.KVCacheStats:
        return await self.stub.GetKVCacheStats(
            pb.GetKVCacheStatsRequest(), timeout=timeout_s, metadata=self._metadata
        )

    async def health(self, service: str = "", timeout_s: float | None = 10.0) -> str:
        """The grpc.health.v1 status name: "SERVING", "NOT_SERVING", ..."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        response = await stub.Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))

    async def abort(self, request_id: str, timeout_s: float | None = 10.0) -> bool:
        """Abort a request by id; False when the server had no such request in flight."""
        response = await self.stub.Abort(
            pb.AbortRequest(request_id=request_id), timeout=timeout_s, metadata=self._metadata
        )
        return response.found
