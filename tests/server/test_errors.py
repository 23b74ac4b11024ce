"""Status codes: bad input, overload, a failing request, a dying runner, shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from server.rpc import generation_pb2 as pb
from tests.server.helpers import (
    collect,
    engine_id,
    expected_tokens,
    make_fake_runner,
    serve,
    wait_until,
)

S = pb.SamplingOptions
T = pb.StoppingOptions
CHAT = pb.ChatMessages
MSG = pb.ChatMessage

# (name, request, substrings the error message must contain). Context 128, vocab 258.
BAD_INPUTS: list[tuple[str, pb.GenerateRequest, tuple[str, ...]]] = [
    ("no input", pb.GenerateRequest(), ("input is required", "text, token_ids or chat")),
    ("empty text", pb.GenerateRequest(text=""), ("empty",)),
    ("empty token ids", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), ("empty",)),
    (
        "prompt longer than the context",
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 200)),
        ("200 tokens", "context is 128", "at most 127"),
    ),
    (
        "prompt equal to the context",
        pb.GenerateRequest(text="x" * 127),  # + BOS = 128 tokens
        ("128 tokens", "context is 128"),
    ),
    ("max_tokens 0", pb.GenerateRequest(text="hi", stopping=T(max_tokens=0)),
     ("max_tokens must be >= 1", "got 0")),
    ("max_tokens negative", pb.GenerateRequest(text="hi", stopping=T(max_tokens=-5)),
     ("max_tokens must be >= 1", "got -5")),
    ("max_tokens beyond the context", pb.GenerateRequest(text="hi", stopping=T(max_tokens=1000)),
     ("1000", "context of 128")),
    ("max_tokens beyond what the prompt leaves",
     pb.GenerateRequest(text="x" * 99, stopping=T(max_tokens=30)),  # 100 prompt tokens
     ("prompt has 100 tokens", "must be in [1, 28]")),
    ("min_tokens above max_tokens",
     pb.GenerateRequest(text="hi", stopping=T(max_tokens=4, min_tokens=9)),
     ("min_tokens", "[0, max_tokens=4]", "got 9")),
    ("negative temperature", pb.GenerateRequest(text="hi", sampling=S(temperature=-0.5)),
     ("temperature must be >= 0", "-0.5")),
    ("nan temperature", pb.GenerateRequest(text="hi", sampling=S(temperature=float("nan"))),
     ("temperature",)),
    ("top_p zero", pb.GenerateRequest(text="hi", sampling=S(top_p=0.0)), ("top_p", "(0, 1]")),
    ("top_p above one", pb.GenerateRequest(text="hi", sampling=S(top_p=1.5)),
     ("top_p", "(0, 1]", "1.5")),
    ("top_k zero", pb.GenerateRequest(text="hi", sampling=S(top_k=0)), ("top_k must be >= 1",)),
    ("min_p above one", pb.GenerateRequest(text="hi", sampling=S(min_p=2.0)), ("min_p", "[0, 1]")),
    ("repetition_penalty zero", pb.GenerateRequest(text="hi", sampling=S(repetition_penalty=0)),
     ("repetition_penalty must be > 0",)),
    ("presence_penalty out of range", pb.GenerateRequest(text="hi", sampling=S(presence_penalty=3)),
     ("presence_penalty", "[-2, 2]")),
    ("logprobs too many", pb.GenerateRequest(text="hi", sampling=S(logprobs=21)),
     ("logprobs", "[0, 20]", "21")),
    ("token id outside the vocabulary",
     pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 258])),
     ("token_ids.ids[2] = 258", "[0, 257]")),
    ("stop token id outside the vocabulary",
     pb.GenerateRequest(text="hi", stopping=T(stop_token_ids=[9999])),
     ("stop_token_ids[0] = 9999", "[0, 257]")),
    ("empty stop string", pb.GenerateRequest(text="hi", stopping=T(stop=["ok", ""])),
     ("stop[1] is empty",)),
    ("unknown chat role",
     pb.GenerateRequest(chat=CHAT(messages=[MSG(role="user", content="a"),
                                            MSG(role="wizard", content="b")])),
     ("messages[1].role", "system, user, assistant, tool", "'wizard'")),
    ("empty chat", pb.GenerateRequest(chat=CHAT()), ("at least one message",)),
    ("n zero", pb.GenerateRequest(text="hi", n=0), ("n must be >= 1",)),
    ("n too large", pb.GenerateRequest(text="hi", n=50), ("n must be in [1, 8]", "50")),
    ("request id too long", pb.GenerateRequest(text="hi", request_id="x" * 300),
     ("request_id", "256")),
    ("negative TTFT target", pb.GenerateRequest(text="hi", slo=pb.LatencyTargets(ttft_ms=-1)),
     ("slo.ttft_ms", "milliseconds", "got -1")),
    ("NaN ITL target",
     pb.GenerateRequest(text="hi", slo=pb.LatencyTargets(itl_ms=float("nan"))),
     ("slo.itl_ms", "got nan")),
]  # fmt: skip


async def _status(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_bad_inputs_get_invalid_argument_with_the_allowed_range() -> None:
    """Each bad request gets INVALID_ARGUMENT naming the problem; a good one then succeeds."""
    async with serve() as h:
        for name, request, needles in BAD_INPUTS:
            code, details = await _status(h.client.stub.Generate(request))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
            for needle in needles:
                assert needle in details, (name, needle, details)
        msgs = await collect(h.client.generate("hi", request_id="ok", max_tokens=3))
    assert [t for m in msgs for t in m.token_ids] == expected_tokens(h.runner, "ok", 3)
    assert h.sink.rejected.count("invalid") == len(BAD_INPUTS)


async def test_invalid_utf8_in_a_stop_string_is_invalid_argument() -> None:
    """Raw bytes with a non-UTF-8 stop string (proto strings must be UTF-8): INVALID_ARGUMENT.

    Our stubs cannot even build such a message, so it is sent as hand-encoded bytes; without
    the server's lenient deserializer gRPC would answer UNKNOWN.
    """
    # GenerateRequest{text="hi" (field 1), stopping (field 5){stop (field 3) = b"\xff\xfe"}}
    raw = b"\x0a\x02hi" + b"\x2a\x04" + b"\x1a\x02\xff\xfe"
    async with serve() as h:
        method = h.channel.unary_stream(
            "/kvserve.v1.Generation/Generate",
            request_serializer=lambda b: b,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        code, details = await _status(method(raw))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in details and "UTF-8" in details
        # A Python str with a lone surrogate cannot be encoded by the client at all.
        with pytest.raises(UnicodeEncodeError, match="surrogates not allowed"):
            pb.GenerateRequest(text="hi", stopping=T(stop=["\udcff"])).SerializeToString()
        msgs = await collect(h.client.generate("hi", request_id="after", max_tokens=2))
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_tokenize_rejects_missing_input_and_unknown_role() -> None:
    """Tokenize validates like Generate: INVALID_ARGUMENT with the reason."""
    async with serve() as h:
        with pytest.raises(grpc.aio.AioRpcError) as no_input:
            await h.client.stub.Tokenize(pb.TokenizeRequest())
        with pytest.raises(grpc.aio.AioRpcError) as bad_role:
            await h.client.tokenize(chat=[("robot", "x")])
    assert no_input.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text or chat" in (no_input.value.details() or "")
    assert bad_role.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'robot'" in (bad_role.value.details() or "")


async def test_overload_gets_resource_exhausted() -> None:
    """With one seat and one waiting slot, a third request is refused at once."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(
        runner, max_num_seqs=1, max_num_batched_tokens=64, max_waiting_requests=1
    ) as h:
        running = h.client.generate("a", request_id="a", max_tokens=1000)  # until aborted
        await anext(running)
        waiting = asyncio.create_task(collect(h.client.generate("b", request_id="b", max_tokens=2)))
        await wait_until(lambda: h.engine.latest_stats.num_waiting == 1)
        code, details = await _status(h.client.generate("c", request_id="c", max_tokens=2))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting_requests=1" in details
        await h.client.abort("a")
        await collect(running)
        b_msgs = await waiting
    assert [t for m in b_msgs for t in m.token_ids] == expected_tokens(h.runner, "b", 2)
    assert h.sink.rejected == ["overload"]
    assert ("Generate", "RESOURCE_EXHAUSTED") in h.sink.rpcs


