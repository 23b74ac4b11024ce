"""The engine loop: one thread owns the scheduler, the runner and the output processor::

    EngineClient.generate()  --submit(_Add)-->  inbox (deque + Condition)  <--abort(_Abort)--
         ^ asyncio.Queue per request                    |
         |                                              v   EngineLoop thread, per iteration:
         +-- loop.call_soon_threadsafe(deliver, batch)  1. drain inbox: add_request / abort
             (ONE call per step and event loop)         2. plan = scheduler.schedule()
                                                        3. result = runner.execute(plan)
                                                        4. outs = scheduler.update(plan, result)
                                                        5. outputs.process(outs): detokenize,
                                                           stop strings, n > 1, timings
                                                        6. publish; stats snapshot; metrics

Step 5 is ``server.outputs.OutputProcessor``; the asyncio side is ``server.engine_client``.
A step that raises (3, or its submit) fails its own requests (the runner scrubs their blocks
of any NaN it left); more than ``max_step_failures`` in a row, or an exception anywhere else,
and the engine dies (docs/reliability.md).

One step ahead (``overlap``; vLLM's async scheduling, SGLang's overlap scheduler): with a
runner that can run ahead (``model_runner.base.Runner.can_run_ahead``: CUDA, a CPU step
thread, the fake device), an iteration plans and submits step N+1 *before* it waits for step N::

    schedule N+1 -> runner.submit(N+1) -> N.result() -> update(N) -> outputs.process(N) -> publish
                    ^ the device runs N+1 while the host applies, detokenizes and publishes N

The tokens N samples reach N+1 on the device (placeholders; ``scheduler.entry``). A request
that ended at N may have one extra step computed and thrown away (``update`` drops it; its
output never shows it). A step that cannot be planned past (drafts to verify, a constrained
request's next mask; ``SchedulerOutput.can_run_ahead``) is applied before the next is
planned, and so is every step while KV tier 2 is on (it moves block bytes on the host
between steps). ``overlap=None`` turns it on where the runner can run ahead.
The event loop only enqueues messages and reads queues; a step's outputs for every request
cross to it in a single ``call_soon_threadsafe``. With nothing to do the thread sleeps on the
inbox condition (no busy spin).

Backpressure: each stream counts what was emitted and what its client took
(``StreamBuffer``). A client with ``max_unread_outputs`` unread is parked in the scheduler
(kept, not scheduled) until it has read half of them, and aborted (reason STALLED) when
parked for ``stalled_stream_timeout_s``.

Tier 2 (``server.kv_tier.Tier``, ``--kv-disk-dir``; a null object when off): a new request
whose prefix tier 1 lacks is held while its blocks are read from the store (other requests
keep stepping), then admitted; each step's spills and restores move right after
``schedule``, before ``execute``, and the blocks ``update`` freed right after it.
When the engine dies, every stream gets ``EngineDeadError``, later submissions raise it, and
``on_death`` is called once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from metrics.records import MetricsSink, NullSink, RequestRecord, StepRecord
from model_runner.base import Runner, StepHandle
from scheduler.cost_model import StepCostModel, StepShape
from scheduler.errors import OverloadError
from scheduler.output import ModelOutput, RequestOutput, SchedulerOutput, SchedulerStats
from scheduler.request import AbortReason, Request
from server.kv_tier import NoTier, Tier
from server.outputs import EndsRequests, Item, OutputProcessor, TextStreamFactory

if TYPE_CHECKING:
    from model_runner.constraints import ConstraintTracker

logger = logging.getLogger(__name__)

# Failed steps in a row that the engine survives (each fails the requests in it); one more and
# it dies (docs/reliability.md). A runner that fails every step is dead after this many + 1.
DEFAULT_MAX_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine loop stopped (the runner died, or the server is shutting down)."""


