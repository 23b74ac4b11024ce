"""The output processor: the scheduler's ``RequestOutput``s -> what each client stream yields.

After vLLM's ``v1/engine/output_processor.py``. It runs on the engine thread; after every
``update`` the loop calls ``process(outs)``::

    RequestOutput  --->  _Sample (one per scheduler request)  --->  _Client (one per call)
      new tokens         token timings; incremental detokenizing        GenerationOutput items
      the end            a stop string   -> scheduler.finish(rid)       one RequestRecord per
                         a detokenizer error -> scheduler.fail(rid)     sample, at its end

Stop *tokens* end a request inside the scheduler; stop *strings* are found here, in the text,
and end it through ``scheduler.finish``. The final message of a sample is built from the
output that ended it: the one ``update`` returned, or the one ``finish`` / ``fail`` /
``abort`` returned. Nothing patches an earlier output.

n > 1: the scheduler forks samples 1..n-1 of a request and names them, in index order, in
``forked_ids`` on the parent's output (see ``scheduler.fork``); only then are they tracked
here. A client's stream closes with the last of its samples to end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, Protocol, TypeVar

from metrics.records import RequestRecord
from scheduler.output import RequestOutput, TokenLogprobs
from scheduler.request import AbortReason, FinishReason, Request

logger = logging.getLogger(__name__)


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


class EndsRequests(Protocol):
    """The scheduler calls that end a request from outside a step; each returns the
    request's final output (None when it had already ended)."""

    def abort(self, request_id: str) -> RequestOutput | None: ...

    def finish(self, request_id: str, stop_reason: str) -> RequestOutput | None: ...

    def fail(self, request_id: str, error: str) -> RequestOutput | None: ...


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
    abort_reason: AbortReason | None = None  # why, when finish_reason is ABORT
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    queue_time_s: float | None = None
    time_to_first_token_s: float | None = None
    e2e_time_s: float | None = None
    closes_stream: bool = False  # the last item of the client's stream (all samples ended)
    # On a request's first item when it asked for prompt logprobs: prompt tokens 1 .. P - 1.
    prompt_logprobs: list[TokenLogprobs] | None = None


# A stream item is an output, or an exception the client side re-raises.
Item = GenerationOutput | BaseException

# Where a client's items go; opaque here (the engine loop's per-request queue).
StreamT = TypeVar("StreamT")


@dataclass(slots=True, eq=False)
class _Client(Generic[StreamT]):
    """One client request: all of its ``n`` samples."""

    request: Request  # the request the client sent (sample 0)
    stream: StreamT
    open_ids: set[str] = field(default_factory=set)  # samples tracked and not ended
    forked: bool = False  # the scheduler named samples 1..n-1 (forked_ids)
    first_scheduled_s: float | None = None
    abort_reason: AbortReason | None = None


@dataclass(slots=True, eq=False)
class _Sample(Generic[StreamT]):
    """One scheduler request: one sample of a client request."""

    client: _Client[StreamT]
    index: int
    text: TextStream
    first_token_s: float | None = None
    last_token_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)


