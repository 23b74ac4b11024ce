"""One table of edge cases, run against ``kvserve serve`` and against a 2-replica ``kvserve
cluster serve`` with the same flags (edge_targets.FLAGS) and the same expected answers: a
difference between the two is a failing test.

Each row: hostile bodies, slow and idle connections, a connection flood, keys, request ids,
Abort, the per-key queue share, metrics behind the admin key, the internal route, quiet
refusals, and (last: it stops the target) a drain on SIGTERM to the process group. After
every row the target still serves a normal request and its KV blocks in use return to 0.
The cluster column starts Ray (slow), once for the module."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator

import grpc
import httpx
import pytest

from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc
from tests.cluster.edge_targets import (
    ADMIN,
    ALICE,
    BOB,
    GRACE_S,
    HTTP_CAP,
    MAX_REQUEST_BYTES,
    TIMEOUT_S,
    Target,
    auth,
    grpc_auth,
    start_target,
)
from tests.server.helpers import hostile_connections, wait_until

TARGETS = ["single", pytest.param("cluster", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=TARGETS)
def target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Target]:
    started = start_target(request.param, tmp_path_factory.mktemp(request.param))
    try:
        yield started
    finally:
        started.stop()
        print(f"{started.name} log (tail):\n{started.log.read_text()[-3000:]}")


def gauge(target: Target, name: str, labels: str = "") -> float:
    """A gauge (its series with ``labels``), summed over every replica's /metrics."""
    total = 0.0
    for address in target.metrics_addresses():
        text = httpx.get(f"http://{address}/metrics", headers=auth(ADMIN), timeout=10).text
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")) and labels in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def blocks_used(target: Target) -> float:
    """KV blocks in use, over every replica."""
    return gauge(target, "kvserve_kv_cache_blocks", 'state="used"')


def in_flight(target: Target) -> float:
    """Requests running or waiting, over every replica."""
    return gauge(target, "kvserve_requests_running") + gauge(target, "kvserve_requests_waiting")


async def complete(
    target: Target, key: str = ALICE, max_tokens: int = 4, **headers: str
) -> httpx.Response:
    async with httpx.AsyncClient(base_url=target.http_url, timeout=60) as http:
        return await http.post(
            "/v1/completions",
            json={"model": "fake", "prompt": "hello", "max_tokens": max_tokens},
            headers={**auth(key), **headers},
        )


@pytest.fixture(autouse=True)
async def nothing_lost(target: Target) -> AsyncIterator[None]:
    """After each row: a normal request is served and no KV block stays in use."""
    yield
    if target.proc.poll() is not None:
        return  # the drain row stopped it
    reply = await complete(target)
    assert reply.status_code == 200, reply.text
    await wait_until(lambda: blocks_used(target) == 0, timeout_s=60)


async def generate(
    target: Target, key: str, request_id: str, max_tokens: int, text: str = "stream"
) -> AsyncIterator[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            text=text, request_id=request_id, stopping=pb.StoppingOptions(max_tokens=max_tokens)
        )
        async for response in stub.Generate(request, metadata=grpc_auth(key), timeout=120):
            yield response


# ------------------------------------------------------------------------------- the rows
async def test_hostile_bodies_get_a_4xx(target: Target) -> None:
    """Nested JSON, an out-of-range integer and a non-JSON body are 400s, a body over
    --max-request-bytes is a 413 before it is read, and a gRPC message over it is
    RESOURCE_EXHAUSTED."""
    async with httpx.AsyncClient(base_url=target.http_url, timeout=60) as http:
        nested = "[" * 5000 + "]" * 5000
        codes = [
            (
                await http.post(
                    "/v1/completions", content=body, headers=auth(ALICE) | {"content-type": kind}
                )
            ).status_code
            for body, kind in (
                (f'{{"model": "fake", "prompt": {nested}}}', "application/json"),
                ('{"model": "fake", "prompt": "x", "max_tokens": 1e400}', "application/json"),
                ("not json", "application/json"),
                ("x" * (MAX_REQUEST_BYTES + 1), "application/json"),
            )
        ]
    assert codes == [400, 400, 400, 413]
    with pytest.raises(grpc.aio.AioRpcError) as big:
        async for _ in generate(target, ALICE, "big", 1, text="x" * (MAX_REQUEST_BYTES + 1)):
            pass
    assert big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_silent_slow_and_idle_connections_are_closed_in_time(target: Target) -> None:
    """A connection that sends nothing, one that drips its headers, one whose body stops,
    and one idle after a served request are each closed after the 1 s timeouts (within
    5 s)."""
    head, closed = await hostile_connections(
        target.http_port,
        b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
        b"content-type: application/json\r\nauthorization: Bearer " + ALICE.encode() + b"\r\n\r\n{",
        limit_s=30.0,
    )
    assert head.startswith(b"HTTP/1.1 200")
    assert all(TIMEOUT_S - 0.1 <= s < 5.0 for s in closed), closed