async def test_failing_request_gets_internal_while_neighbours_finish() -> None:
    """A request the runner fails ends with INTERNAL; the others in its batch complete."""
    runner = make_fake_runner(sleep_s=0.005)
    runner.fail_request(engine_id("bad"), "sampler blew up")
    async with serve(runner) as h:
        results = await asyncio.gather(
            *(_status(h.client.generate("p", request_id=rid, max_tokens=10))
              for rid in ("n1", "bad", "n2")),
        )  # fmt: skip
        n1 = await collect(h.client.generate("p", request_id="n3", max_tokens=4))
        stats = await h.client.kv_cache_stats()
    assert results[0] == (grpc.StatusCode.OK, "")
    assert results[2] == (grpc.StatusCode.OK, "")
    code, details = results[1]
    assert code == grpc.StatusCode.INTERNAL
    assert "'bad'" in details and "sampler blew up" in details
    assert [t for m in n1 for t in m.token_ids] == expected_tokens(h.runner, "n3", 4)
    assert stats.num_blocks_used == 0
    assert h.sink.request("bad").finish_reason == "error"


async def test_runner_death_fails_in_flight_with_unavailable_and_not_serving() -> None:
    """When the runner raises, streams get UNAVAILABLE, health NOT_SERVING, wait() returns 1."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner) as h:
        streams = [h.client.generate("x", request_id=f"d{i}", max_tokens=300) for i in range(3)]
        for s in streams:
            await anext(s)
        h.engine.max_step_failures = 0  # the first failed step kills the engine
        runner.crash_next_step()
        codes = await asyncio.gather(*(_status(s) for s in streams))
        exit_code = await asyncio.wait_for(h.server.wait(), 60)
        health = health_pb2_grpc.HealthStub(h.channel)
        statuses = [
            (await health.Check(health_pb2.HealthCheckRequest(service=name))).status
            for name in ("", "kvserve.v1.Generation")
        ]
        after, _ = await _status(h.client.generate("y", request_id="late", max_tokens=2))
    assert [c for c, _ in codes] == [grpc.StatusCode.UNAVAILABLE] * 3
    assert "fake runner died" in codes[0][1]
    assert exit_code == 1
    assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2
    assert after == grpc.StatusCode.UNAVAILABLE


async def test_graceful_shutdown_drains_in_flight_and_refuses_new_calls() -> None:
    """shutdown(): NOT_SERVING and UNAVAILABLE for new calls; the in-flight stream completes."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner) as h:
        # 2 s of steps: still draining while the new call and the health check are made.
        stream = h.client.generate("x", request_id="drain", max_tokens=200)
        await anext(stream)
        rest_task = asyncio.create_task(collect(stream))
        shutdown = asyncio.create_task(h.server.shutdown(grace_s=60.0))
        health = health_pb2_grpc.HealthStub(h.channel)

        async def not_serving() -> bool:
            status = (await health.Check(health_pb2.HealthCheckRequest())).status
            return bool(status == health_pb2.HealthCheckResponse.NOT_SERVING)

        await wait_until(not_serving)
        code, details = await _status(h.client.generate("y", request_id="new", max_tokens=2))
        rest = await rest_task
        await shutdown
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert rest[-1].usage.completion_tokens == 200


async def test_shutdown_grace_period_aborts_what_is_left() -> None:
    """In-flight requests still running when the grace period ends are aborted (SHUTDOWN)
    and their calls end with UNAVAILABLE, so the client knows to retry elsewhere."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner) as h:
        stream = h.client.generate("x", request_id="cut", max_tokens=500)
        await anext(stream)
        rest_task = asyncio.create_task(_status(stream))
        await h.server.shutdown(grace_s=0.1)
        code, details = await rest_task
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "'cut' was cut off: the server shut down" in details
    assert h.sink.request("cut").abort_reason == "shutdown"
