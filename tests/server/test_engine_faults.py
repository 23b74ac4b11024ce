"""The engine failing from inside: a step that raises (the forward pass, the sampler, the
structured-output masks), K failed steps in a row (the engine dies), and a KV tier that
cannot move bytes. Each case pins what the clients see on both APIs, that every block is
freed once (the cache manager's invariants), health, and the server's exit code."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runner.fake import FakeRunner
from server.fake_tokenizer import ByteTokenizer
from tests.server.helpers import (
    Harness,
    assert_idle_and_sound,
    collect,
    make_fake_runner,
    serve,
    wait_until,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
LONG = 1000  # max_tokens of a request that is still running when the step fails


async def _status(call: Any, started: asyncio.Event | None = None) -> tuple[grpc.StatusCode, str]:
    """How a gRPC stream ended, read to its end (``started`` set at its first message)."""
    try:
        async for _ in call:
            if started is not None:
                started.set()
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def _sse(http: httpx.AsyncClient, rid: str, started: asyncio.Event) -> list[str]:
    """A streamed completion's data lines, to the end."""
    body = {"prompt": "stream me", "max_tokens": LONG, "stream": True}
    lines: list[str] = []
    headers = {"X-Request-Id": rid}
    async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
    return lines


async def _whole(http: httpx.AsyncClient, rid: str) -> httpx.Response:
    body = {"prompt": "whole", "max_tokens": LONG}
    return await http.post("/v1/completions", json=body, headers={"X-Request-Id": rid})


async def _health(h: Harness, http: httpx.AsyncClient) -> tuple[list[int], int]:
    stub = health_pb2_grpc.HealthStub(h.channel)
    grpc_statuses = [
        (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
        for name in ("", "kvserve.v1.Generation")
    ]
    return grpc_statuses, (await http.get("/health")).status_code


async def _in_flight_on_both_apis(
    h: Harness, http: httpx.AsyncClient, fail: Any
) -> tuple[list[tuple[grpc.StatusCode, str]], list[str], httpx.Response]:
    """Two gRPC streams, one SSE stream and one whole completion running (every stream read
    all along, so none is parked out of the step); then ``fail()``; how each ended."""
    started = [asyncio.Event() for _ in range(3)]
    streams = [
        asyncio.create_task(
            _status(h.client.generate("grpc", request_id=f"g{i}", max_tokens=LONG), started[i])
        )
        for i in range(2)
    ]
    sse = asyncio.create_task(_sse(http, "h-stream", started[2]))
    whole = asyncio.create_task(_whole(http, "h-whole"))
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    await wait_until(lambda: h.engine.latest_stats.num_running == 4, timeout_s=60)
    fail()
    codes = await asyncio.gather(*streams)
    return codes, await sse, await whole


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "one-step-ahead"])
async def test_forward_error_fails_the_step_on_both_apis_and_keeps_serving(ahead: bool) -> None:
    """A step whose forward raises once (also on the fake device, one step ahead): its 4
    requests get INTERNAL / an SSE error event then [DONE] / a 500 JSON error, their blocks
    are freed, health stays SERVING and the next request is served."""
    runner = make_fake_runner(max_model_len=4096, sleep_s=0.005, step_thread=ahead)
    served = serve(runner, http=True, num_blocks=2048, engine_options={"overlap": ahead})
    async with served as h, httpx.AsyncClient(base_url=h.http_url, timeout=60) as http:
        crash = RuntimeError("CUDA error: an illegal memory access was encountered")
        codes, sse, whole = await _in_flight_on_both_apis(
            h, http, lambda: runner.crash_next_step(crash)
        )
        assert_idle_and_sound(h)
        health = await _health(h, http)
        after = await collect(h.client.generate("after", request_id="after", max_tokens=3))
        alive = h.engine.is_alive
    assert [c for c, _ in codes] == [grpc.StatusCode.INTERNAL] * 2
    assert all("the model step failed" in d and "illegal memory access" in d for _, d in codes)
    assert sse[-1] == "[DONE]"
    error = json.loads(sse[-2])["error"]
    assert error["type"] == "internal_error" and "illegal memory access" in error["message"]
    assert all("error" not in json.loads(x) for x in sse[:-2])
    assert whole.status_code == 500
    assert "illegal memory access" in whole.json()["error"]["message"]
    assert health == ([health_pb2.HealthCheckResponse.SERVING] * 2, 200)
    assert sum(len(m.token_ids) for m in after) == 3
    assert h.engine.num_failed_steps_total == 1 and alive
    assert {h.sink.request(r).finish_reason for r in ("h-stream", "h-whole")} == {"error"}