async def test_a_connection_flood_leaves_new_and_busy_clients_served(target: Target) -> None:
    """Twice --http-max-connections idle connections: a new client is served at once (the
    longest idle ones make room), a keep-alive client that keeps asking sees no error, and
    a gRPC client is served too."""
    async with httpx.AsyncClient(base_url=target.http_url, timeout=30) as busy:
        stop = asyncio.Event()
        errors: list[BaseException] = []

        async def keep_asking() -> int:
            n = 0
            while not stop.is_set():
                try:
                    assert (await busy.get("/health")).status_code == 200
                    n += 1
                except (httpx.HTTPError, AssertionError) as exc:
                    errors.append(exc)
            return n

        asking = asyncio.create_task(keep_asking())
        flood = [
            await asyncio.open_connection("127.0.0.1", target.http_port)
            for _ in range(2 * HTTP_CAP)
        ]
        t0 = time.monotonic()
        reply = await complete(target)
        took_s = time.monotonic() - t0
        grpc_reply = [r async for r in generate(target, ALICE, "during-flood", 2)]
        stop.set()
        num_asked = await asking
        for _, writer in flood:
            writer.close()
    assert reply.status_code == 200 and took_s < 5.0, (reply.status_code, took_s)
    assert grpc_reply[-1].finished
    assert errors == [] and num_asked > 0


async def test_keys_are_required_and_health_stays_open(target: Target) -> None:
    """No key and a wrong key get 401 (HTTP) / UNAUTHENTICATED (gRPC); /health is open."""
    async with httpx.AsyncClient(base_url=target.http_url, timeout=30) as http:
        body = {"model": "fake", "prompt": "x", "max_tokens": 1}
        none = await http.post("/v1/completions", json=body)
        wrong = await http.post("/v1/completions", json=body, headers=auth("nope"))
        health = await http.get("/health")
    assert (none.status_code, wrong.status_code, health.status_code) == (401, 401, 200)
    assert none.json()["error"]["type"] == "authentication_error"
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        async for _ in generate(target, "nope", "k-1", 1):
            pass
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_duplicate_in_flight_id_of_one_key_is_refused(target: Target) -> None:
    """While Alice's gRPC request "dup-g" runs, her second "dup-g" gets ALREADY_EXISTS; while
    her HTTP stream "dup-h" runs, her second "dup-h" gets 409; Bob's "dup-h" is his own and
    is served. (The cluster checks ids per protocol: docs/cluster.md.)"""
    stream = generate(target, ALICE, "dup-g", 2000)
    await anext(stream)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as twice:
            async for _ in generate(target, ALICE, "dup-g", 1):
                pass
    finally:
        await stream.aclose()
    assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS
    async with httpx.AsyncClient(base_url=target.http_url, timeout=60) as http:
        body = {"model": "fake", "prompt": "long", "max_tokens": 2000, "stream": True}
        headers = auth(ALICE) | {"X-Request-Id": "dup-h"}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as sse:
            lines = sse.aiter_lines()  # held: collected, it would close the stream
            assert (await anext(lines)).startswith("data: ")
            again = await complete(target, ALICE, **{"X-Request-Id": "dup-h"})
            bobs = await complete(target, BOB, **{"X-Request-Id": "dup-h"})
    assert again.status_code == 409, again.text
    assert again.json()["error"]["type"] == "conflict_error"
    assert bobs.status_code == 200, bobs.text


