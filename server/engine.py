"""The engine loop thread and its asyncio facade.

One thread owns the scheduler and the runner; nothing else touches them::

    EngineClient.generate()  --submit(_Add)-->  inbox (deque + Condition)  <--abort(_Abort)--
         ^ asyncio.Queue per request                    |
         |                                              v   EngineLoop thread, per iteration:
         +-- loop.call_soon_threadsafe(deliver, batch)  1. drain inbox: add_request / abort
             (ONE call per step and event loop)         2. plan = scheduler.schedule()
                                                        3. result = runner.execute(plan)
                                                        4. outs = scheduler.update(plan, result)
                                                        5. detokenize (stop strings -> finish)
                                                        6. publish; stats snapshot; metrics

The event loop only ever enqueues messages and reads queues; a step's outputs for every
request cross to it in a single ``call_soon_threadsafe``. When there is nothing to do the
thread sleeps on the inbox condition (no busy spin).

If the runner (or the scheduler) raises, the engine is dead: every stream gets
``EngineDeadError``, later submissions raise it, and ``on_death`` is called once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from metrics.records import MetricsSink, NullSink, RequestRecord, StepRecord
from model_runner.base import Runner
from scheduler.errors import OverloadError
from scheduler.output import (
    ModelOutput,
    RequestOutput,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
)
from scheduler.request import AbortReason, FinishReason, Request

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (the runner died, or the server is shutting down)."""


class DeadlineExceededError(TimeoutError):
    """The request's deadline passed before it finished; it was aborted in the engine."""


class DuplicateRequestError(ValueError):
    """A request with this id is already in flight."""


class SchedulerLike(Protocol):
    """The part of ``scheduler.Scheduler`` the engine drives (see BRIEF.md)."""

    def add_request(self, request: Request) -> None: ...

    def abort(
        self, request_id: str, reason: AbortReason = AbortReason.ABORT_CALL
    ) -> RequestOutput | None: ...

    def finish(self, request_id: str, stop_reason: str) -> RequestOutput | None: ...

    def fail(self, request_id: str, error: str) -> RequestOutput | None: ...

    def schedule(self) -> SchedulerOutput: ...

    def update(self, plan: SchedulerOutput, result: ModelOutput) -> list[RequestOutput]: ...

    def make_stats(self) -> SchedulerStats: ...

    def has_unfinished_requests(self) -> bool: ...


class DetokResultLike(Protocol):
    @property
    def text_delta(self) -> str: ...

    @property
    def stopped(self) -> bool: ...

    @property
    def stop_string(self) -> str | None: ...


class TextStream(Protocol):
    """Incremental detokenization of one request's output with stop strings (the contract of
    ``model_runner.tokenizer.IncrementalDetokenizer``)."""

    def push(self, token_ids: Sequence[int]) -> DetokResultLike:
        """Text now safe to send for these new tokens; ``stopped`` when a stop string was
        completed (the delta ends before it)."""
        ...

    def flush(self) -> DetokResultLike:
        """Text held back (a possible stop-string prefix, a partial character) at the end."""
        ...


# Builds the TextStream of a request (or of one of its samples) from the request the client
# sent: its prompt ids and ``sampling.stop`` strings.
TextStreamFactory = Callable[[Request], TextStream]


@dataclass(slots=True)
class GenerationOutput:
    """What one client request's stream yields: new tokens + text, and at the end the result.

    ``request_id`` is the id the client sent; ``index`` says which of its ``n`` samples.
    Times are seconds since the request arrived (None when it never got there).
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    queue_time_s: float | None = None
    time_to_first_token_s: float | None = None
    e2e_time_s: float | None = None
    closes_stream: bool = False  # the last item of the client's stream (all samples ended)


# A stream item is an output, or an exception the client side re-raises.
_Item = GenerationOutput | BaseException


class _Stream:
    """Where one client request's items go: an asyncio.Queue owned by ``loop``."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[_Item]) -> None:
        self.loop = loop
        self.queue = queue


@dataclass(slots=True)
class _Add:
    request: Request
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    request_id: str  # the client's id: aborts every sample of it
    reason: AbortReason