class SchedulerLike(EndsRequests, Protocol):
    """The part of ``scheduler.Scheduler`` the engine and its output processor drive."""

    def add_request(self, request: Request) -> None: ...

    def schedule(self, now_s: float | None = None) -> SchedulerOutput: ...

    def update(self, plan: SchedulerOutput, result: ModelOutput) -> list[RequestOutput]: ...

    def make_stats(self) -> SchedulerStats: ...

    def has_unfinished_requests(self) -> bool: ...

    def park(self, request_id: str) -> bool: ...

    def unpark(self, request_id: str) -> None: ...


@dataclass(slots=True, eq=False)
class StreamBuffer:
    """How far a client has read its stream: the backpressure state of one client request.

    The engine thread counts what it emits, the event loop counts what the client took; the
    difference is what waits unread. Each side writes only its own counter (and the engine
    only ``parked``), so no lock is needed: a stale read delays a decision by one iteration.
    """

    client_id: str
    num_emitted: int = 0  # engine thread
    num_consumed: int = 0  # event loop
    parked: bool = False  # engine thread: its samples are not scheduled
    parked_since_s: float = 0.0
    resume_sent: bool = False  # event loop: a resume message is on its way

    @property
    def num_unread(self) -> int:
        return self.num_emitted - self.num_consumed