async def test_engine_death_fails_every_request_on_both_apis_and_exits_1() -> None:
    """With no failed step to spare the first one kills the engine: UNAVAILABLE, an SSE
    service_unavailable event then [DONE], a 503; blocks freed, health NOT_SERVING on gRPC
    and HTTP, wait() returns 1 and a later request is refused."""
    runner = make_fake_runner(max_model_len=4096, sleep_s=0.005)
    options = {"max_step_failures": 0}
    served = serve(runner, http=True, num_blocks=2048, engine_options=options)
    async with served as h, httpx.AsyncClient(base_url=h.http_url, timeout=60) as http:
        codes, sse, whole = await _in_flight_on_both_apis(h, http, runner.crash_next_step)
        exit_code = await asyncio.wait_for(h.server.wait(), 60)
        assert_idle_and_sound(h)
        health = await _health(h, http)
        late = await _whole(http, "late")
    assert [c for c, _ in codes] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert all("engine loop died" in d and "fake runner died" in d for _, d in codes)
    assert sse[-1] == "[DONE]"
    assert json.loads(sse[-2])["error"]["type"] == "service_unavailable"
    assert whole.status_code == 503 and "fake runner died" in whole.json()["error"]["message"]
    assert exit_code == 1
    assert health == ([health_pb2.HealthCheckResponse.NOT_SERVING] * 2, 503)
    assert late.status_code == 503


async def test_engine_death_after_max_step_failures_in_a_row() -> None:
    """max_step_failures=1: a failed step fails its request (INTERNAL) and a success resets
    the count; a dead device then fails one request, and the next failed step in a row kills
    the engine (UNAVAILABLE, exit 1), blocks back to 0 each time; the steps that failed are
    counted in kvserve_engine_failed_steps_total."""
    from prometheus_client import CollectorRegistry

    from metrics.prometheus import PrometheusSink
    from tests.metrics.helpers import value

    registry = CollectorRegistry()
    runner = make_fake_runner(max_model_len=4096, sleep_s=0.002)
    async with serve(runner, engine_options={"max_step_failures": 1}) as h:
        h.engine.sink = PrometheusSink(registry)
        results = []
        for i, fail in enumerate(["once", None, "once", None, "dead", None]):
            if fail == "once":
                runner.crash_next_step(RuntimeError(f"transient {i}"))
            elif fail == "dead":
                runner.crash_every_step()
            results.append(await _status(h.client.generate("x", request_id=f"r{i}", max_tokens=4)))
            assert_idle_and_sound(h)
        exit_code = await asyncio.wait_for(h.server.wait(), 60)
    assert [c for c, _ in results] == [
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.OK,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.OK,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
    ]
    assert "transient 0" in results[0][1] and "fake runner is dead" in results[4][1]
    assert "2 steps in a row failed" in results[5][1]
    assert exit_code == 1 and h.engine.num_failed_steps_total == 4
    # The last failed step killed the engine before it was recorded.
    assert value(registry, "kvserve_engine_failed_steps_total") == 3


def test_max_step_failures_below_0_is_refused() -> None:
    """A negative bound is refused when the engine is built, naming the setting."""
    from tests.server.helpers import build_server

    with pytest.raises(ValueError, match="max_step_failures must be >= 0"):
        build_server(FakeRunner(), ByteTokenizer(), engine_options={"max_step_failures": -1})


