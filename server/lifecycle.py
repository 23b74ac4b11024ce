"""The server's lifecycle: one engine behind the gRPC and OpenAI fronts, health, reflection,
graceful shutdown and engine death.

Imports run one way: this module -> the fronts (``grpc_service``, ``openai.app``, served by
``asgi``) -> ``frontend`` -> ``engine_client``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from metrics.records import MetricsSink, NullSink
from scheduler.request import AbortReason
from server.asgi import AsgiServer, start_asgi_server
from server.auth import Security
from server.engine import EngineLoop
from server.engine_client import EngineClient
from server.front import assemble_front
from server.frontend import Frontend, ServedModel, ServerTokenizer
from server.grpc_service import (
    SERVICE_NAME,
    AuthInterceptor,
    generation_handler,
)
from server.http_guard import EdgeLimits
from server.openai.app import OpenAIFront
from server.validation import DEFAULT_MAX_REQUEST_BYTES

if TYPE_CHECKING:
    from model_runner.base import AdapterSource

logger = logging.getLogger(__name__)


class KVServeServer:
    """A grpc.aio server around one engine: Generation + health + reflection.

    Lifecycle: ``await start(host, port, http_port=...)`` (returns the bound gRPC port; the
    HTTP front's is ``http_port``) -> ``await wait()`` (returns the exit code: 0 after a
    graceful ``shutdown``, 1 when the engine died) and ``await shutdown(grace_s)`` from a
    signal handler or a test. ``security`` sets TLS and API keys for both front ends;
    ``max_request_bytes`` bounds a request on both (a gRPC message, an HTTP body: 413);
    ``adapters``: the runner's LoRA adapters (``BuiltEngine.adapters``), served on both;
    ``reasoning_parser``: the HTTP front's (auto / none / think, ``server.openai.reasoning``).
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
        limits: EdgeLimits | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        adapters: AdapterSource | None = None,
        reasoning_parser: str = "auto",
    ) -> None:
        self.engine = engine
        self.reasoning_parser = reasoning_parser
        self.limits = (limits if limits is not None else EdgeLimits()).resolved()
        self.max_request_bytes = max_request_bytes
        self.model = model
        self.security = security if security is not None else Security()
        self.sink: MetricsSink = sink if sink is not None else NullSink()
        front = assemble_front(
            EngineClient(engine, adapters), tokenizer, model, self.security, sink=sink,
            executor=executor,
        )  # fmt: skip
        self.client, self.frontend, self.servicer = front.client, front.frontend, front.servicer
        self.http: AsgiServer | None = None
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
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", self.max_request_bytes),
                *self.limits.grpc_options(),
            ],
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
            front = OpenAIFront(
                self.frontend, self.security, self.sink, max_request_bytes=self.max_request_bytes,
                reasoning_parser=self.reasoning_parser,
            )  # fmt: skip
            self.http = await start_asgi_server(
                front.app, host, http_port, self.security, limits=self.limits.http,
                on_event=self.sink_connection_event("http"),
            )  # fmt: skip
            self.http_port = self.http.port
        self.engine.set_on_death(self._on_engine_death_threadsafe)
        if not self.engine.started:
            self.engine.start()
        await server.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return bound

    def sink_connection_event(self, server: str) -> Callable[[str], None]:
        """Counts what ``server.http_guard`` closed or refused on the port ``server``."""
        return lambda event: self.sink.on_connection_event(server, event)

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
        self.frontend.accepting = False
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
        self.frontend.accepting = False
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await drain(self.frontend, self.client, grace_s, self._death_grace_s)
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
        abort_all(self.client)

    async def close_after_death(self) -> None:
        """After the engine died: let in-flight calls get UNAVAILABLE, then stop serving."""
        if self.http is not None:
            await self.http.stop(self._death_grace_s)
        if self._server is not None:
            await self._server.stop(self._death_grace_s)
        self.engine.stop(timeout_s=0.5)


async def drain(
    frontend: Frontend, client: EngineClient, grace_s: float, abort_grace_s: float
) -> bool:
    """A graceful stop's drain (``kvserve serve``'s, and each cluster replica's): new
    generations refused (UNAVAILABLE, HTTP 503), in-flight requests given ``grace_s``, then
    the rest aborted (``abort_all``) and ``abort_grace_s`` for their last outputs. True when
    every request finished in time."""
    frontend.accepting = False
    if await client.wait_idle(grace_s):
        return True
    logger.warning(
        "grace period of %.1fs passed with %d requests in flight; aborting them",
        grace_s,
        client.num_in_flight,
    )
    abort_all(client)
    await client.wait_idle(abort_grace_s)
    return False


def abort_all(client: EngineClient) -> None:
    """Abort every in-flight request (reason SHUTDOWN); their calls end with UNAVAILABLE (an
    HTTP stream with the service_unavailable event)."""
    for rid in client.active_request_ids():
        client.abort(rid, AbortReason.SHUTDOWN)
