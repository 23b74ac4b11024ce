"""The OpenAI-compatible API of a cluster: the single server's OpenAI front in a Ray Serve
ingress deployment, reaching the replicas through the same request router as gRPC.

    client --HTTP--> Ray Serve HTTP proxy --> OpenAIIngress (an application of its own, "/")
                       OpenAIFront + Frontend: keys, tenants, validation, tokenizing,
                       structured outputs, tools, SSE, the OpenAPI document
                         | RemoteEngineClient: the engine request (scheduler.Request)
                         v DeploymentHandle, KVServeRequestRouter (cluster.ray_router)
                       KVServeReplica.generate_request --> the replica's engine

Everything a single server's HTTP front does happens here, unchanged: ``OpenAIFront`` over a
``Frontend`` whose engine client is remote. A replica runs the engine request and streams
its ``GenerationOutput`` back; closing the stream (the HTTP client hung up) cancels the call,
which aborts the request on its replica. A per-key flood is refused by each replica's waiting
queue, as on one server (``max_waiting_requests_per_tenant`` per replica).

A replica that dies mid-stream ends its streams with an SSE error event (HTTP 503's
``service_unavailable``) saying to retry; new requests go to the live replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc

from cluster.drain import watch_drain
from scheduler.request import Request
from server.config import build_config
from server.engine import EngineDeadError
from server.frontend import RpcError
from server.outputs import GenerationOutput

GENERATE_METHOD = "generate_request"
REPLICA_DEPLOYMENT = "KVServeReplica"
# Statuses set on purpose (a refusal, a drain): answered quietly, as a single server answers
# them; anything else is a failure, logged with its traceback.
EXPECTED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A replica's answer that ends a request with a status (gRPC code name), sent as a value:
    Ray logs every exception a replica raises, with its traceback."""

    code: str
    details: str

    def error(self) -> RpcError:
        return RpcError(grpc.StatusCode[self.code], self.details)


class ReplicaDiedError(EngineDeadError):
    """The replica running a request died (its engine went with it): retry, it may work now."""


def replica_died(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray's word that the replica running a call died (the one test, for
    the ingress here and the gRPC proxy in ``cluster.ray_patches``)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return isinstance(exc, ActorDiedError | ActorUnavailableError) or type(exc) is RayActorError


def unwrap_ray_error(exc: BaseException) -> BaseException:
    """What a replica raised (``OverloadError``, ``ValueError``...), out of Ray's wrapper; a
    replica that died is a ``ReplicaDiedError``."""
    from ray.exceptions import RayTaskError

    if replica_died(exc):
        return ReplicaDiedError(
            f"the replica serving this request died; retry: {type(exc).__name__}"
        )
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return cause
    return exc


def tokenizer_for(engine: dict[str, Any]) -> Any:
    """The tokenizer a replica with these engine settings uses (no weights are loaded)."""
    if engine.get("runner") == "fake":
        from server.fake_tokenizer import ByteTokenizer

        return ByteTokenizer()
    from model_runner.loader import load_tokenizer

    return load_tokenizer(engine.get("model"))


class RemoteEngineClient:
    """``EngineClient``'s face (what ``Frontend`` calls) over the replicas' handle.

    ``generate`` sends the engine request to a replica chosen by the deployment's request
    router and yields its outputs; leaving early cancels the call there (an abort). A
    replica's ``Refusal`` is raised here as the status it names.
    """

    def __init__(self, replicas: Any) -> None:
        self._handle = replicas.options(stream=True, method_name=GENERATE_METHOD)
        self._active: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    def active_request_ids(self) -> list[str]:
        return list(self._active)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every call ended within ``timeout_s``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def generate(
        self, request: Request, *, deadline_s: float | None = None
    ) -> AsyncIterator[GenerationOutput]:
        # A deadline is a monotonic time of this host: sent as the seconds left.
        timeout_s = None if deadline_s is None else deadline_s - time.monotonic()
        self._active.add(request.request_id)
        self._idle.clear()
        responses = self._handle.remote(request, timeout_s)
        finished = False
        try:
            async for out in responses:
                if isinstance(out, Refusal):
                    finished = True
                    raise out.error()
                yield out
            finished = True
        except RpcError:
            raise
        except Exception as exc:
            finished = True  # the call is over: nothing to cancel
            raise unwrap_ray_error(exc) from exc
        finally:
            self._active.discard(request.request_id)
            if not self._active:
                self._idle.set()
            if not finished:
                with contextlib.suppress(Exception):
                    responses.cancel()


class OpenAIIngress:
    """The Ray Serve ingress deployment class (``cluster.app.build_openai_app`` wraps it with
    ``serve.deployment`` and ``serve.ingress``): the single server's ``OpenAIFront``.

    ``engine`` holds the replicas' ``ServerConfig`` settings: the same API keys, limits and
    model as a single server started with them.
    """

    async def __init__(
        self, engine: dict[str, Any] | None = None, replicas_app: str = "kvserve"
    ) -> None:
        from ray import serve

        from server.build import constraint_tracker
        from server.frontend import Frontend
        from server.lora import Adapters
        from server.openai.app import OpenAIFront

        cfg = build_config(engine or {}, environ={})
        replicas = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=replicas_app)
        model = await replicas.options(method_name="served_model").remote()
        infos = await replicas.options(method_name="served_adapters").remote()
        tokenizer = tokenizer_for({"runner": cfg.runner, "model": cfg.model})
        tracker = constraint_tracker(tokenizer, model.vocab_size)
        security = cfg.security()
        self.client = RemoteEngineClient(replicas)
        self.frontend = Frontend(
            self.client,  # type: ignore[arg-type]  # EngineClient's face, remote
            tokenizer,
            model,
            security=security,
            constraints=tracker.compiler if tracker is not None else None,
            # The adapters the replicas load (--lora): the ingress resolves a model name to
            # one, and the replica that runs the request pins it.
            adapters=Adapters(infos=infos, base_name=model.name),
        )
        self.front = OpenAIFront(self.frontend, security, max_request_bytes=cfg.max_request_bytes)
        context = serve.get_replica_context()
        self._drain = watch_drain(
            replicas_app, f"ingress {context.replica_id.unique_id}", self.drain
        )

    async def drain(self, grace_s: float) -> None:
        """The cluster's drain (``cluster.drain``): new calls get the 503 of a single server's
        drain; streams run on until their replicas end them (at ``grace_s`` at the latest,
        with the service_unavailable event)."""
        self.frontend.accepting = False
        await self.client.wait_idle(grace_s + 5.0)

    def __serve_build_asgi_app__(self) -> Any:
        return self.front.app
