"""One drain for the whole cluster, as a single server drains on SIGTERM.

``kvserve cluster serve`` starts a ``DrainSignal`` (a named Ray actor) before its
applications. On SIGTERM it starts the drain there, and every replica and OpenAI ingress,
each watching the signal from start-up (``watch_drain``), drains at once, together::

    t = 0        new generations refused: gRPC UNAVAILABLE, HTTP the 503 JSON of a single
                 server ("server is shutting down"); in-flight requests run on
    t <= grace   a replica whose requests all ended is idle; at grace it aborts the rest
                 (reason shutdown): their gRPC calls end with UNAVAILABLE and their HTTP
                 streams with the service_unavailable event and [DONE]
    all idle     the CLI deletes both applications (nothing left in flight) and exits

so the whole cluster exits about one grace period after the signal. Without a
``DrainSignal`` (a cluster started from ``cluster/kvserve.yaml``) replicas drain the way
Ray Serve stops them (``graceful_shutdown_timeout_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

NAMESPACE = "kvserve"


def signal_name(app_name: str) -> str:
    return f"drain:{app_name}"


class DrainSignal:
    """The drain's state, in a Ray actor of its own (``start_drain_signal``)."""

    def __init__(self) -> None:
        self._started = asyncio.Event()
        self._grace_s = 0.0
        self._idle: set[str] = set()

    async def wait_started(self) -> float:
        """Returns the grace period once the drain starts."""
        await self._started.wait()
        return self._grace_s

    async def start(self, grace_s: float) -> None:
        if not self._started.is_set():
            self._grace_s = grace_s
            self._started.set()

    async def report_idle(self, who: str) -> None:
        self._idle.add(who)

    async def num_idle(self) -> int:
        return len(self._idle)


def start_drain_signal(app_name: str) -> Any:
    """The application's ``DrainSignal`` actor, owned by this (driver) process."""
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=10_000)(DrainSignal)
    return actor.options(name=signal_name(app_name), namespace=NAMESPACE).remote()


def watch_drain(
    app_name: str, who: str, drain: Callable[[float], Awaitable[None]]
) -> asyncio.Task[None] | None:
    """In a replica or an ingress (its event loop running): ``drain(grace_s)`` when the
    application's drain starts, then report idle. None when the application has no
    ``DrainSignal``."""
    import ray

    try:
        signal = ray.get_actor(signal_name(app_name), namespace=NAMESPACE)
    except ValueError:
        return None

    async def watch() -> None:
        grace_s = await signal.wait_started.remote()
        logger.info("%s: draining (grace %.1fs)", who, grace_s)
        await drain(grace_s)
        with contextlib.suppress(Exception):
            await signal.report_idle.remote(who)

    return asyncio.get_running_loop().create_task(watch(), name=f"kvserve-drain-{who}")
