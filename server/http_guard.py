"""Hostile HTTP clients: timeouts, a connection cap and descriptor exhaustion, for every port
uvicorn serves (the OpenAI front and /metrics).

uvicorn closes a keep-alive connection idle after a response (``timeout_keep_alive``) but
holds a connection that never sends a request, or sends its headers or body a byte at a
time, for as long as the client likes; and its ``limit_concurrency`` counts idle connections,
so a few idle ones turn every request into a 503. ``guarded_protocol`` wraps uvicorn's
protocol class with::

    connection made ----- header_timeout_s ----> request headers complete
      (or a keep-alive       closed if passed        ----- body_timeout_s ----> body complete
       connection's next                                    closed if passed: the app reads
       request begins)                                      a disconnect (counted a cancel)
    response complete ---- idle_timeout_s ----> closed (uvicorn's keep-alive timer)

    a new connection at max_connections: the connection idle longest (between requests, or
    still sending its headers) is closed to make room; with none idle the new one gets 503.

Running out of descriptors (``accept`` fails with EMFILE): asyncio already backs off for 1 s;
``OutOfDescriptors`` replaces its traceback per failure with one warning per
``log_interval_s``, counts each failure and closes the server's idle connections to give the
next ``accept`` a descriptor.

Every event is counted through ``MetricsSink.on_connection_event(server, event)``, one of
``metrics.catalog.CONNECTION_EVENTS``.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

logger = logging.getLogger(__name__)

# Descriptors kept for everything that is not an HTTP connection (files, gRPC, the loop).
RESERVED_DESCRIPTORS = 128
# asyncio accepts up to its server's ``backlog`` connections per wake-up, before any of them
# reaches ``connection_made`` (where the cap closes an idle one): with uvicorn's 2,048, a
# queued flood is accepted at once and passes any cap. So the event loop accepts this many at
# a time, while the kernel's queue stays LISTEN_BACKLOG long (a new client is queued, never
# dropped to a 1 s SYN retry).
ACCEPT_BATCH = 32
LISTEN_BACKLOG = 2048


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Timeouts and the connection cap of one HTTP port; ``max_connections`` 0: derived from
    the descriptor limit (``ConnectionCaps``)."""

    max_connections: int = 0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_connections < 0:
            raise ValueError(f"max_connections must be >= 0, got {self.max_connections}")
        for name in ("header_timeout_s", "body_timeout_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class ConnectionCaps:
    """How many connections each port may hold, from the process's descriptor limit: the
    three caps and ``RESERVED_DESCRIPTORS`` together stay under it, so a flood on one port
    never takes the descriptors another port (or a file) needs."""

    http: int
    grpc: int
    metrics: int

    @classmethod
    def for_limit(cls, max_descriptors: int) -> ConnectionCaps:
        budget = max(64, max_descriptors - RESERVED_DESCRIPTORS)
        return cls(http=budget // 2, grpc=budget // 4, metrics=max(8, min(64, budget // 16)))

    @classmethod
    def of_process(cls) -> ConnectionCaps:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls.for_limit(2**20 if soft == resource.RLIM_INFINITY else soft)


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The limits of the server's three ports: the OpenAI front, /metrics and gRPC (whose
    core has its own settings: ``grpc_options``)."""

    http: HttpLimits = HttpLimits()
    metrics: HttpLimits = HttpLimits()
    grpc_max_connections: int = 0  # 0: ConnectionCaps.grpc
    grpc_idle_timeout_s: float = 300.0  # a connection with no call open this long: GOAWAY
    grpc_handshake_timeout_s: float = 10.0  # a TCP connection that never speaks HTTP/2

    def resolved(self) -> EdgeLimits:
        """With every 0 cap replaced by the process's ``ConnectionCaps``."""
        caps = ConnectionCaps.of_process()
        return replace(
            self,
            http=replace(self.http, max_connections=self.http.max_connections or caps.http),
            metrics=replace(
                self.metrics, max_connections=self.metrics.max_connections or caps.metrics
            ),
            grpc_max_connections=self.grpc_max_connections or caps.grpc,
        )

    def grpc_options(self) -> list[tuple[str, int]]:
        """grpc.aio server options: the connection cap (over it, new connections are closed
        at once), idle connections closed, handshakes bounded."""
        resolved = self.resolved()
        return [
            ("grpc.max_allowed_incoming_connections", resolved.grpc_max_connections),
            ("grpc.max_connection_idle_ms", int(self.grpc_idle_timeout_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(self.grpc_handshake_timeout_s * 1000)),
        ]


EventCallback = Callable[[str], None]


class GuardState:
    """Shared by the connections of one server: the cap and where events go."""

    def __init__(self, limits: HttpLimits, cap: int, on_event: EventCallback) -> None:
        self.limits = limits
        self.cap = cap
        self.on_event = on_event
        self.open: set[Any] = set()  # guarded protocols with a live transport
        # The idle ones among them, idle longest first: at the cap a new connection takes the
        # first one's place in O(1) (a scan of every open connection per arrival made a flood
        # of 20,000 quadratic).
        self.idle: OrderedDict[Any, None] = OrderedDict()

    def note(self, protocol: Any, idle: bool) -> None:
        """``protocol`` is idle now (between requests, or its headers arriving: the most
        recently active idle one) or busy (``idle`` False)."""
        if idle:
            self.idle[protocol] = None
            self.idle.move_to_end(protocol)
        else:
            self.idle.pop(protocol, None)

    def shed_idle(self, count: int, event: str) -> int:
        """Close up to ``count`` connections idle longest; returns how many."""
        num_closed = 0
        while num_closed < count and self.idle:
            protocol, _ = self.idle.popitem(last=False)
            if not protocol.guard_closing:
                protocol.guard_close(event)
                num_closed += 1
        return num_closed


_LINGER_S = 1.0  # a refused connection's half-close lasts this long at most
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


def _refusal_bytes(cap: int) -> bytes:
    body = (
        b'{"error":{"message":"too many open connections (%d, all busy): retry later",'
        b'"type":"server_error","param":null,"code":null}}' % cap
    )
    return _REFUSAL % (len(body), body)


def guarded_protocol(base: type[asyncio.Protocol], state: GuardState) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's protocol class ``base`` (h11 or httptools: both keep the
    request in flight in ``self.cycle``) with the timeouts and the cap of ``state``."""

    class Guarded(base):  # type: ignore[valid-type, misc]
        guard_closing = False
        guard_refused = False
        _guard_timer: asyncio.TimerHandle | None = None
        _guard_event = ""  # what the armed timer closes the connection for
        _guard_cycle: Any = None

        def connection_made(self, transport: Any) -> None:
            if len(state.open) >= state.cap and not state.shed_idle(1, "evicted_idle"):
                self.guard_refused = True
                state.on_event("refused")
                transport.write(_refusal_bytes(state.cap))
                # Half-close and read what the client still sends: closing now would answer
                # its request with a reset, which can destroy the 503 before it is read.
                if transport.can_write_eof():
                    transport.write_eof()
                    asyncio.get_running_loop().call_later(_LINGER_S, transport.close)
                else:
                    transport.close()
                return
            state.open.add(self)
            super().connection_made(transport)
            state.note(self, idle=True)
            self._guard_arm(state.limits.header_timeout_s, "header_timeout")

        def connection_lost(self, exc: Exception | None) -> None:
            if self.guard_refused:
                return
            state.open.discard(self)
            state.note(self, idle=False)
            self._guard_disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.guard_refused:
                return  # read and dropped until the linger ends
            if self._guard_timer is None and self.guard_is_idle():
                # A keep-alive connection's next request begins: its headers are on the clock.
                self._guard_arm(state.limits.header_timeout_s, "header_timeout")
            super().data_received(data)
            cycle = self.cycle
            if cycle is not None and cycle is not self._guard_cycle:
                self._guard_cycle = cycle  # headers complete: now the body is on the clock
                self._guard_disarm()
                if cycle.more_body:
                    self._guard_arm(state.limits.body_timeout_s, "body_timeout")
            elif self._guard_event == "body_timeout" and not cycle.more_body:
                self._guard_disarm()  # the body is complete
            state.note(self, idle=self.guard_is_idle() and not self.guard_closing)

        def eof_received(self) -> bool | None:
            if self.guard_refused:
                return None  # the transport closes
            return super().eof_received()  # type: ignore[no-any-return]

        def on_response_complete(self) -> None:
            self._guard_disarm()
            super().on_response_complete()
            state.note(self, idle=self.guard_is_idle() and not self.guard_closing)

        # -- helpers (prefixed: the base class owns the plain names)
        def guard_is_idle(self) -> bool:
            """Between requests, or a request whose headers are still arriving."""
            cycle = self.cycle
            return cycle is None or cycle.response_complete

        def guard_close(self, event: str) -> None:
            self.guard_closing = True
            state.on_event(event)
            if not self.transport.is_closing():
                self.transport.close()

        def _guard_arm(self, delay_s: float, event: str) -> None:
            self._guard_disarm()
            self._guard_timer = self.loop.call_later(delay_s, self._guard_expired, event)
            self._guard_event = event

        def _guard_disarm(self) -> None:
            if self._guard_timer is not None:
                self._guard_timer.cancel()
                self._guard_timer, self._guard_event = None, ""

        def _guard_expired(self, event: str) -> None:
            self._guard_timer, self._guard_event = None, ""
            cycle = self.cycle
            if event == "body_timeout" and (cycle is None or not cycle.more_body):
                return
            if event == "header_timeout" and not self.guard_is_idle():
                return
            self.guard_close(event)

    Guarded.__name__ = f"Guarded{base.__name__}"
    return Guarded


class OutOfDescriptors:
    """An event-loop exception handler: EMFILE / ENFILE on ``accept`` is counted, logged once
    per ``log_interval_s`` and answered by closing idle connections; anything else goes to
    the handler that was there before."""

    _MESSAGE = "socket.accept() out of system resource"

    def __init__(self, log_interval_s: float = 10.0) -> None:
        self.log_interval_s = log_interval_s
        self.num_failures = 0
        self._num_unlogged = 0
        self._last_log_s = -float("inf")
        self._servers: dict[int, tuple[str, GuardState]] = {}  # listening fd -> server
        self._previous: Any = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._previous = loop.get_exception_handler()
        loop.set_exception_handler(self)

    def watch(self, fd: int, name: str, state: GuardState) -> None:
        self._servers[fd] = (name, state)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if context.get("message") != self._MESSAGE or not (
            isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)
        ):
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        sock = context.get("socket")
        name, state = self._servers.get(sock.fileno() if sock is not None else -1, ("?", None))
        self.num_failures += 1
        self._num_unlogged += 1
        freed = 0
        if state is not None:
            state.on_event("emfile")
            freed = state.shed_idle(max(1, len(state.open) // 8), "evicted_idle")
        now = time.monotonic()
        if now - self._last_log_s >= self.log_interval_s:
            logger.warning(
                "out of file descriptors (%s): %d accept() failure(s) since the last report; "
                "%s retries in 1 s, %d idle connection(s) closed; raise `ulimit -n` or lower "
                "the connection caps (--http-max-connections)",
                exc.strerror,
                self._num_unlogged,
                name,
                freed,
            )
            self._num_unlogged = 0
            self._last_log_s = now


def descriptor_handler(loop: asyncio.AbstractEventLoop) -> OutOfDescriptors:
    """The loop's ``OutOfDescriptors`` handler, installed on first use (one per loop)."""
    handler = loop.get_exception_handler()
    if isinstance(handler, OutOfDescriptors):
        return handler
    handler = OutOfDescriptors()
    handler.install(loop)
    return handler
