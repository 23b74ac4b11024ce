"""EngineClient: the asyncio face of an ``EngineLoop``, one ``asyncio.Queue`` per request.

``generate`` submits a request to the engine thread's inbox and yields what the output
processor publishes for it; leaving early aborts the request there. Its in-flight table is
the fast duplicate-id check (the scheduler's ``add_request`` is the authoritative one).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from model_runner.lora.info import AdapterNotFoundError
from scheduler.request import AbortReason, LoraRef, Request
from server.auth import client_id
from server.engine import EngineDeadError, EngineLoop, StalledStreamError, StreamBuffer
from server.outputs import GenerationOutput, Item

if TYPE_CHECKING:
    from model_runner.base import AdapterSource

# A call cancelled this close to its deadline was cancelled BY the deadline. The client's clock
# runs ahead of ours: it started counting when it sent the call, we when gRPC's core parsed
# its headers (later by the send's latency: tens of ms on a loaded host), so a client's
# deadline cancel reaches us while our copy of the deadline still has that long to go. An
# explicit cancel this close to a deadline is counted as the deadline's.
DEADLINE_SLACK_S = 0.25


class DeadlineExceededError(TimeoutError):
    """The request's deadline passed before it finished; it was aborted in the engine."""


class DuplicateRequestError(ValueError):
    """A request with this id is already in flight."""


class ShutdownAbortError(EngineDeadError):
    """The server's shutdown grace period ended before the request did (retry elsewhere)."""


class EngineClient:
    """The asyncio face of an ``EngineLoop``: one ``asyncio.Queue`` per request.

    Use from one event loop. ``generate`` is an async generator; leaving it early (a
    cancelled task, ``aclose()``, a closed stream) aborts the request in the engine at its
    next step.
    """

    def __init__(self, engine: EngineLoop, adapters: AdapterSource | None = None) -> None:
        """``adapters``: the runner's LoRA adapters; a request's adapter is pinned while it
        is in flight (read back from disk first if it was evicted)."""
        self.engine = engine
        self.adapters = adapters
        self._active: dict[str, Request] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    async def generate(
        self,
        request: Request,
        *,
        deadline_s: float | None = None,
    ) -> AsyncIterator[GenerationOutput]:
        """Submit ``request`` and yield its outputs until every sample finished.

        ``deadline_s`` is an absolute ``time.monotonic()`` time; ``DEADLINE_SLACK_S`` after it
        (unless the caller left first) the request is aborted (reason DEADLINE) and
        ``DeadlineExceededError`` is raised. Raises
        ``OverloadError`` / ``ValueError`` when the scheduler refuses the request and
        ``EngineDeadError`` when the engine dies.
        """
        rid = request.request_id
        if rid in self._active:
            raise DuplicateRequestError(f"request_id {client_id(rid)!r} is already in flight")
        lora = request.lora
        if lora is not None:
            await self._pin(lora)
        try:
            # aclosing: leaving early closes the inner stream now, which aborts the request.
            async with contextlib.aclosing(self._generate(request, deadline_s)) as items:
                async for item in items:
                    yield item
        finally:
            if lora is not None and self.adapters is not None:
                self.adapters.release(lora)

    async def _pin(self, lora: LoraRef) -> None:
        """Pin the request's adapter (read back from disk in a worker thread when evicted);
        ``AdapterNotFoundError`` when this server does not serve it."""
        if self.adapters is None:
            raise AdapterNotFoundError(f"this server serves no adapters (asked for {lora.name!r})")
        if self.adapters.needs_read(lora):
            await asyncio.to_thread(self.adapters.acquire, lora)
        else:
            self.adapters.acquire(lora)

    async def _generate(
        self, request: Request, deadline_s: float | None
    ) -> AsyncIterator[GenerationOutput]:
        rid = request.request_id
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Item] = asyncio.Queue()
        buffer = StreamBuffer(rid)
        if not request.arrival_time_s:
            request.arrival_time_s = time.monotonic()
        self.engine.submit(request, loop, queue, buffer)
        self._active[rid] = request
        self._idle.clear()
        done = False
        try:
            while True:
                if deadline_s is None:
                    item = await queue.get()
                else:
                    # A backstop: a gRPC call is ended at its deadline by gRPC's core, and our
                    # timer firing at the same instant raced it to send the call's status (the
                    # loser logs an ERROR). loop.time() is time.monotonic() on default loops.
                    backstop_s = deadline_s + DEADLINE_SLACK_S
                    try:
                        async with asyncio.timeout_at(backstop_s - time.monotonic() + loop.time()):
                            item = await queue.get()
                    except TimeoutError:
                        raise DeadlineExceededError(
                            f"request {rid!r} passed its deadline and was aborted"
                        ) from None
                buffer.num_consumed += 1
                if (
                    buffer.parked
                    and not buffer.resume_sent
                    and buffer.num_unread <= self.engine.resume_unread_outputs
                ):
                    buffer.resume_sent = True  # one message: the engine unparks it now
                    self.engine.resume(rid)
                if isinstance(item, BaseException):
                    done = True  # rejected or the engine died: nothing left to abort
                    raise item
                done = item.closes_stream
                if item.abort_reason is AbortReason.SHUTDOWN:
                    raise ShutdownAbortError(
                        f"request {client_id(rid)!r} was cut off: the server shut down before "
                        "it finished; retry on another server"
                    )
                if item.abort_reason is AbortReason.STALLED:
                    timeout_s = self.engine.stalled_stream_timeout_s
                    raise StalledStreamError(
                        f"request {client_id(rid)!r} was aborted: its client read nothing for "
                        f"{timeout_s:g}s while {self.engine.max_unread_outputs} outputs waited "
                        "(--stalled-stream-timeout-s); its KV blocks were freed"
                    )
                yield item
                if done:
                    return
        finally:
            self._active.pop(rid, None)
            if not self._active:
                self._idle.set()
            if not done:
                passed = (
                    deadline_s is not None and time.monotonic() >= deadline_s - DEADLINE_SLACK_S
                )
                reason = AbortReason.DEADLINE if passed else AbortReason.CLIENT_CANCEL
                self.engine.abort(rid, reason)

    def abort(self, request_id: str, reason: AbortReason = AbortReason.ABORT_CALL) -> bool:
        """Abort a request in flight; False when no such request is in flight here."""
        if request_id not in self._active:
            return False
        self.engine.abort(request_id, reason)
        return True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False when ``timeout_s`` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    def active_request_ids(self) -> list[str]:
        return list(self._active)