class _FailOnce:
    """Wraps a callable; the first call for which ``when(*args)`` holds raises ``exc`` (once)."""

    def __init__(self, fn: Any, when: Any, exc: Exception) -> None:
        self.fn, self.when, self.exc, self.raised = fn, when, exc, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.raised and self.when(*args):
            self.raised = True
            raise self.exc
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize(
    ("where", "ahead"), [("forward", False), ("sampler", False), ("forward", True)]
)
async def test_forward_error_in_a_torch_runner_on_cpu_fails_the_step_then_serves_exactly(
    where: str, ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny random llama on CPU (also on its step thread, one step ahead) whose forward
    pass (or sampler) raises once mid-decode, on the first step that holds both requests
    (when they are admitted is up to the engine: a fixed call count could catch one alone):
    both get INTERNAL naming the error, blocks are freed, and the same prompts then give the
    greedy tokens they gave before the fault."""
    from tests.model_runner.oracle import make_runner, random_ids, tiny_hf

    runner = make_runner(tiny_hf("llama", seed=3), num_blocks=64, block_size=4)
    runner.use_step_thread(ahead)
    prompts = [random_ids(6, seed=71), random_ids(9, seed=72)]

    async def both(tag: str) -> list[Any]:
        calls = [
            h.client.generate(p, request_id=f"{tag}{i}", max_tokens=8, temperature=0.0,
                              ignore_eos=True)
            for i, p in enumerate(prompts)
        ]  # fmt: skip
        return await asyncio.gather(*(collect(c) for c in calls), return_exceptions=True)

    served = serve(
        runner, ByteTokenizer(), max_num_seqs=4, max_num_batched_tokens=64,
        engine_options={"overlap": ahead},
    )  # fmt: skip
    async with served as h:
        assert h.engine.overlap == ahead
        before = [[t for m in msgs for t in m.token_ids] for msgs in await both("a")]
        crash = RuntimeError(f"injected {where} failure")
        owner = runner.paths if where == "forward" else runner.sampler
        name = "forward" if where == "forward" else "launch"
        # forward(paths, step): both decoding; launch(sampler, logits, ...): two rows.
        both_in = (
            (lambda _o, step, *_: len(step.decode) == 2 and not step.prefill)
            if where == "forward"
            else (lambda _o, logits, *_: logits.shape[0] == 2)
        )
        fail = _FailOnce(getattr(type(owner), name), both_in, crash)
        monkeypatch.setattr(type(owner), name, lambda *a, **k: fail(*a, **k))
        failed = await both("b")
        assert_idle_and_sound(h)
        after = [[t for m in msgs for t in m.token_ids] for msgs in await both("c")]
    runner.use_step_thread(False)
    assert fail.raised
    assert [type(e).__name__ for e in failed] == ["AioRpcError"] * 2
    assert {e.code() for e in failed} == {grpc.StatusCode.INTERNAL}
    assert all(f"injected {where} failure" in e.details() for e in failed)
    assert after == before and all(len(t) == 8 for t in before)


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "one-step-ahead"])
async def test_forward_error_that_leaves_nan_in_the_kv_poisons_no_later_request(
    ahead: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward pass that writes NaN into its step's blocks, then raises (sync: a decode;
    one step ahead: a prompt's first chunk, so the next chunk, already submitted, spreads the
    NaN into a new block): the request fails, and the next one, on those same blocks (the
    pool holds 3), gets the greedy tokens it gets on a fresh runner (the engine had the
    runner scrub them, those of the step behind too; without, NaN logits)."""
    from model_runner.paths import ForwardPaths
    from tests.model_runner.oracle import make_runner, random_ids, tiny_hf

    hf = tiny_hf("llama", seed=3)
    # One step ahead the first prompt takes 3 chunks of 4: the second one runs behind the
    # failed first one without sampling (nothing in the runner sees its NaN).
    first, second = random_ids(10 if ahead else 6, seed=81), random_ids(5, seed=82)
    chunk = 4 if ahead else 64

    async def tokens(prompt: list[int], rid: str, max_tokens: int = 6) -> list[int] | str:
        try:
            msgs = await collect(
                h.client.generate(prompt, request_id=rid, max_tokens=max_tokens, temperature=0.0,
                                  ignore_eos=True)
            )  # fmt: skip
        except grpc.aio.AioRpcError as exc:
            return exc.details() or ""
        return [t for m in msgs for t in m.token_ids]

    fresh = make_runner(hf, num_blocks=3, block_size=4)
    async with serve(fresh, ByteTokenizer(), max_num_batched_tokens=chunk, max_num_seqs=2) as h:
        want = await tokens(second, "want")
    runner = make_runner(hf, num_blocks=3, block_size=4)
    runner.use_step_thread(ahead)
    forward, calls = ForwardPaths.forward, []

    def poisoning(self: ForwardPaths, step: Any) -> Any:
        if self is not runner.paths:  # another test's runner, still stepping
            return forward(self, step)
        calls.append(step)
        if len(calls) == (1 if ahead else 3):  # the first chunk / the second decode
            blocks = sorted({b for s in step.seqs for b in s.block_ids})
            runner.pool.data[:, :, blocks] = float("nan")
            raise RuntimeError("injected: NaN in the KV, then a failure")
        return forward(self, step)

    monkeypatch.setattr(ForwardPaths, "forward", poisoning)
    served = serve(
        runner,
        ByteTokenizer(),
        max_num_batched_tokens=chunk,
        max_num_seqs=2,
        engine_options={"overlap": ahead},
    )
    async with served as h:
        failed = await tokens(first, "nan", max_tokens=2 if ahead else 6)
        assert_idle_and_sound(h)
        got = await tokens(second, "next")
    runner.use_step_thread(False)
    assert isinstance(failed, str) and "injected: NaN in the KV" in failed
    assert isinstance(want, list) and len(want) == 6
    assert got == want


async def test_forward_error_in_the_constraint_masks_fails_the_step_then_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The structured-output engine raising (not a ConstraintError: a bug, a library
    failure) fails the step like a forward error: INTERNAL naming it, blocks freed, the
    next constrained request matches its regex."""
    from model_runner.constraints import ConstraintCompiler, ConstraintTracker

    tracker = ConstraintTracker(ConstraintCompiler(ByteTokenizer()))
    runner = make_fake_runner(max_model_len=2048, constraints=tracker)
    calls = iter(range(1, 1000))  # the second call raises
    fail = _FailOnce(
        ConstraintTracker.compute_masks,
        lambda *_: next(calls) == 2,
        RuntimeError("matcher state lost"),
    )
    monkeypatch.setattr(ConstraintTracker, "compute_masks", lambda *a, **k: fail(*a, **k))
    async with serve(runner) as h:
        code, details = await _status(
            h.client.generate("go", request_id="c1", regex="[a-c]{8}!", max_tokens=20)
        )
        assert_idle_and_sound(h)
        text, last = await h.client.generate_text(
            "go", request_id="c2", regex="[a-c]{4}!", max_tokens=20
        )
    assert code == grpc.StatusCode.INTERNAL and "matcher state lost" in details
    assert re.fullmatch("[a-c]{4}!", text) and last.finish_reason == 1


async def test_engine_death_on_a_kv_tier_error_frees_blocks_and_exits_1(tmp_path: Path) -> None:
    """Tier 2 failing to write restored bytes into the pool kills the engine at once (the
    pool can no longer be trusted): the request gets UNAVAILABLE, blocks are freed, health
    NOT_SERVING, wait() returns 1."""
    from server.build import build_engine
    from server.client import KVServeClient
    from server.config import ServerConfig
    from server.lifecycle import KVServeServer

    cfg = ServerConfig(
        runner="fake", num_blocks=8, block_size=4, kv_disk_dir=str(tmp_path), metrics=False
    )
    built = build_engine(cfg)
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    port = await server.start("127.0.0.1", 0)
    client = KVServeClient(f"127.0.0.1:{port}")
    tier = built.engine.tier
    try:
        await client.wait_ready()
        prompt = "abcdefghijklmnopq"  # 4 full blocks; "b" evicts two of them to tier 2
        await collect(client.generate(prompt, request_id="a", max_tokens=2))
        await collect(client.generate("zyxwvutsrqponmlkjihgf", request_id="b", max_tokens=2))

        def broken(*args: Any) -> None:
            raise OSError("pool write failed")

        tier.io.write_blocks = broken  # type: ignore[attr-defined]
        code, details = await _status(client.generate(prompt, request_id="c", max_tokens=2))
        exit_code = await asyncio.wait_for(server.wait(), 60)
        stats = built.engine.latest_stats
        built.scheduler.kv.check_invariants()
        health = await health_pb2_grpc.HealthStub(client.channel).Check(
            health_pb2.HealthCheckRequest(service="")
        )
    finally:
        await client.close()
        await server.shutdown(grace_s=0.5)
    assert code == grpc.StatusCode.UNAVAILABLE and "pool write failed" in details
    assert exit_code == 1 and stats.kv.num_blocks_used == 0
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("api", ["grpc", "http"])
async def test_vanish_16_streams_whose_client_process_is_killed(api: str) -> None:
    """A client process with 16 long streams open is SIGKILLed once each has a token (and
    0.5 s more): every request is aborted (client_cancel), blocks are back to 0, the engine
    and the scheduler hold no request and no server task is left."""
    runner = make_fake_runner(max_model_len=4096, sleep_s=0.01)
    async with serve(runner, http=True, num_blocks=4096) as h:
        baseline = len(asyncio.all_tasks())
        target = h.address if api == "grpc" else h.http_url
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.server.vanishing_client", api, target, "16", "1000",
            cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert line == b"ready\n", line
            await asyncio.sleep(0.5)  # mid-stream: 1000 tokens take 10 s at least
            assert h.engine.latest_stats.num_running == 16
        finally:
            proc.kill()
            await proc.wait()
        await wait_until(lambda: len(h.sink.requests) == 16, timeout_s=60)
        assert_idle_and_sound(h)
        await wait_until(lambda: len(asyncio.all_tasks()) <= baseline, timeout_s=60)
        in_flight = (h.server.client.num_in_flight, h.engine.outputs.num_clients)
        scheduled = (h.scheduler.running_request_ids(), h.scheduler.waiting_request_ids())
    records = [h.sink.request(f"v{i}") for i in range(16)]
    assert {r.abort_reason for r in records} == {"client_cancel"}
    assert all(0 < r.num_output_tokens < 1000 for r in records)
    assert in_flight == (0, 0) and scheduled == ([], [])