@dataclass(slots=True, eq=False)
class _Client:
    """Engine-thread bookkeeping of one client request (all of its ``n`` samples)."""

    request: Request  # the request the client sent (sample 0)
    stream: _Stream
    open_ids: set[str] = field(default_factory=set)  # samples tracked and not finished
    forked: bool = False  # samples 1..n-1 were looked up after the first token
    first_scheduled_s: float | None = None
    abort_reason: AbortReason | None = None

    @property
    def client_id(self) -> str:
        return self.request.request_id


@dataclass(slots=True, eq=False)
class _Sample:
    """Engine-thread bookkeeping of one scheduler request (one sample of a client request)."""

    client: _Client
    index: int
    text: TextStream
    first_token_s: float | None = None
    last_token_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)


def _deliver(items: list[tuple[asyncio.Queue[_Item], _Item]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def sample_request_id(request_id: str, index: int) -> str:
    """The scheduler's id of sample ``index`` of a request with ``n > 1`` (0 is the request)."""
    return request_id if index == 0 else f"{request_id}#{index}"


class EngineLoop:
    """Runs the scheduler and the runner on its own thread; see the module docstring.

    Thread-safe entry points: ``submit``, ``abort``, ``stop``, ``latest_stats``,
    ``is_alive``. Everything else runs on the engine thread.
    """

    def __init__(
        self,
        scheduler: SchedulerLike,
        runner: Runner,
        text_stream_factory: TextStreamFactory,
        *,
        sink: MetricsSink | None = None,
        on_death: Callable[[BaseException], None] | None = None,
        idle_wait_s: float = 1.0,
        name: str = "kvserve-engine",
    ) -> None:
        self._scheduler = scheduler
        self._runner = runner
        self._make_text = text_stream_factory
        self.sink: MetricsSink = sink if sink is not None else NullSink()  # set before start()
        self._on_death = on_death
        self._idle_wait_s = idle_wait_s
        self._cond = threading.Condition()
        self._inbox: deque[_Add | _Abort] = deque()
        self._stopping = False
        self._dead: BaseException | None = None
        # Engine-thread state.
        self._clients: dict[str, _Client] = {}  # client request id -> its samples
        self._samples: dict[str, _Sample] = {}  # scheduler request id -> bookkeeping
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[_Item], _Item]]]
        self._pending = {}
        self._flush_needed = False
        self._stalled = False
        # Read from other threads: a reference swap per step.
        self.latest_stats: SchedulerStats = scheduler.make_stats()
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------------ thread-safe API
    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def set_on_death(self, callback: Callable[[BaseException], None] | None) -> None:
        """Called once, from the engine thread, when the engine dies."""
        self._on_death = callback

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def submit(
        self,
        request: Request,
        loop: asyncio.AbstractEventLoop,
        queue: asyncio.Queue[_Item],
    ) -> None:
        """Queue ``request`` for admission; its outputs (or an error) arrive on ``queue``.

        Raises ``EngineDeadError`` at once when the engine is dead or stopping.
        """
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"engine is dead: {self._dead!r}")
            if self._stopping:
                raise EngineDeadError("engine is shutting down")
            self._inbox.append(_Add(request, _Stream(loop, queue)))
            self._cond.notify()

    def abort(self, request_id: str, reason: AbortReason = AbortReason.ABORT_CALL) -> None:
        """Abort every sample of the client request ``request_id`` at the next step."""
        with self._cond:
            self._inbox.append(_Abort(request_id, reason))
            self._cond.notify()

    def stop(self, timeout_s: float | None = 5.0) -> None:
        """Abort everything (reason SHUTDOWN), stop the thread, and join it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                messages, stopping = self._wait_for_work()
                self._handle(messages)
                if stopping:
                    self._shutdown()
                    return
                if self._has_work():
                    self._step()
                self._publish()
        except BaseException as exc:
            self._die(exc)

    def _has_work(self) -> bool:
        return self._flush_needed or self._scheduler.has_unfinished_requests()

    def _wait_for_work(self) -> tuple[list[_Add | _Abort], bool]:
        with self._cond:
            while not self._inbox and not self._stopping:
                if self._stalled:
                    # Unfinished requests but an empty plan: only a message can change that.
                    self._cond.wait(self._idle_wait_s)
                    break
                if self._has_work():
                    break
                self._cond.wait()
            messages = list(self._inbox)
            self._inbox.clear()
            return messages, self._stopping

    def _handle(self, messages: list[_Add | _Abort]) -> None:
        for msg in messages:
            if isinstance(msg, _Add):
                self._admit(msg)
            else:
                self._abort_client(msg.request_id, msg.reason)

    def _admit(self, msg: _Add) -> None:
        request = msg.request
        rid = request.request_id
        if rid in self._clients:  # an earlier request of that id has not fully ended yet
            self._emit(msg.stream, DuplicateRequestError(f"request_id {rid!r} is still ending"))
            return
        try:
            text = self._make_text(request)
            self._scheduler.add_request(request)
        except (OverloadError, ValueError) as exc:
            self._emit(msg.stream, exc)
            return
        except Exception as exc:  # this request's failure, never the engine's
            logger.exception("admitting %s failed", rid)
            self._emit(msg.stream, RuntimeError(f"request {rid!r} could not be admitted: {exc}"))
            return
        client = _Client(request=request, stream=msg.stream, open_ids={rid})
        self._clients[rid] = client
        self._samples[rid] = _Sample(client=client, index=0, text=text)
        self._stalled = False

    def _discover_samples(self, client: _Client) -> None:
        """Track samples 1..n-1, which the scheduler forks when sample 0 gets its first token."""
        client.forked = True
        rid = client.client_id
        for index in range(1, client.request.sampling.n):
            sid = sample_request_id(rid, index)
            request = self._scheduler_request(sid)
            if request is None or sid in self._samples:
                continue
            text = self._make_text(client.request)
            self._samples[sid] = _Sample(client=client, index=index, text=text)
            client.open_ids.add(sid)

    def _scheduler_request(self, request_id: str) -> Request | None:
        get = getattr(self._scheduler, "get_request", None)
        return get(request_id) if get is not None else None

    def _abort_client(self, client_id: str, reason: AbortReason) -> None:
        client = self._clients.get(client_id)
        if client is None:
            return
        client.abort_reason = reason
        if client.request.sampling.n > 1 and not client.forked:
            self._discover_samples(client)
        now = time.monotonic()
        # Forked samples first: aborting sample 0 would end them inside the scheduler and leave
        # their outputs for the next update, keeping this client open past this call.
        for sid in sorted(client.open_ids, key=lambda s: self._samples[s].index, reverse=True):
            out = self._scheduler.abort(sid, reason)
            self._flush_needed = True
            self._stalled = False
            if out is not None:
                self._finish(sid, self._samples[sid], out, "", now)

    def _step(self) -> None:
        sched = self._scheduler
        cpu0 = time.thread_time()
        plan = sched.schedule()
        cpu1 = time.thread_time()
        scheduled_at = time.monotonic()
        wall0 = time.perf_counter()
        if plan.is_empty and not plan.finished_request_ids and not plan.block_copies:
            result = ModelOutput.make_empty()
        else:
            result = self._runner.execute(plan)
        wall1 = time.perf_counter()
        cpu2 = time.thread_time()
        outs = sched.update(plan, result)
        cpu3 = time.thread_time()
        self._flush_needed = False
        self._stalled = plan.is_empty and sched.has_unfinished_requests()
        self.num_steps += 1

        for seq in plan.prefill:
            sample = self._samples.get(seq.request_id)
            if sample is not None and sample.client.first_scheduled_s is None:
                sample.client.first_scheduled_s = scheduled_at
        now = time.monotonic()
        for out in outs:
            self._on_output(out, now)

        stats = sched.make_stats()
        self.latest_stats = stats
        if plan.prefill and plan.decode:
            kind = "mixed"
        elif plan.prefill:
            kind = "prefill"
        elif plan.decode:
            kind = "decode"
        else:
            kind = "idle"
        self.sink.on_step(
            StepRecord(
                stats=stats,
                kind=kind,
                step_duration_s=wall1 - wall0,
                schedule_cpu_s=(cpu1 - cpu0) + (cpu3 - cpu2),
            )
        )

    def _sample_for(self, out: RequestOutput) -> _Sample | None:
        sample = self._samples.get(out.request_id)
        if sample is None and out.parent_id is not None:
            client = self._clients.get(out.parent_id)
            if client is not None and not client.forked:
                self._discover_samples(client)
                sample = self._samples.get(out.request_id)
        return sample

    def _on_output(self, out: RequestOutput, now: float) -> None:
        rid = out.request_id
        sample = self._sample_for(out)
        if sample is None:
            logger.warning("output for unknown request %s dropped", rid)
            return
        client = sample.client
        if out.new_token_ids:
            if sample.index == 0 and client.request.sampling.n > 1 and not client.forked:
                self._discover_samples(client)
            if sample.first_token_s is None:
                sample.first_token_s = now
            elif sample.last_token_s is not None:
                sample.inter_token_s.append(now - sample.last_token_s)
            # Several tokens in one step arrived together: their gaps are zero.
            sample.inter_token_s.extend([0.0] * (len(out.new_token_ids) - 1))
            sample.last_token_s = now
        try:
            result = sample.text.push(out.new_token_ids)
            delta = result.text_delta
            stop_hit = result.stop_string if result.stopped else None
        except Exception as exc:
            logger.exception("detokenization failed for %s", rid)
            error = f"detokenization failed: {exc!r}"
            failed = self._scheduler.fail(rid, error) if not out.finished else None
            final = failed if failed is not None else out
            final.finished = True
            final.finish_reason = FinishReason.ERROR
            final.error = final.error or error
            final.new_token_ids = list(out.new_token_ids)
            self._flush_needed = True
            self._finish(rid, sample, final, "", now)
            return
        if stop_hit is not None:
            if not out.finished:
                # The stop string is found here, outside the scheduler: end it there too.
                self._scheduler.finish(rid, stop_hit)
                self._flush_needed = True
            out.finished = True
            out.finish_reason = FinishReason.STOP
            out.stop_reason = stop_hit
            self._finish(rid, sample, out, delta, now, flush_text=False)
            return
        if out.finished:
            self._finish(rid, sample, out, delta, now)
            return
        self._emit(
            client.stream,
            GenerationOutput(
                request_id=client.client_id,
                index=sample.index,
                token_ids=list(out.new_token_ids),
                text=delta,
                logprobs=list(out.new_logprobs),
            ),
        )

    def _finish(
        self,
        rid: str,
        sample: _Sample,
        out: RequestOutput,
        delta: str,
        now: float,
        *,
        flush_text: bool = True,
    ) -> None:
        """Publish the final message of one sample and report it to metrics, exactly once."""
        if flush_text and out.finish_reason is not FinishReason.ERROR:
            try:
                delta += sample.text.flush().text_delta
            except Exception:
                logger.exception("detokenizer flush failed for %s", rid)
        client = sample.client
        del self._samples[rid]
        client.open_ids.discard(rid)
        # Sample 0 ending before its first token means the other samples never fork.
        closes = not client.open_ids and (
            client.forked or client.request.sampling.n == 1 or rid == client.client_id
        )
        if closes and self._clients.get(client.client_id) is client:
            del self._clients[client.client_id]
        arrival = client.request.arrival_time_s
        reason = out.finish_reason if out.finish_reason is not None else FinishReason.ERROR
        self._emit(
            client.stream,
            GenerationOutput(
                request_id=client.client_id,
                index=sample.index,
                token_ids=list(out.new_token_ids),
                text=delta,
                logprobs=list(out.new_logprobs),
                finished=True,
                finish_reason=reason,
                stop_reason=out.stop_reason,
                error=out.error,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
                num_output_tokens=out.num_output_tokens,
                queue_time_s=_since(arrival, client.first_scheduled_s),
                time_to_first_token_s=_since(arrival, sample.first_token_s),
                e2e_time_s=now - arrival,
                closes_stream=closes,
            ),
        )
        abort_label: str | None = None
        if reason is FinishReason.ABORT:
            abort_reason = client.abort_reason
            if abort_reason is None:  # ended with its parent, or by the scheduler itself
                abort_reason = AbortReason.SHUTDOWN if self._stopping else AbortReason.ABORT_CALL
            abort_label = abort_reason.value
        self.sink.on_request_done(
            RequestRecord(
                request_id=rid,
                finish_reason=reason.value,
                abort_reason=abort_label,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
                num_output_tokens=out.num_output_tokens,
                arrival_s=arrival,
                first_scheduled_s=client.first_scheduled_s,
                first_token_s=sample.first_token_s,
                finished_s=now,
                inter_token_s=sample.inter_token_s,
            )
        )

    def _emit(self, stream: _Stream, item: _Item) -> None:
        self._pending.setdefault(stream.loop, []).append((stream.queue, item))

    def _publish(self) -> None:
        """Hand this iteration's items to their event loops: one call per loop."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for loop, items in pending.items():
            # A closed loop raises RuntimeError: nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_deliver, items)

    def _shutdown(self) -> None:
        for client_id in list(self._clients):
            self._abort_client(client_id, AbortReason.SHUTDOWN)
        # Forked samples aborted with their parent report in this update.
        while self._has_work() and self._clients:
            self._step()
        self._publish()
        self.latest_stats = self._scheduler.make_stats()

    def _die(self, exc: BaseException) -> None:
        logger.error("engine loop died: %r", exc, exc_info=exc)
        with self._cond:
            self._dead = exc
            stranded = [m for m in self._inbox if isinstance(m, _Add)]
            self._inbox.clear()
        error = EngineDeadError(f"engine loop died: {exc!r}")
        for client in self._clients.values():
            self._emit(client.stream, error)
        for msg in stranded:
            self._emit(msg.stream, error)
        self._clients.clear()
        self._samples.clear()
        self._publish()
        if self._on_death is not None:
            try:
                self._on_death(exc)
            except Exception:
                logger.exception("on_death callback failed")


