"""ASGI serving: uvicorn as a task of the server's event loop (or, for a caller without a
loop of ours, of a thread's own loop), and the /metrics app.

The one /metrics server: ``kvserve serve`` serves it in its loop, each cluster replica and
the cluster router on a thread (``start_asgi_server_thread``); TLS and the API key gate
when asked. The OpenAI front is served here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.auth import AuthError, NotAdminError, OwnerGate, Security
from server.http_guard import (
    ACCEPT_BATCH,
    LISTEN_BACKLOG,
    ConnectionCaps,
    GuardState,
    HttpLimits,
    descriptor_handler,
    guarded_protocol,
)


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
    limits: HttpLimits | None = None,
    on_event: Callable[[str], None] | None = None,
    name: str = "http",
) -> AsgiServer:
    """Bind ``host:port`` (0: a free port) and serve ``app`` from this event loop, with TLS
    when ``security.tls`` is set, under ``limits`` (``server.http_guard``: timeouts and a
    connection cap, 0 = ``ConnectionCaps.http``); ``on_event`` counts what the guard
    closed or refused."""
    limits = limits if limits is not None else HttpLimits()
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"could not bind {name} to {host}:{port}: {exc}") from exc
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    tls = security.tls if security is not None else None
    kwargs: dict[str, Any] = {}
    if tls is not None:
        import ssl

        kwargs = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
        if tls.client_ca is not None:
            kwargs.update(ssl_ca_certs=tls.client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", access_log=False,
        timeout_graceful_shutdown=1, **kwargs,
    )  # fmt: skip
    guard = guard_config(config, limits, on_event if on_event is not None else _ignore)
    loop = asyncio.get_running_loop()
    server = _Server(config)
    task = loop.create_task(server.serve(sockets=[sock]), name=name)
    while not server.started:
        if task.done():
            sock.close()
            task.result()  # raises what stopped it
            raise OSError(f"{name} server stopped during start-up")
        await asyncio.sleep(0.01)
    listen_fully(sock.fileno(), guard, name)
    return AsgiServer(server, task, int(sock.getsockname()[1]))


def guard_config(
    config: uvicorn.Config, limits: HttpLimits, on_event: Callable[[str], None]
) -> GuardState:
    """``config`` (of a server not started yet) held to ``limits``: the keep-alive timeout,
    connections accepted ``ACCEPT_BATCH`` at a time, and uvicorn's protocol guarded by
    ``server.http_guard`` (timeouts, the connection cap: 0 = ``ConnectionCaps.http``)."""
    config.timeout_keep_alive = limits.idle_timeout_s  # type: ignore[assignment]  # a float works
    config.backlog = ACCEPT_BATCH  # accepted per wake-up; the kernel's queue: listen_fully
    if not config.loaded:
        config.load()
    cap = limits.max_connections or ConnectionCaps.of_process().http
    guard = GuardState(limits, cap, on_event)
    config.http_protocol_class = guarded_protocol(config.http_protocol_class, guard)
    config.kvserve_guard = guard  # type: ignore[attr-defined]
    return guard


def is_guarded(config: uvicorn.Config) -> bool:
    """Whether ``guard_config`` configured ``config``."""
    return getattr(config, "kvserve_guard", None) is not None


def listen_fully(fd: int, guard: GuardState, name: str) -> None:
    """Once a guarded server listens on ``fd``: the kernel's queue ``LISTEN_BACKLOG`` long
    (asyncio set it to the accept batch), and running out of descriptors on ``accept``
    handled by ``server.http_guard.OutOfDescriptors``."""
    with socket.socket(fileno=os.dup(fd)) as listener:
        listener.listen(LISTEN_BACKLOG)
    descriptor_handler(asyncio.get_running_loop()).watch(fd, name, guard)


def _ignore(event: str) -> None:
    pass


@dataclass(slots=True)
class ThreadedAsgiServer:
    """An ``AsgiServer`` on an event loop of its own daemon thread."""

    server: AsgiServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.server.port

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.loop.is_running():
            done = asyncio.run_coroutine_threadsafe(self.server.stop(timeout_s), self.loop)
            with contextlib.suppress(Exception):
                done.result(timeout_s + 1.0)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout_s)


def start_asgi_server_thread(
    app: ASGIApp,
    host: str,
    port: int,
    security: Security | None = None,
    *,
    limits: HttpLimits | None = None,
    name: str = "http",
) -> ThreadedAsgiServer:
    """``start_asgi_server`` on a new thread's event loop, for a caller that runs no loop of
    ours (a Ray actor). Raises what binding raised (``OSError``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name=name, daemon=True)
    thread.start()
    starting = asyncio.run_coroutine_threadsafe(
        start_asgi_server(app, host, port, security, limits=limits, name=name),
        loop,
    )
    try:
        server = starting.result(timeout=60)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        raise
    return ThreadedAsgiServer(server, loop, thread)


def metrics_limits() -> HttpLimits:
    """A metrics port's limits: scrapes are short and few, so its cap is small
    (``ConnectionCaps.metrics``); idle connections beyond it are closed, never served 503."""
    return HttpLimits(max_connections=ConnectionCaps.of_process().metrics)


class AdminGate:
    """ASGI middleware: the global figures need an admin key (``Security.authenticate_admin``):
    401 without a valid key, 403 with a tenant's key."""

    def __init__(self, app: ASGIApp, security: Security | OwnerGate) -> None:
        self.app, self.security = app, security

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers") or ())
            authorization = headers.get(b"authorization", b"").decode("latin-1") or None
            try:
                self.security.authenticate_admin(authorization)
            except (AuthError, NotAdminError) as exc:
                # Imported here: the metrics server (a cluster replica's) stays light.
                from server.openai.fields import error_body, http_error

                err = http_error(exc)  # 401 authentication_error / 403 permission_error
                await JSONResponse(error_body(err.message, err.kind), err.status)(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def metrics_app(registry: Any, security: Security | OwnerGate | None = None) -> ASGIApp:
    """prometheus-client's ASGI app for ``registry``; with API keys (and
    ``metrics_require_key``) it needs an admin key: its figures are every tenant's."""
    from prometheus_client import make_asgi_app

    app: ASGIApp = make_asgi_app(registry)
    return admin_gate(app, security)


def admin_gate(app: ASGIApp, security: Security | OwnerGate | None) -> ASGIApp:
    """``app`` behind ``AdminGate`` when keys are on and /metrics needs one."""
    if security is not None and security.auth_enabled and security.metrics_require_key:
        return AdminGate(app, security)
    return app