class _Stream(NamedTuple):
    """Where one client request's items go: an asyncio.Queue owned by ``loop``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Item]
    buffer: StreamBuffer


@dataclass(slots=True)
class _Add:
    request: Request
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    request_id: str  # the client's id: aborts every sample of it
    reason: AbortReason


@dataclass(slots=True)
class _Resume:
    request_id: str  # a parked client read some of its stream: check it now


class StalledStreamError(RuntimeError):
    """The client read nothing for the stalled-stream timeout; its request was aborted."""


_Batch = list[tuple[asyncio.Queue[Item], Item]]  # one event loop's items of one iteration


def _deliver(items: _Batch) -> None:
    for queue, item in items:
        queue.put_nowait(item)


_STEP_KINDS = {(True, True): "mixed", (True, False): "prefill", (False, True): "decode"}


@dataclass(slots=True, eq=False)
class _Launched:
    """A planned step: submitted to the runner (``handle``), or nothing to compute."""

    plan: SchedulerOutput
    handle: StepHandle | None
    started_s: float  # perf_counter when its iteration began (before schedule)
    submitted_s: float  # perf_counter just before the runner got it
    schedule_cpu_s: float


class _Failed:
    """The handle of a step whose ``submit`` raised: its result raises the same."""

    __slots__ = ("_exc",)

    def __init__(self, exc: Exception) -> None:
        self._exc = exc

    def result(self) -> ModelOutput:
        raise self._exc


def _overlap(runner: Runner, overlap: bool | None, kv_tier: bool) -> bool:
    """Whether the engine plans each step while the one before runs: ``overlap``, or where
    the runner can run ahead (None), and never with KV tier 2 (it reads and writes block
    bytes on the host between steps: no step in flight). ValueError: ``overlap`` on a runner
    that cannot run ahead."""
    if overlap and not runner.can_run_ahead:
        raise ValueError(
            f"overlap needs a runner that computes a step while the next is planned; "
            f"{type(runner).__name__} on {runner.info.device} does not"
        )
    if overlap and kv_tier:
        logger.warning("async scheduling is off: KV tier 2 moves blocks between steps")
    return (runner.can_run_ahead if overlap is None else overlap) and not kv_tier


class EngineStepError(RuntimeError):
    """More consecutive steps failed than ``max_step_failures`` allows: the engine dies."""


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
        max_unread_outputs: int = 64,
        stalled_stream_timeout_s: float = 30.0,
        name: str = "kvserve-engine",
        cost_model: StepCostModel | None = None,
        kv_tier: Tier[_Add] | None = None,
        overlap: bool | None = None,
        max_step_failures: int = DEFAULT_MAX_STEP_FAILURES,
    ) -> None:
        """``cost_model``: fed every step's shape and measured iteration time (the slo
        policy's scheduler holds the same model). ``kv_tier``: tier 2 under the prefix cache
        (its cache manager is the scheduler's). ``overlap``: plan each step while the one
        before runs (see the module docstring); None: where the runner can run ahead; True
        raises for a runner that cannot. ``max_step_failures``: consecutive failed steps
        survived (each fails its own requests); one more and the engine dies."""
        if max_step_failures < 0:
            raise ValueError(f"max_step_failures must be >= 0, got {max_step_failures}")
        self.max_step_failures = max_step_failures
        self.num_failed_steps = 0  # in a row; a step that succeeds resets it
        self.num_failed_steps_total = 0  # counted ones (not those run behind a failed step)
        self._last_failure_s = float("-inf")  # perf_counter of the last failed step
        self._scheduler = scheduler
        self._runner = runner
        self.cost_model = cost_model
        self.sink: MetricsSink = sink if sink is not None else NullSink()  # set before start()
        self.outputs = OutputProcessor(scheduler, text_stream_factory, self._emit, self._done)
        self._on_death = on_death
        self._idle_wait_s = idle_wait_s
        self._cond = threading.Condition()
        self._inbox: deque[_Add | _Abort | _Resume] = deque()
        # Backpressure: a client with this many outputs unread is parked (not scheduled) until
        # it has read half of them; parked this long, it is aborted (reason STALLED).
        self.max_unread_outputs = max_unread_outputs
        self.stalled_stream_timeout_s = stalled_stream_timeout_s
        self._to_park: list[StreamBuffer] = []
        self._parked: dict[str, StreamBuffer] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        # Engine-thread state.
        self._pending: dict[asyncio.AbstractEventLoop, _Batch] = {}
        self._flush_needed = False
        self._stalled = False
        # Tier 2 holds new requests while their prefix is read, and moves block bytes.
        self.tier: Tier[_Add] = kv_tier if kv_tier is not None else NoTier()
        self.tier.attach(self._wake, self._is_waiting)
        self.overlap = _overlap(runner, overlap, kv_tier is not None)
        self._in_flight: _Launched | None = None  # overlap: the step the device runs
        self._last_applied_s = 0.0
        # Read from other threads: a reference swap per step.
        self.latest_stats: SchedulerStats = self.tier.annotate(scheduler.make_stats())
        self.num_steps = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------------ thread-safe API
    def start(self) -> None:
        self._thread.start()

    @property
    def constraint_tracker(self) -> ConstraintTracker | None:
        """The runner's structured-output matchers (None: it takes no constraints)."""
        return self._runner.constraints

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
        queue: asyncio.Queue[Item],
        buffer: StreamBuffer | None = None,
    ) -> None:
        """Queue ``request`` for admission; its outputs (or an error) arrive on ``queue``,
        and ``buffer.num_consumed`` says how many of them the client has read.
        Raises ``EngineDeadError`` at once when the engine is dead or stopping."""
        buffer = buffer if buffer is not None else StreamBuffer(request.request_id)
        with self._cond:
            if self._dead is not None:
                raise EngineDeadError(f"engine is dead: {self._dead!r}")
            if self._stopping:
                raise EngineDeadError("engine is shutting down")
            self._inbox.append(_Add(request, _Stream(loop, queue, buffer)))
            self._cond.notify()

    @property
    def resume_unread_outputs(self) -> int:
        """A parked client that has this many outputs or fewer left unread is resumed."""
        return self.max_unread_outputs // 2

    def resume(self, request_id: str) -> None:
        """A parked client read from its stream: let the engine check it at once."""
        with self._cond:
            self._inbox.append(_Resume(request_id))
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

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                messages, stopping = self._wait_for_work()
                for msg in messages:
                    if isinstance(msg, _Add):
                        self._admit(msg)
                    elif isinstance(msg, _Resume):
                        continue  # _check_parked below looks at every parked client
                    else:
                        held = self.tier.release(msg.request_id)
                        if held is not None:  # admitted so that it is aborted
                            self._admit(held, prefetched=True)
                        if self.outputs.abort(msg.request_id, msg.reason, time.monotonic()):
                            self._flush_needed, self._stalled = True, False
                for held in self.tier.released():
                    self._admit(held, prefetched=True)
                if stopping:
                    self._shutdown()
                    return
                if self._parked:
                    self._check_parked(time.monotonic())
                if self._has_work():
                    self._step()
                if self._to_park:
                    self._park_unread()
                self._publish()
        except BaseException as exc:
            self._die(exc)

    def _has_work(self) -> bool:
        return (
            self._flush_needed
            or self._in_flight is not None
            or self._scheduler.has_unfinished_requests()
            or self.tier.has_ready
        )

    def _wait_for_work(self) -> tuple[list[_Add | _Abort | _Resume], bool]:
        with self._cond:
            while not self._inbox and not self._stopping:
                if self._stalled:
                    # Unfinished requests but an empty plan: only a message (or a parked
                    # stream's timeout) can change that.
                    wait_s = self._idle_wait_s
                    if self._parked:
                        wait_s = min(wait_s, self.stalled_stream_timeout_s / 4)
                    self._cond.wait(wait_s)
                    break
                if self._has_work():
                    break
                self._cond.wait()
            messages = list(self._inbox)
            self._inbox.clear()
            return messages, self._stopping

    def _admit(self, msg: _Add, prefetched: bool = False) -> None:
        request = msg.request
        if not prefetched and self.tier.hold(request, msg):
            return  # admitted when its blocks are read
        try:
            text = self.outputs.text_stream(request)
            self._scheduler.add_request(request)  # a duplicate id raises here
        except (OverloadError, ValueError) as exc:
            self._emit(msg.stream, exc)
            return
        except Exception as exc:  # this request's failure, never the engine's
            logger.exception("admitting %s failed", request.request_id)
            error = f"request {request.request_id!r} could not be admitted: {exc}"
            self._emit(msg.stream, RuntimeError(error))
            return
        self.outputs.add(request, msg.stream, text)
        self._stalled = False

    def _step(self) -> None:
        """Plan and submit a step; apply the one in flight before it (overlap), or this one
        (schedule / execute / update / process outputs / stats: one engine step)."""
        sched = self._scheduler
        started_s = time.perf_counter()
        cpu0 = time.thread_time()
        plan = sched.schedule(time.monotonic())
        self.tier.before_execute()
        schedule_cpu_s = time.thread_time() - cpu0
        self.outputs.on_scheduled((seq.request_id for seq in plan.prefill), time.monotonic())
        handle: StepHandle | None = None
        submitted_s = time.perf_counter()
        if not (plan.is_empty and not plan.finished_request_ids and not plan.block_copies):
            runner = self._runner
            try:
                handle = runner.submit(plan)
            except Exception as exc:  # the step failed: its result says so (``_apply``)
                handle = _Failed(exc)
        launched = _Launched(plan, handle, started_s, submitted_s, schedule_cpu_s)
        previous, self._in_flight = self._in_flight, None
        flush = False
        if previous is not None:
            flush = self._apply(previous, plan)  # while the device runs this step
        if self.overlap and handle is not None and plan.can_run_ahead:
            self._in_flight = launched
        else:
            flush |= self._apply(launched)
        self._flush_needed = flush
        # An empty plan with nothing applied since it was made: only a message can help.
        self._stalled = (
            plan.is_empty
            and previous is None
            and self._in_flight is None
            and sched.has_unfinished_requests()
        )

    def _apply(self, launched: _Launched, behind: SchedulerOutput | None = None) -> bool:
        """Wait for a submitted step's result, apply it (``update``), process and publish
        its outputs, and record the step. True when processing ended a request in the
        scheduler (a stop string, a detokenizer failure): the next step reports it."""
        sched = self._scheduler
        plan = launched.plan
        handle = launched.handle
        try:
            result = handle.result() if handle is not None else ModelOutput.make_empty()
        except Exception as exc:
            # One step ahead, a step submitted before a failure was seen ran behind the failed
            # step (on its missing KV): the same failure, not one more in a row.
            counted = launched.submitted_s > self._last_failure_s
            result = self._failed_step(plan, exc, counted, behind)
        else:
            if handle is not None:
                self.num_failed_steps = 0
        wall1 = time.perf_counter()
        cpu2 = time.thread_time()
        outs = sched.update(plan, result)
        self.tier.after_update()
        cpu3 = time.thread_time()
        self.num_steps += 1
        # A stop string or a detokenizer failure ends a request: the next step reports it.
        flush = self.outputs.process(outs, time.monotonic())
        now = time.perf_counter()
        if self.overlap:
            # Steps overlap: a step's time is what it took on the device, and an iteration
            # is the time between two steps' results.
            step_s = result.prefill_time_s + result.decode_time_s
            iteration_s = now - max(launched.started_s, self._last_applied_s)
        else:
            step_s = wall1 - launched.submitted_s
            iteration_s = now - launched.started_s
        self._last_applied_s = now
        predicted_s = None
        if self.cost_model is not None and not plan.is_empty:
            predicted_s = self.cost_model.observe(StepShape.of_plan(plan), iteration_s)
        stats = self.tier.annotate(sched.make_stats())
        self.latest_stats = stats
        tracker = self._runner.constraints
        compiler = tracker.compiler if tracker is not None else None
        self.sink.on_step(
            StepRecord(
                stats=stats,
                kind=_STEP_KINDS.get((bool(plan.prefill), bool(plan.decode)), "idle"),
                step_duration_s=step_s,
                schedule_cpu_s=launched.schedule_cpu_s + (cpu3 - cpu2),
                iteration_s=iteration_s,
                predicted_s=predicted_s,
                constraint_mask_s=result.constraint_mask_time_s,
                num_constraint_compiles_total=compiler.num_compiled_total if compiler else 0,
                num_constraint_cache_hits_total=compiler.num_cache_hits_total if compiler else 0,
                num_failed_steps_total=self.num_failed_steps_total,
            )
        )
        return flush

    def _failed_step(
        self, plan: SchedulerOutput, exc: Exception, counted: bool, behind: SchedulerOutput | None
    ) -> ModelOutput:
        """A step that raised (the forward pass, the sampler, the constraint masks): each of
        its requests fails with the error, through the scheduler's failure path (its blocks
        are freed once, none enters the prefix cache; the runner scrubs them, and theirs in
        the step ``behind`` it, of any NaN left). More than ``max_step_failures`` failed
        steps in a row (``counted`` ones): the runner is taken for dead."""
        self._last_failure_s = time.perf_counter()
        self.num_failed_steps += counted
        self.num_failed_steps_total += counted
        if self.num_failed_steps > self.max_step_failures:
            raise EngineStepError(
                f"{self.num_failed_steps} steps in a row failed, the last with {exc!r}"
            ) from exc
        logger.error(
            "step %d failed (%d in a row, up to %d survived): %r; failing its %d requests",
            plan.step_id, self.num_failed_steps, self.max_step_failures, exc,
            len(plan.prefill) + len(plan.decode), exc_info=exc,
        )  # fmt: skip
        error = f"the model step failed: {type(exc).__name__}: {exc}"
        result = ModelOutput.make_empty()
        for seq in (*plan.prefill, *plan.decode):
            result.failed[seq.request_id] = error
        blocks = plan.block_ids_of(result.failed) | (behind or plan).block_ids_of(result.failed)
        self._runner.scrub_blocks(sorted(blocks))
        return result

    def _is_waiting(self, request_id: str) -> bool:
        """Whether a request with staged tier-2 blocks may still be admitted."""
        return bool(self.outputs.open_sample_ids(request_id))

    def _done(self, record: RequestRecord) -> None:
        """A request's end, to the sink of the moment (it may be set after construction)."""
        self.sink.on_request_done(record)

    def _emit(self, stream: _Stream, item: Item) -> None:
        self._pending.setdefault(stream.loop, []).append((stream.queue, item))
        buffer = stream.buffer
        buffer.num_emitted += 1
        if not buffer.parked and buffer.num_unread >= self.max_unread_outputs:
            self._to_park.append(buffer)

    # ------------------------------------------------------------------ backpressure
    def _park_unread(self) -> None:
        """Park the clients whose unread outputs reached the bound this iteration: their
        samples keep their blocks but are not scheduled, so they stop growing."""
        to_park, self._to_park = self._to_park, []
        now = time.monotonic()
        for buffer in to_park:
            sample_ids = self.outputs.open_sample_ids(buffer.client_id)
            if buffer.parked or not sample_ids or buffer.num_unread < self.max_unread_outputs:
                continue  # ended meanwhile, or the client caught up
            for sid in sample_ids:
                self._scheduler.park(sid)
            buffer.parked, buffer.parked_since_s = True, now
            self._parked[buffer.client_id] = buffer
            logger.debug("parked %s: %d outputs unread", buffer.client_id, buffer.num_unread)

    def _check_parked(self, now: float) -> None:
        """Resume parked clients that read half of their backlog; abort (reason STALLED) those
        parked for longer than the stalled-stream timeout, which frees their blocks."""
        for client_id, buffer in list(self._parked.items()):
            sample_ids = self.outputs.open_sample_ids(client_id)
            if not sample_ids:
                del self._parked[client_id]
            elif buffer.num_unread <= self.resume_unread_outputs:
                for sid in sample_ids:
                    self._scheduler.unpark(sid)
                buffer.parked, buffer.resume_sent = False, False
                del self._parked[client_id]
                self._stalled = False
            elif now - buffer.parked_since_s >= self.stalled_stream_timeout_s:
                del self._parked[client_id]
                logger.warning(
                    "aborting %s: its client read nothing for %.1fs (%d outputs unread)",
                    client_id,
                    now - buffer.parked_since_s,
                    buffer.num_unread,
                )
                self.outputs.abort(client_id, AbortReason.STALLED, now)
                self._flush_needed, self._stalled = True, False

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
        for msg in self.tier.release_all():  # admitted so that they are aborted
            self._admit(msg, prefetched=True)
        self.outputs.abort_all(AbortReason.SHUTDOWN, time.monotonic())
        self._flush_needed = True
        # Forked samples aborted with their parent report in this update.
        while self._has_work() and self.outputs.num_clients:
            self._step()
        if self._in_flight is not None:  # only ended requests' steps are left in it
            launched, self._in_flight = self._in_flight, None
            self._apply(launched)
        self._publish()
        self.tier.shutdown()
        self.latest_stats = self.tier.annotate(self._scheduler.make_stats())

    def _die(self, exc: BaseException) -> None:
        logger.error("engine loop died: %r", exc, exc_info=exc)
        with self._cond:
            self._dead = exc
            stranded = [m for m in self._inbox if isinstance(m, _Add)]
            stranded += self.tier.release_all()
            self._inbox.clear()
        error = EngineDeadError(f"engine loop died: {exc!r}")
        self.outputs.fail_all(error)  # frees their blocks where the scheduler still can
        try:
            self.latest_stats = self.tier.annotate(self._scheduler.make_stats())
        except Exception:
            logger.exception("stats after the engine died")
        for msg in stranded:
            self._emit(msg.stream, error)
        self._publish()
        if self._on_death is not None:
            try:
                self._on_death(exc)
            except Exception:
                logger.exception("on_death callback failed")