def _since(start: float, t: float | None) -> float | None:
    return None if t is None else t - start


class EngineClient:
    """The asyncio face of an ``EngineLoop``: one ``asyncio.Queue`` per request.

    Use from one event loop. ``generate`` is an async generator; leaving it early (a
    cancelled task, ``aclose()``, a closed stream) aborts the request in the engine at its
    next step.
    """

    def __init__(self, engine: EngineLoop) -> None:
        self.engine = engine
        self._active: dict[str, Request] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._active)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    async def generate(
        self,
        request: Request,
        *,
        deadline_s: float | None = None,
    ) -> AsyncIterator[GenerationOutput]:
        """Submit ``request`` and yield its outputs until every sample finished.

        ``deadline_s`` is an absolute ``time.monotonic()`` time; when it passes the request is
        aborted (reason DEADLINE) and ``DeadlineExceededError`` is raised. Raises
        ``OverloadError`` / ``ValueError`` when the scheduler refuses the request and
        ``EngineDeadError`` when the engine dies.
        """
        rid = request.request_id
        if rid in self._active:
            raise DuplicateRequestError(f"request_id {rid!r} is already in flight")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        if not request.arrival_time_s:
            request.arrival_time_s = time.monotonic()
        self.engine.submit(request, loop, queue)
        self._active[rid] = request
        self._idle.clear()
        done = False
        try:
            while True:
                if deadline_s is None:
                    item = await queue.get()
                else:
                    # loop.time() is time.monotonic() on the default event loops.
                    try:
                        async with asyncio.timeout_at(deadline_s - time.monotonic() + loop.time()):
                            item = await queue.get()
                    except TimeoutError:
                        raise DeadlineExceededError(
                            f"request {rid!r} passed its deadline and was aborted"
                        ) from None
                if isinstance(item, BaseException):
                    done = True  # rejected or the engine died: nothing left to abort
                    raise item
                done = item.closes_stream
                yield item
                if done:
                    return
        finally:
            self._active.pop(rid, None)
            if not self._active:
                self._idle.set()
            if not done:
                passed = deadline_s is not None and time.monotonic() >= deadline_s
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