class OutputProcessor(Generic[StreamT]):
    """Per-client state of the requests in flight; see the module docstring.

    ``emit(stream, item)`` hands an item to a client's stream; ``on_request_done`` gets one
    ``RequestRecord`` per sample when it ends. Not thread-safe: the engine thread owns it.
    """

    def __init__(
        self,
        scheduler: EndsRequests,
        text_stream_factory: TextStreamFactory,
        emit: Callable[[StreamT, Item], None],
        on_request_done: Callable[[RequestRecord], None],
    ) -> None:
        self._scheduler = scheduler
        self._make_text = text_stream_factory
        self._emit = emit
        self._on_request_done = on_request_done
        self._clients: dict[str, _Client[StreamT]] = {}  # client request id -> its samples
        self._samples: dict[str, _Sample[StreamT]] = {}  # scheduler request id -> sample

    @property
    def num_clients(self) -> int:
        return len(self._clients)

    def open_sample_ids(self, client_id: str) -> list[str]:
        """The scheduler ids of a client request's samples still running (empty: ended)."""
        client = self._clients.get(client_id)
        return [] if client is None else sorted(client.open_ids)

    def text_stream(self, request: Request) -> TextStream:
        """A new request's text stream; raises when the request's text cannot be handled."""
        return self._make_text(request)

    def add(self, request: Request, stream: StreamT, text: TextStream) -> None:
        """Track a request the scheduler has just admitted (as sample 0 of its client)."""
        rid = request.request_id
        client = _Client(request=request, stream=stream, open_ids={rid})
        self._clients[rid] = client
        self._samples[rid] = _Sample(client=client, index=0, text=text)

    def on_scheduled(self, request_ids: Iterable[str], now: float) -> None:
        """Requests in a step's prefill batch: the first one ends a client's queue time."""
        for rid in request_ids:
            sample = self._samples.get(rid)
            if sample is not None and sample.client.first_scheduled_s is None:
                sample.client.first_scheduled_s = now

    def process(self, outs: Sequence[RequestOutput], now: float) -> bool:
        """Turn one update's outputs into stream items and records, in order. Returns True
        when it ended a request in the scheduler (a stop string, a detokenizer failure)."""
        ended = False
        for out in outs:
            ended |= self._process(out, now)
        return ended

    def abort(self, client_id: str, reason: AbortReason, now: float) -> bool:
        """Abort every sample of a client request in the scheduler and end its stream now;
        False when no such client is in flight."""
        client = self._clients.get(client_id)
        if client is None:
            return False
        client.abort_reason = reason
        # Forked samples first: aborting sample 0 would end them inside the scheduler and
        # leave their outputs for the next update, keeping this client open past this call.
        for sid in sorted(client.open_ids, key=lambda s: self._samples[s].index, reverse=True):
            out = self._scheduler.abort(sid)
            if out is not None:
                self._process(out, now)
        return True

    def abort_all(self, reason: AbortReason, now: float) -> None:
        for client_id in list(self._clients):
            self.abort(client_id, reason, now)

    def fail_all(self, error: BaseException) -> None:
        """The engine died: every client stream gets ``error``, and nothing is tracked.
        Each sample is failed in the scheduler first, which frees its blocks (unless the
        scheduler itself is what broke: then they stay, and the process exits anyway)."""
        for sid in sorted(self._samples, key=lambda s: -self._samples[s].index):
            try:
                self._scheduler.fail(sid, str(error))
            except Exception:
                logger.exception("failing %s in the scheduler after the engine died", sid)
        for client in self._clients.values():
            self._emit(client.stream, error)
        self._clients.clear()
        self._samples.clear()

    # ------------------------------------------------------------------ one output
    def _process(self, out: RequestOutput, now: float) -> bool:
        rid = out.request_id
        sample = self._samples.get(rid)
        if sample is None:
            logger.warning("output for unknown request %s dropped", rid)
            return False
        client = sample.client
        if out.forked_ids and not client.forked:
            self._track_forks(client, out.forked_ids)
        new = out.new_token_ids
        if not new and not out.finished:
            return False  # only names forked samples
        if new:
            self._time_tokens(sample, len(new), now)
        try:
            result = sample.text.push(new)
        except Exception as exc:
            logger.exception("detokenization failed for %s", rid)
            error = f"detokenization failed: {exc!r}"
            final = None if out.finished else self._scheduler.fail(rid, error)
            if final is None:  # the scheduler had ended it already: report the error anyway
                final = replace(out, finish_reason=FinishReason.ERROR, error=out.error or error)
            self._end(sample, final, now, step=out, flush=False)
            return True
        stop = result.stop_string if result.stopped else None
        if stop is not None:
            # A stop string ends the request here, outside the scheduler: end it there too.
            final = None if out.finished else self._scheduler.finish(rid, stop)
            if final is None:  # ended in the scheduler by the same token (a length limit)
                final = replace(out, finish_reason=FinishReason.STOP, stop_reason=stop)
            self._end(sample, final, now, step=out, text=result.text_delta, flush=False)
            return not out.finished
        if out.finished:
            self._end(sample, out, now, step=out, text=result.text_delta)
            return False
        self._emit(
            client.stream,
            GenerationOutput(
                request_id=client.request.request_id,
                index=sample.index,
                token_ids=list(new),
                text=result.text_delta,
                logprobs=list(out.new_logprobs),
                prompt_logprobs=out.prompt_logprobs,
            ),
        )
        return False

    def _track_forks(self, client: _Client[StreamT], forked_ids: tuple[str, ...]) -> None:
        """Track the samples the scheduler forked (samples 1.. in order), once per client."""
        client.forked = True
        for index, sid in enumerate(forked_ids, start=1):
            text = self._make_text(client.request)
            self._samples[sid] = _Sample(client=client, index=index, text=text)
            client.open_ids.add(sid)

    @staticmethod
    def _time_tokens(sample: _Sample[StreamT], num_tokens: int, now: float) -> None:
        if sample.first_token_s is None:
            sample.first_token_s = now
        elif sample.last_token_s is not None:
            sample.inter_token_s.append(now - sample.last_token_s)
        # Several tokens in one step arrived together: their gaps are zero.
        sample.inter_token_s.extend([0.0] * (num_tokens - 1))
        sample.last_token_s = now

    def _end(
        self,
        sample: _Sample[StreamT],
        final: RequestOutput,
        now: float,
        *,
        step: RequestOutput,
        text: str = "",
        flush: bool = True,
    ) -> None:
        """Publish the last message of one sample and report it to metrics, exactly once.
        ``final`` says how it ended; ``step`` holds the tokens of this step (the same output
        unless ``finish`` / ``fail`` ended it)."""
        rid = final.request_id
        if flush and final.finish_reason is not FinishReason.ERROR:
            try:
                text += sample.text.flush().text_delta
            except Exception:
                logger.exception("detokenizer flush failed for %s", rid)
        client = sample.client
        client_id = client.request.request_id
        del self._samples[rid]
        client.open_ids.discard(rid)
        closes = not client.open_ids
        if closes and self._clients.get(client_id) is client:
            del self._clients[client_id]
        arrival = client.request.arrival_time_s
        reason = final.finish_reason if final.finish_reason is not None else FinishReason.ERROR
        abort_reason = client.abort_reason or AbortReason.ABORT_CALL
        self._emit(
            client.stream,
            GenerationOutput(
                request_id=client_id,
                index=sample.index,
                token_ids=list(step.new_token_ids),
                text=text,
                logprobs=list(step.new_logprobs),
                finished=True,
                finish_reason=reason,
                stop_reason=final.stop_reason,
                error=final.error,
                abort_reason=abort_reason if reason is FinishReason.ABORT else None,
                num_prompt_tokens=final.num_prompt_tokens,
                num_cached_tokens=final.num_cached_tokens,
                num_output_tokens=final.num_output_tokens,
                queue_time_s=_since(arrival, client.first_scheduled_s),
                time_to_first_token_s=_since(arrival, sample.first_token_s),
                e2e_time_s=now - arrival,
                closes_stream=closes,
                prompt_logprobs=step.prompt_logprobs,
            ),
        )
        self._on_request_done(
            RequestRecord(
                request_id=rid,
                finish_reason=reason.value,
                abort_reason=abort_reason.value if reason is FinishReason.ABORT else None,
                num_prompt_tokens=final.num_prompt_tokens,
                num_cached_tokens=final.num_cached_tokens,
                num_output_tokens=final.num_output_tokens,
                arrival_s=arrival,
                first_scheduled_s=client.first_scheduled_s,
                first_token_s=sample.first_token_s,
                finished_s=now,
                inter_token_s=sample.inter_token_s,
                priority=client.request.priority,
                ttft_target_s=client.request.ttft_slo_s,
                itl_target_s=client.request.itl_slo_s,
                constrained=client.request.sampling.constraint is not None,
                adapter=None if client.request.lora is None else client.request.lora.name,
            )
        )


def _since(start: float, t: float | None) -> float | None:
    return None if t is None else t - start
