"""Backpressure: a stream its client does not read is parked (kept, not scheduled), resumes
when the client reads, and is aborted (reason ``stalled``) after the stalled-stream timeout."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc
from tests.server.helpers import (
    Harness,
    collect,
    expected_tokens,
    make_fake_runner,
    serve,
    wait_until,
)

NUM_BLOCKS = 320  # of 4 tokens: the never-read stream alone would take 300 of them
NEVER_READ_TOKENS = 1200
READER_TOKENS = 120


def _generate(rid: str, max_tokens: int) -> pb.GenerateRequest:
    """A request whose messages are large (20 top logprobs each), so that the transport's
    own buffers fill after a couple of hundred of them."""
    return pb.GenerateRequest(
        text="x",
        request_id=rid,
        sampling=pb.SamplingOptions(logprobs=20),
        stopping=pb.StoppingOptions(max_tokens=max_tokens),
    )


def _small_window_stub(h: Harness) -> tuple[grpc.aio.Channel, pb_grpc.GenerationStub]:
    """A client channel without BDP probing: its HTTP/2 window stays at 64 KiB, so what the
    transport holds for a stream that is not read stays small and the test stays short.
    (gRPC's default client grows its window to megabytes; kvserve's bound comes after it.)"""
    channel = grpc.aio.insecure_channel(h.address, options=[("grpc.http2.bdp_probe", 0)])
    return channel, pb_grpc.GenerationStub(channel)


async def _never_read_then_readers(
    h: Harness, stub: pb_grpc.GenerationStub
) -> tuple[Any, list[list[int]]]:
    """Open a stream and never read it; once it holds 900 tokens (225 of the 320 blocks) or
    is parked, run three readers to the end. Returns the unread call and the readers'
    tokens."""
    call = stub.Generate(_generate("unread", NEVER_READ_TOKENS))
    await wait_until(
        lambda: (
            h.engine.latest_stats.num_generation_tokens_total >= 900
            or h.engine.latest_stats.num_parked == 1
        ),
        timeout_s=30,
    )
    readers = await asyncio.gather(
        *(collect(h.client.generate("a sixteen-byte p", request_id=f"r{i}",
                                    max_tokens=READER_TOKENS)) for i in range(3))
    )  # fmt: skip
    return call, [[t for m in msgs for t in m.token_ids] for msgs in readers]


async def test_a_never_read_stream_is_parked_without_preempting_others() -> None:
    """Unparked (no bound), a never-read stream grows until the others are preempted; with
    the bound it is parked (kvserve_requests_parked = 1), nobody is preempted, the readers
    get their exact tokens, and after the stalled-stream timeout it is aborted (reason
    stalled) and every block is free."""
    preemptions = {}
    for bound in (10**9, 16):
        runner = make_fake_runner(max_model_len=2048, sleep_s=0.001)
        engine = {"max_unread_outputs": bound, "stalled_stream_timeout_s": 1.0}
        async with serve(runner, num_blocks=NUM_BLOCKS, engine_options=engine) as h:
            channel, stub = _small_window_stub(h)
            call, readers = await _never_read_then_readers(h, stub)
            stats = h.engine.latest_stats
            preemptions[bound] = stats.num_preemptions_total
            if bound == 16:
                assert stats.num_parked == 1
                parked_tokens = stats.num_generation_tokens_total - 3 * READER_TOKENS
                await wait_until(lambda: h.engine.latest_stats.kv.num_blocks_used == 0, 10)
                assert h.engine.latest_stats.num_parked == 0
                record = h.sink.request("unread")
            call.cancel()
            await channel.close()
        for i, tokens in enumerate(readers):
            assert tokens == expected_tokens(runner, f"r{i}", READER_TOKENS)
    assert preemptions[10**9] > 0  # the scenario does preempt without backpressure
    assert preemptions[16] == 0
    assert record.finish_reason == "abort" and record.abort_reason == "stalled"
    assert record.num_output_tokens == parked_tokens < NEVER_READ_TOKENS


async def test_a_parked_stream_resumes_when_its_client_reads() -> None:
    """A client that pauses long enough to be parked, then reads, gets every token in order
    and a normal finish; the request ends parked-free."""
    runner = make_fake_runner(max_model_len=2048)
    engine = {"max_unread_outputs": 8, "stalled_stream_timeout_s": 30.0}
    async with serve(runner, engine_options=engine) as h:
        channel, stub = _small_window_stub(h)
        call = stub.Generate(_generate("slow", 600))
        first = await call.read()
        # Parked for good once the transport is full (a brief park while the event loop
        # catches up with the engine is normal, and ends by itself): no token for 0.3 s.
        samples: list[int] = []

        def settled() -> bool:
            stats = h.engine.latest_stats
            samples.append(stats.num_generation_tokens_total if stats.num_parked == 1 else -1)
            return len(samples) > 3 and len(set(samples[-3:])) == 1 and samples[-1] >= 0

        await wait_until(settled, timeout_s=10, interval_s=0.1)
        held = samples[-1]
        msgs = [first]
        while (msg := await call.read()) is not grpc.aio.EOF:
            msgs.append(msg)
        await channel.close()
        record = h.sink.request("slow")
    assert 0 < held < 600  # parked: the request stopped short of its end while unread
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(runner, "slow", 600)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert record.abort_reason is None and h.engine.latest_stats.num_parked == 0


async def test_the_stalled_abort_says_why() -> None:
    """A client that comes back after the stalled-stream timeout reads what was buffered,
    then the call ends with ABORTED naming the timeout."""
    runner = make_fake_runner(max_model_len=2048)
    engine = {"max_unread_outputs": 8, "stalled_stream_timeout_s": 0.3}
    async with serve(runner, engine_options=engine) as h:
        channel, stub = _small_window_stub(h)
        call = stub.Generate(_generate("late", 600))
        await call.read()
        start = time.monotonic()
        await wait_until(lambda: bool(h.sink.requests), timeout_s=10)
        waited = time.monotonic() - start
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
            code, details = grpc.StatusCode.OK, ""
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        await channel.close()
    assert waited >= 0.3
    assert code == grpc.StatusCode.ABORTED
    assert "read nothing for 0.3s" in details and "--stalled-stream-timeout-s" in details
    assert h.sink.request("late").abort_reason == "stalled"
