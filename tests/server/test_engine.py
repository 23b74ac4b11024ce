"""The engine loop thread and EngineClient, without gRPC."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from cache_manager import KVCacheConfig, KVCacheManager
from scheduler import OverloadError, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.request import AbortReason, FinishReason
from server.engine import EngineDeadError, EngineLoop
from server.engine_client import (
    DEADLINE_SLACK_S,
    DeadlineExceededError,
    DuplicateRequestError,
    EngineClient,
)
from server.fake_tokenizer import ByteTokenizer
from server.outputs import GenerationOutput
from server.text import make_text_stream_factory
from tests.server.helpers import RecordingSink, expected_tokens, make_fake_runner, wait_until


@asynccontextmanager
async def engine_client(
    runner: Any = None, num_blocks: int = 64, **config: Any
) -> AsyncIterator[tuple[EngineClient, EngineLoop, Any, RecordingSink]]:
    runner = runner if runner is not None else make_fake_runner()
    config.setdefault("max_model_len", 128)
    config.setdefault("max_num_seqs", 16)
    config.setdefault("max_num_batched_tokens", 256)
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=4))
    sink = RecordingSink()
    engine = EngineLoop(
        Scheduler(SchedulerConfig(**config), kv),
        runner,
        make_text_stream_factory(ByteTokenizer()),
        sink=sink,
    )
    engine.start()
    try:
        yield EngineClient(engine), engine, runner, sink
    finally:
        engine.stop()


def request(rid: str, max_tokens: int = 4, prompt: list[int] | None = None, **kw: Any) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt if prompt is not None else [65, 66, 67, 68, 69],
        sampling=SamplingParams(max_tokens=max_tokens, **kw),
        eos_token_ids=(257,),
    )


async def run(client: EngineClient, req: Request, **kw: Any) -> list[GenerationOutput]:
    return [out async for out in client.generate(req, **kw)]


async def test_generate_yields_tokens_then_a_final_output() -> None:
    """EngineClient.generate yields one output per token; the last carries the result."""
    async with engine_client() as (client, _engine, runner, _sink):
        outs = await run(client, request("a", max_tokens=5))
    assert [o.token_ids for o in outs] == [[t] for t in expected_tokens(runner, "a", 5, owner=None)]
    last = outs[-1]
    assert last.finished and last.finish_reason is FinishReason.LENGTH and last.closes_stream
    assert (last.num_prompt_tokens, last.num_output_tokens) == (5, 5)
    assert last.queue_time_s is not None and last.time_to_first_token_s is not None
    assert client.num_in_flight == 0


async def test_one_event_loop_callback_per_step() -> None:
    """All outputs of one step cross to the event loop in one call_soon_threadsafe."""
    loop = asyncio.get_running_loop()
    calls = 0
    original = loop.call_soon_threadsafe

    def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        async with engine_client(make_fake_runner(sleep_s=0.005)) as (client, engine, _runner, _):
            results = await asyncio.gather(*(run(client, request(f"r{i}", 6)) for i in range(8)))
            steps = engine.num_steps
    finally:
        loop.call_soon_threadsafe = original  # type: ignore[method-assign]
    assert sum(len(r) for r in results) == 8 * 6
    # 48 outputs in at most one callback per step (steps that produced something).
    assert 0 < calls <= steps < 48


async def test_metrics_records_once_per_step_and_per_request() -> None:
    """on_step once per step; on_request_done once per request, with n-1 inter-token gaps."""
    async with engine_client() as (client, engine, _runner, sink):
        await asyncio.gather(run(client, request("x", 4)), run(client, request("y", 7)))
        steps = engine.num_steps
    assert len(sink.steps) == steps
    assert {s.kind for s in sink.steps} <= {"prefill", "decode", "mixed", "idle"}
    x, y = sink.request("x"), sink.request("y")
    assert (x.finish_reason, x.num_output_tokens, len(x.inter_token_s)) == ("length", 4, 3)
    assert (y.finish_reason, y.num_output_tokens, len(y.inter_token_s)) == ("length", 7, 6)
    assert x.abort_reason is None
    assert x.arrival_s <= x.first_scheduled_s <= x.first_token_s <= x.finished_s  # type: ignore[operator]


async def test_idle_engine_sleeps_instead_of_spinning() -> None:
    """With nothing to do the engine thread takes no steps (it waits on its inbox)."""
    async with engine_client() as (client, engine, _runner, _):
        await run(client, request("once", 3))
        steps = engine.num_steps
        await asyncio.sleep(0.2)
        assert engine.num_steps == steps
        await run(client, request("again", 2))
        assert engine.num_steps > steps


async def test_overload_and_never_runnable_are_raised_to_the_caller() -> None:
    """Admission errors from the scheduler reach generate() as exceptions."""
    runner = make_fake_runner(sleep_s=0.01)
    async with engine_client(runner, max_num_seqs=1, max_waiting_requests=0) as (client, *_):
        with pytest.raises(OverloadError, match="max_waiting_requests=0"):
            await run(client, request("o", 2))
    async with engine_client(num_blocks=2) as (client, *_):
        with pytest.raises(ValueError, match="whole pool has 2"):
            await run(client, request("big", 20))


async def test_duplicate_id_and_deadline() -> None:
    """A duplicate in-flight id raises; a passed deadline aborts with DeadlineExceededError."""
    async with engine_client(make_fake_runner(sleep_s=0.01)) as (client, _engine, _runner, sink):
        stream = client.generate(request("d", 100))
        await anext(stream)
        with pytest.raises(DuplicateRequestError):
            await anext(client.generate(request("d", 2)))
        await stream.aclose()
        with pytest.raises(DeadlineExceededError):
            await run(client, request("late", 100), deadline_s=time.monotonic() + 0.05)
        await wait_until(lambda: len(sink.requests) == 2)
    assert sink.request("d").abort_reason == "client_cancel"
    assert sink.request("late").abort_reason == "deadline"


async def test_engine_death_reaches_every_stream_and_later_submits() -> None:
    """A runner exception with no failed step to spare: streams raise EngineDeadError,
    on_death runs once, submit refuses, and the scheduler's blocks are all freed."""
    deaths: list[BaseException] = []
    runner = make_fake_runner(sleep_s=0.01)
    async with engine_client(runner) as (client, engine, _, _):
        engine.set_on_death(deaths.append)
        engine.max_step_failures = 0
        streams = [client.generate(request(f"s{i}", 100)) for i in range(2)]
        for s in streams:
            await anext(s)
        runner.crash_next_step(RuntimeError("GPU fell off the bus"))
        for s in streams:
            with pytest.raises(EngineDeadError, match="GPU fell off the bus"):
                async for _ in s:
                    pass
        with pytest.raises(EngineDeadError):
            await run(client, request("after", 2))
    assert len(deaths) == 1 and not engine.is_alive
    assert engine.latest_stats.kv.num_blocks_used == 0


