"""A cancelled stream, an Abort call and a passed deadline each free the request's blocks."""

from __future__ import annotations

import asyncio

import grpc

from model_runner.fake import FakeRunner
from server.rpc import generation_pb2 as pb
from tests.server.helpers import Harness, collect, make_fake_runner, serve, wait_until

# Each step sleeps, so a LONG request is still running when the test acts on it.
STEP_SLEEP_S = 0.01
LONG = 300  # tokens: about three seconds of steps


def _slow_runner() -> FakeRunner:
    return make_fake_runner(max_model_len=1024, sleep_s=STEP_SLEEP_S)


async def _blocks_used(h: Harness) -> int:
    return (await h.client.kv_cache_stats()).num_blocks_used


async def _wait_blocks_free(h: Harness) -> None:
    """Poll GetKVCacheStats until no block is used."""

    async def free() -> bool:
        return await _blocks_used(h) == 0

    await wait_until(free)


async def test_cancelled_stream_aborts_and_returns_its_blocks() -> None:
    """Cancelling the call client-side aborts the request (CLIENT_CANCEL) and frees its blocks."""
    async with serve(_slow_runner()) as h:
        call = h.client.stub.Generate(
            pb.GenerateRequest(text="a long prompt to hold blocks", request_id="cx",
                               stopping=pb.StoppingOptions(max_tokens=LONG))
        )  # fmt: skip
        first = await call.read()
        assert list(first.token_ids) and await _blocks_used(h) > 0
        call.cancel()
        await _wait_blocks_free(h)
        await wait_until(lambda: bool(h.sink.requests))
        record = h.sink.request("cx")
    assert record.finish_reason == "abort" and record.abort_reason == "client_cancel"
    assert record.num_output_tokens < LONG


async def test_closing_the_client_iterator_aborts_the_request() -> None:
    """Leaving KVServeClient.generate early cancels the call and frees the blocks."""
    async with serve(_slow_runner()) as h:
        stream = h.client.generate("some prompt", request_id="early", max_tokens=LONG)
        async for _ in stream:
            break
        await stream.aclose()
        await _wait_blocks_free(h)
    assert h.sink.request("early").abort_reason == "client_cancel"


async def test_abort_call_ends_stream_with_abort_and_frees_blocks() -> None:
    """Abort(found=True) ends the stream with FINISH_REASON_ABORT and frees its blocks."""
    async with serve(_slow_runner()) as h:
        stream = h.client.generate("hold these blocks", request_id="ab", max_tokens=LONG)
        first = await anext(stream)
        assert not first.finished and await _blocks_used(h) > 0
        assert await h.client.abort("ab") is True
        rest = await collect(stream)
        await _wait_blocks_free(h)
        assert await h.client.abort("ab") is False
        assert await h.client.abort("never-existed") is False
    assert rest[-1].finished and rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert rest[-1].usage.completion_tokens < LONG
    assert h.sink.request("ab").abort_reason == "abort_call"


async def test_abort_of_a_waiting_request() -> None:
    """A request still in the waiting queue can be aborted; its stream ends with ABORT."""
    runner = _slow_runner()
    async with serve(runner, max_num_seqs=1, max_num_batched_tokens=64) as h:
        running = h.client.generate("first", request_id="run", max_tokens=LONG)
        await anext(running)
        waiting = h.client.generate("second", request_id="wait", max_tokens=5)
        waiting_task = asyncio.create_task(collect(waiting))
        await wait_until(lambda: h.engine.latest_stats.num_waiting == 1)
        assert await h.client.abort("wait") is True
        msgs = await waiting_task
        assert [m.finish_reason for m in msgs] == [pb.FINISH_REASON_ABORT]
        assert msgs[-1].usage.completion_tokens == 0
        await h.client.abort("run")
        await collect(running)
        await _wait_blocks_free(h)


async def test_passed_deadline_aborts_and_frees_blocks() -> None:
    """A 0.3 s deadline ends the call with DEADLINE_EXCEEDED; the engine aborts (DEADLINE)."""
    async with serve(_slow_runner()) as h:
        try:
            await collect(
                h.client.generate("slow", request_id="dl", max_tokens=LONG, timeout_s=0.3)
            )
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            raise AssertionError("the deadline did not end the call")
        await _wait_blocks_free(h)
    record = h.sink.request("dl")
    assert record.finish_reason == "abort" and record.abort_reason == "deadline"


async def test_cancel_then_immediate_retry_with_the_same_id_keeps_the_engine_alive() -> None:
    """An n=2 stream cancelled mid-decode and retried at once with the same id: every round's
    retry completes, the engine stays alive, and no block stays held."""
    async with serve(_slow_runner()) as h:
        for round_ in range(6):
            call = h.client.stub.Generate(
                pb.GenerateRequest(text="hold blocks", request_id="same", n=2,
                                   stopping=pb.StoppingOptions(max_tokens=LONG))
            )  # fmt: skip
            first = await call.read()
            assert list(first.token_ids), round_
            call.cancel()
            retry = h.client.stub.Generate(
                pb.GenerateRequest(text="retry", request_id="same",
                                   stopping=pb.StoppingOptions(max_tokens=4))
            )  # fmt: skip
            try:
                messages = await collect(retry)
            except grpc.aio.AioRpcError as exc:  # the cancel had not reached the engine yet
                assert exc.code() is grpc.StatusCode.ALREADY_EXISTS, exc
                await _wait_blocks_free(h)  # the cancelled stream gone: the id is free again
                continue
            assert messages[-1].finished and messages[-1].usage.completion_tokens == 4
        assert h.engine.is_alive
        await _wait_blocks_free(h)