async def test_abort_finds_every_stream_of_its_owner(target: Target) -> None:
    """Alice runs 4 streams (the cluster spreads them over both replicas); Bob's Abort of
    one finds nothing, Alice's Abort finds all 4, and each stream ends aborted."""

    async def read(i: int) -> list[pb.GenerateResponse]:
        return [r async for r in generate(target, ALICE, f"ab-{i}", 2000, f"abort me {i} " * 4)]

    readers = [asyncio.create_task(read(i)) for i in range(4)]
    await wait_until(lambda: in_flight(target) == 4, timeout_s=60)
    auth_of_alice = grpc_auth(ALICE)
    async with grpc.aio.insecure_channel(target.grpc_address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        bobs = await stub.Abort(pb.AbortRequest(request_id="ab-0"), metadata=grpc_auth(BOB))
        found = [
            (await stub.Abort(pb.AbortRequest(request_id=f"ab-{i}"), metadata=auth_of_alice)).found
            for i in range(4)
        ]
    streams = await asyncio.gather(*readers)
    assert not bobs.found
    assert found == [True] * 4
    assert [s[-1].finish_reason for s in streams] == [pb.FINISH_REASON_ABORT] * 4


async def flood(target: Target) -> tuple[int, list[int]]:
    """Alice sends 20 requests at once (fewer than the connection cap) and Bob one while
    hers wait: Bob's status, hers."""
    async with httpx.AsyncClient(base_url=target.http_url, timeout=120) as http:
        body = {"model": "fake", "prompt": "flood", "max_tokens": 40}
        alices = [
            asyncio.create_task(http.post("/v1/completions", json=body, headers=auth(ALICE)))
            for _ in range(20)
        ]
        await asyncio.sleep(0)
        bob = await http.post("/v1/completions", json=body, headers=auth(BOB))
        return bob.status_code, [(await task).status_code for task in alices]


async def test_one_keys_flood_is_refused_while_another_key_is_admitted(target: Target) -> None:
    """Alice sends 20 requests at once: past her share of the waiting queue some get 429;
    Bob's request, sent while hers wait, is served."""
    bob, alices = await flood(target)
    assert bob == 200
    assert sorted(set(alices)) == [200, 429]


async def test_metrics_need_the_admin_key_on_every_port(target: Target) -> None:
    """Every /metrics (the cluster: the router's and each replica's) and the router's
    /targets answer 401 without a key, 403 with a tenant's key and 200 with the admin's."""
    addresses = target.metrics_addresses()
    assert len(addresses) == (1 if target.name == "single" else 3)
    paths = [f"http://{a}/metrics" for a in addresses]
    if target.name == "cluster":
        paths.append(f"http://{addresses[0]}/targets")
    async with httpx.AsyncClient(timeout=30) as http:
        for url in paths:
            codes = [
                (await http.get(url, headers=h)).status_code for h in ({}, auth(ALICE), auth(ADMIN))
            ]
            assert codes == [401, 403, 200], (url, codes)


async def test_the_internal_route_is_not_served_on_the_public_port(target: Target) -> None:
    """POST /_kvserve_grpc (the cluster's internal route for its gRPC proxy) is a 404 JSON
    answer, with or without a key, never a 500."""
    async with httpx.AsyncClient(base_url=target.http_url, timeout=30) as http:
        for headers in ({}, auth(ALICE)):
            reply = await http.post("/_kvserve_grpc", json={}, headers=headers)
            assert reply.status_code == 404, reply.text
            assert reply.json()["error"]["type"] == "not_found_error"


async def _quiet_log(target: Target) -> int:
    """The log's size once it has stopped growing for 2 s (the cluster's replicas' lines
    reach it through Ray's log monitor, later)."""
    size, since = target.log_bytes(), time.monotonic()
    deadline = since + 60
    while time.monotonic() - since < 2.0:
        await asyncio.sleep(0.2)
        if target.log_bytes() != size:
            size, since = target.log_bytes(), time.monotonic()
        assert time.monotonic() < deadline, "the log never went quiet"
    return size


async def test_refusals_are_quiet(target: Target) -> None:
    """Refusals (5 HTTP 401s, 5 gRPC UNAUTHENTICATED, 5 ALREADY_EXISTS, a flood's 429s) and
    10 client hang-ups mid-stream add at most 200 bytes of log each: no traceback for an
    expected outcome."""
    before = await _quiet_log(target)
    async with httpx.AsyncClient(base_url=target.http_url, timeout=60) as http:
        for _ in range(5):
            assert (await http.post("/v1/completions", json={})).status_code == 401
    for i in range(5):
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in generate(target, "nope", f"q-{i}", 1):
                pass
    stream = generate(target, ALICE, "q-dup", 2000)
    await anext(stream)
    for _ in range(5):
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in generate(target, ALICE, "q-dup", 1):
                pass
    await stream.aclose()
    _, alices = await flood(target)
    num_429 = alices.count(429)
    assert num_429 > 0
    for i in range(10):  # hang-ups mid-stream
        hang_up = generate(target, ALICE, f"q-gone-{i}", 2000)
        await anext(hang_up)
        await hang_up.aclose()
    grown = await _quiet_log(target) - before
    assert grown <= 200 * (15 + num_429 + 10), target.log.read_text()[-4000:]


async def test_a_drain_on_sigterm_to_the_group_says_retry(target: Target) -> None:
    """SIGTERM to the target's process group: a new call gets the 503 JSON, a long SSE stream
    ends with the service_unavailable event and [DONE], a long gRPC stream with UNAVAILABLE,
    and the target exits 0 within the grace period + 10 s."""
    async with httpx.AsyncClient(base_url=target.http_url, timeout=120) as http:
        body = {"model": "fake", "prompt": "long", "max_tokens": 3000, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers=auth(ALICE)) as sse:
            lines = sse.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            grpc_stream = generate(target, BOB, "long", 3000)
            await anext(grpc_stream)
            t0 = time.monotonic()
            os.killpg(target.proc.pid, signal.SIGTERM)

            async def refused() -> bool:
                reply = await complete(target, BOB)
                return reply.status_code == 503

            await wait_until(refused, timeout_s=30)
            late = await complete(target, BOB)
            rest = [line async for line in lines if line]
        with pytest.raises(grpc.aio.AioRpcError) as cut:
            async for _ in grpc_stream:
                pass
    exit_code = await asyncio.to_thread(target.proc.wait, GRACE_S + 30)
    took_s = time.monotonic() - t0
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    assert rest[-1] == "data: [DONE]", rest[-3:]
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["type"] == "service_unavailable"
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert exit_code == 0
    assert took_s <= GRACE_S + 10, took_s