async def test_stop_strings_and_utf8_through_the_detokenizer() -> None:
    """Multi-byte characters are never split and a stop string spanning tokens ends it."""
    text = "café ☕ done. END extra"
    runner = make_fake_runner(script={"u": list(text.encode())})
    async with engine_client(runner) as (client, *_):
        outs = await run(client, request("u", 60, stop=("END",)))
    assert "".join(o.text for o in outs) == "café ☕ done. "
    assert all("\ufffd" not in o.text for o in outs)
    assert outs[-1].finish_reason is FinishReason.STOP and outs[-1].stop_reason == "END"


async def test_abort_and_resubmit_of_the_same_id_in_one_inbox_drain() -> None:
    """An n=2 request aborted and re-submitted under the same id before the engine's next
    drain: the old client closes in the abort itself, so the new request runs to the end and
    the engine stays alive with every block free."""
    async with engine_client(make_fake_runner(sleep_s=0.02)) as (_client, engine, _runner, _):
        loop = asyncio.get_running_loop()
        for round_ in range(5):
            old: asyncio.Queue[Any] = asyncio.Queue()
            engine.submit(request("same", 100, n=2), loop, old)
            while not isinstance(item := await old.get(), GenerationOutput) or not item.token_ids:
                pass
            new: asyncio.Queue[Any] = asyncio.Queue()
            engine.abort("same", AbortReason.CLIENT_CANCEL)  # both land while a step runs
            engine.submit(request("same", 3), loop, new)
            outs: list[GenerationOutput] = []
            while not outs or not outs[-1].finished:
                item = await asyncio.wait_for(new.get(), 5)
                assert isinstance(item, GenerationOutput), (round_, item)
                outs.append(item)
            assert outs[-1].finish_reason is FinishReason.LENGTH, round_
        assert engine.is_alive
        assert engine.latest_stats.kv.num_blocks_used == 0


async def test_a_cancel_at_the_deadline_counts_as_deadline() -> None:
    """A gRPC client's own timer fires before the server's copy of its deadline (which
    started later, by the request's transit time): a cancel within DEADLINE_SLACK_S of the
    deadline is counted as ``deadline``; one well before it as ``client_cancel``. (A busy
    machine only makes the first cancel later, past the deadline: still ``deadline``.)"""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.005)
    async with engine_client(runner, num_blocks=256, max_model_len=1024) as (client, _, _, sink):
        for rid, budget_s, early_s in (
            ("at-deadline", 0.8, DEADLINE_SLACK_S / 2),
            ("early", 600.0, 600.0),  # cancelled after its first token, ~600 s early
        ):
            deadline_s = time.monotonic() + budget_s
            outputs = client.generate(request(rid, 500), deadline_s=deadline_s)
            await anext(outputs)
            await asyncio.sleep(max(0.0, deadline_s - early_s - time.monotonic()))
            await outputs.aclose()  # what a cancelled call does
        await wait_until(lambda: len(sink.requests) == 2)
    assert sink.request("at-deadline").abort_reason == "deadline"
    assert sink.request("early").abort_reason == "client_cancel"
