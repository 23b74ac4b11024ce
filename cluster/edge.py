"""The cluster's edge: Ray Serve's HTTP and gRPC proxies held to a single server's rules.

Ray Serve's proxy is one process that serves both protocols, so a flood on one port could
starve the other. Ray calls ``install`` in that process before it starts its servers
(``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, Ray's hook for the HTTP proxy's
middlewares), and ``install`` sets them up as ``kvserve serve`` sets up its own ports:

- **HTTP** (the OpenAI API): uvicorn guarded by ``server.http_guard``: header, body and
  idle timeouts, a connection cap beyond which the connection idle longest is closed (only
  busy ones mean a 503 that says to retry), and out-of-descriptor accepts logged once.
- **gRPC**: the single server's core options: a connection cap (new connections beyond it
  are closed: UNAVAILABLE), idle connections closed, handshakes bounded, a message over
  ``--max-request-bytes`` refused with RESOURCE_EXHAUSTED; bound to ``--host``, not ``[::]``.
  The two caps and a reserve stay under the process's descriptor limit
  (``ConnectionCaps``), so neither protocol's flood takes the other's descriptors.
- **A middleware** on the proxy's HTTP app (``EdgeMiddleware``): the replicas' internal route
  (``/_kvserve_grpc``) answers 404; Ray's own plain-text answers (no application serves a
  path while the cluster starts or stops: 404) become the single server's 503 JSON; a
  stream whose ingress died mid-way ends with the ``service_unavailable`` event and
  ``[DONE]``.

The settings travel to the proxy process in ``EDGE_ENV`` (JSON), set with the hook's
variable in the environment Ray's processes inherit (``ProxyEdge.environ``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.http_guard import EdgeLimits, HttpLimits

# Ray's proxy logs what its own logger says (to its log file): the edge's lines go there.
logger = logging.getLogger("ray.serve")

EDGE_ENV = "KVSERVE_CLUSTER_EDGE"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "cluster.edge.install"
# The replicas' application route: Ray's gRPC proxy needs one, the public port never serves it.
INTERNAL_ROUTE = "/_kvserve_grpc"
# What the guard closed or refused at the proxy, by "protocol:event" (the router's metrics
# in the same process export them).
EVENTS: Counter[str] = Counter()


@dataclass(frozen=True, slots=True)
class ProxyEdge:
    """Where the proxy listens and the limits it keeps (``kvserve serve``'s flags)."""

    host: str = "127.0.0.1"
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    max_request_bytes: int = 4 << 20

    def environ(self) -> dict[str, str]:
        """The variables that make Ray's proxy call ``install`` with these settings."""
        return {CALLBACK_ENV: CALLBACK, EDGE_ENV: json.dumps(dataclasses.asdict(self))}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> ProxyEdge:
        raw = json.loads(environ.get(EDGE_ENV) or "{}")
        limits = raw.pop("limits", None)
        if limits is not None:
            http = HttpLimits(**limits.pop("http"))
            metrics = HttpLimits(**limits.pop("metrics"))
            raw["limits"] = EdgeLimits(http=http, metrics=metrics, **limits)
        return cls(**raw)


def install() -> list[Any]:
    """Ray's HTTP proxy callback: runs in the proxy process before its servers start."""
    from starlette.middleware import Middleware

    from cluster import ray_patches
    from server.asgi import guard_config, listen_fully

    edge = ProxyEdge.from_environ(os.environ)
    limits = edge.limits.resolved()  # the caps from this process's descriptor limit

    def on_http_event(event: str) -> None:
        EVENTS[f"http:{event}"] += 1

    def guard(server: Any) -> Callable[[Any], None]:
        state = guard_config(server.config, limits.http, on_http_event)
        logger.info("kvserve edge: Ray's HTTP proxy guarded, cap %d", state.cap)

        def listening(server: Any) -> None:
            for listener in server.servers:
                for sock in listener.sockets:
                    listen_fully(sock.fileno(), state, "proxy-http")
            # After Ray set the loop's own handler (the gRPC proxy's).
            ray_patches.quiet_cancelled_replica_calls(asyncio.get_running_loop())

        return listening

    ray_patches.guard_http_proxy(guard)
    options = [
        *limits.grpc_options(),
        ("grpc.max_receive_message_length", edge.max_request_bytes),
    ]
    ray_patches.grpc_proxy_server(options, edge.host)
    logger.info(
        "kvserve edge on Ray's proxy: HTTP cap %d, gRPC cap %d, gRPC on %s",
        limits.http.max_connections,
        limits.grpc_max_connections,
        edge.host,
    )
    return [Middleware(EdgeMiddleware)]


# ---------------------------------------------------------------------------- the middleware
_RETRY = "retry: the cluster is starting or shutting down"


class EdgeMiddleware:
    """The proxy's HTTP app, answering as the single server does where Ray would not."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = str(scope.get("path", ""))
        if path == INTERNAL_ROUTE or path.startswith(INTERNAL_ROUTE + "/"):
            await _send_json(send, 404, f"no route {path}; see GET /v1/models", "not_found_error")
            return
        reply = _Reply(send)
        try:
            await self.app(scope, receive, reply.send)
        finally:
            await reply.finish()


class _Reply:
    """One response on its way out: Ray's plain-text refusals replaced, a cut stream ended."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False  # a response start went out
        self.finished = False  # its last body message went out
        self.event_stream = False
        self.ray_status: int | None = None  # a plain-text error of Ray's proxy, held back

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers") or ())
            kind = headers.get(b"content-type", b"").decode("latin-1")
            if message["status"] >= 400 and kind.startswith("text/plain"):
                self.ray_status = int(message["status"])
                return
            self.started = True
            self.event_stream = kind.startswith("text/event-stream")
        elif message["type"] == "http.response.body":
            if self.ray_status is not None:
                return
            self.finished = not message.get("more_body", False)
        await self._send(message)

    async def finish(self) -> None:
        """After the app returned (or raised): answer what it did not."""
        if not self.started:
            # Ray's 404 means no application serves this path now: starting or stopping.
            status = 503 if self.ray_status in (None, 404) else self.ray_status
            kind = "service_unavailable" if status == 503 else "server_error"
            await _send_json(send=self._send, status=status, message=_RETRY, kind=kind)
        elif self.event_stream and not self.finished:
            # The ingress serving this stream died: end it as a single server ends a stream
            # cut by its shutdown, with an event that says to retry.
            event = {
                "error": {
                    "message": "the server streaming this answer went away; retry",
                    "type": "service_unavailable",
                    "param": None,
                    "code": None,
                }
            }
            body = f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
            await self._send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_json(send: Send, status: int, message: str, kind: str) -> None:
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
