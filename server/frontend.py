"""The front-end core both adapters share: what a prompt means, the engine's request, the
stream of its outputs, and which status a failure gets.

Imports run one way: ``server.lifecycle`` -> the fronts (``grpc_service``, ``openai.app``)
-> this module -> ``engine_client``. Errors map to status codes in one place, ``status_of``
(the HTTP front turns the gRPC code into its own status)::

    InvalidRequestError / admission ValueError -> INVALID_ARGUMENT
    AuthError (no or a wrong API key)          -> UNAUTHENTICATED
    NotAdminError (a global view, no admin key) -> PERMISSION_DENIED
    AdapterNotFoundError (an unknown adapter)  -> NOT_FOUND
    DuplicateRequestError, AdapterConflictError -> ALREADY_EXISTS
    OverloadError                              -> RESOURCE_EXHAUSTED
    a request finished with ERROR              -> INTERNAL (that request only)
    EngineDeadError / shutting down / cut off  -> UNAVAILABLE
    at the end of the shutdown grace period
    StalledStreamError (client stopped reading) -> ABORTED
    DeadlineExceededError                      -> DEADLINE_EXCEEDED

Request ids belong to their caller (``server.auth``): the engine sees ``<owner>/<id>``, so
``Abort`` and the duplicate-id check only ever see the caller's own requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from model_runner.lora.info import AdapterConflictError, AdapterNotFoundError
from scheduler.errors import OverloadError
from scheduler.request import FinishReason, Request
from server import validation
from server.auth import AuthError, NotAdminError, Security, client_id, scoped_id
from server.engine import EngineDeadError, StalledStreamError
from server.engine_client import DeadlineExceededError, DuplicateRequestError, EngineClient
from server.identity import request_identity
from server.lora import Adapters
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError, Limits

if TYPE_CHECKING:
    from model_runner.constraints import ConstraintCompiler
    from scheduler.request import Constraint


class ServerTokenizer(Protocol):
    """What the server needs from a tokenizer (``model_runner.tokenizer.Tokenizer`` has it)."""

    # The checkpoint's chat template (None: none); the OpenAI front reads its tool format.
    chat_template: str | None
    # The template for requests with tools, where the checkpoint names one ("tool_use").
    tool_use_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


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
    extra = validation.chat_template_kwargs(chat)
    if chat.tools:
        try:
            extra["tools"] = json.loads(chat.tools)
        except ValueError as exc:
            raise InvalidRequestError(f"chat.tools must be a JSON list of tools: {exc}") from exc
    templates = (tokenizer.chat_template or "") + (tokenizer.tool_use_template or "")
    text = tokenizer.apply_chat_template(
        validation.chat_messages(chat, renders_tool_calls="tool_calls" in templates),
        add_generation_prompt=validation.add_generation_prompt(chat),
        **extra,
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


class RpcError(Exception):
    """Ends a call with ``code`` and ``details`` (raised inside handlers, mapped once)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RpcError):
        return exc.code, exc.details
    if isinstance(exc, AuthError):
        return grpc.StatusCode.UNAUTHENTICATED, str(exc)
    if isinstance(exc, NotAdminError):
        return grpc.StatusCode.PERMISSION_DENIED, str(exc)
    if isinstance(exc, DuplicateRequestError | AdapterConflictError):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, AdapterNotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
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


class Frontend:
    """One served model over one ``EngineClient``: both front ends build their engine
    requests and read their outputs here (the HTTP front translates its JSON into a
    ``GenerateRequest`` first)."""

    def __init__(
        self,
        client: EngineClient,
        tokenizer: ServerTokenizer,
        model: ServedModel,
        executor: Executor | None = None,
        security: Security | None = None,
        constraints: ConstraintCompiler | None = None,
        adapters: Adapters | None = None,
    ) -> None:
        """``constraints``: compiles structured-output constraints (None: the runner takes
        none, and a constrained request is refused). ``adapters``: the LoRA adapters a
        request may name (``server.lora``; None: none)."""
        self.client = client
        self.tokenizer = tokenizer
        self.model = model
        self.constraints = constraints
        self.adapters = adapters if adapters is not None else Adapters(base_name=model.name)
        self.limits = model.limits
        self.security = security if security is not None else Security()
        self._executor = executor
        self.accepting = True  # False while draining: new generations get UNAVAILABLE

    async def in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in the executor (tokenizing blocks; the event loop must not)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def token(self, token_id: int) -> str:
        """A token id's text ("" for one the tokenizer does not know)."""
        return self.tokenizer.id_to_token(token_id) or ""

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        if validation.input_kind(request) == "token_ids":
            return list(request.token_ids.ids)
        return await self.in_thread(prompt_token_ids, self.tokenizer, request)

    async def engine_request(
        self, request: pb.GenerateRequest, owner: str, default_max_tokens: int | None = None
    ) -> Request:
        """Validate, tokenize and build the engine's request: one path for both front ends.
        ``default_max_tokens``: for an unset ``max_tokens`` (always capped by the context)."""
        if not self.accepting:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "server is shutting down")
        limits = self.limits
        if default_max_tokens is not None:
            limits = replace(limits, default_max_tokens=default_max_tokens)
        validation.check_request_fields(request, limits)
        # Tenants apart, and an adapter's KV apart from the base model's (server.identity).
        lora, cache_salt = request_identity(request, owner, self.security, self.adapters)
        constraint = validation.constraint_of(request)
        prompt_ids = await self._prompt_ids(request)
        sampling = validation.sampling_params(request, len(prompt_ids), limits)
        if constraint is not None:
            sampling = validation.with_constraint(sampling, constraint)
            await self.in_thread(self.compile_constraint, constraint)
        ttft_slo_s, itl_slo_s = validation.latency_targets(request.slo)
        return Request(
            request_id=scoped_id(owner, request.request_id or uuid.uuid4().hex),
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            eos_token_ids=self.model.eos_token_ids,
            priority=request.priority,
            arrival_time_s=time.monotonic(),
            cache_salt=cache_salt,
            lora=lora,
            tenant=owner,  # the waiting queue's per-tenant bounds
            ttft_slo_s=ttft_slo_s,
            itl_slo_s=itl_slo_s,
        )

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compile (or find in the cache) ``constraint`` before the request is queued; a
        constraint the library refuses is INVALID_ARGUMENT with its reason."""
        from model_runner.constraints import ConstraintError

        if self.constraints is None:
            raise InvalidRequestError(
                f"{constraint.kind}: this server does not run structured outputs (its runner "
                "or tokenizer does not support them)"
            )
        try:
            self.constraints.compile(constraint)
        except ConstraintError as exc:
            raise InvalidRequestError(f"{constraint.kind}: {exc}") from exc

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
                    raise RpcError(
                        grpc.StatusCode.INTERNAL,
                        f"request {client_id(request.request_id)!r} failed: "
                        f"{out.error or 'unknown error'}",
                    )
                yield out
