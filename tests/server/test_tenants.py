"""Tenants apart (API keys): one key's flood is refused while another key is admitted; no key
can learn whether another key's prompt is cached (by cached tokens or by time to first
token); the global views need an admin key; and each end of a call is counted as its
client saw it (a deadline, a cancel, a hang-up mid-body)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

import grpc
import httpx
import pytest

from scheduler import SchedulerStats
from server.auth import Security
from server.rpc import generation_pb2 as pb
from tests.server.helpers import Harness, collect, make_fake_runner, serve, wait_until

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
KEYS = frozenset({ALICE, BOB, ADMIN})


def _security(share: bool = False) -> Security:
    return Security(api_keys=KEYS, admin_keys=frozenset({ADMIN}), share_prefix_cache=share)


def _meta(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _request(text: str, max_tokens: int, rid: str = "", salt: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=text,
        request_id=rid,
        cache_salt=salt,
        stopping=pb.StoppingOptions(max_tokens=max_tokens),
    )


async def _run(
    h: Harness, key: str, request: pb.GenerateRequest
) -> tuple[float, list[pb.GenerateResponse]]:
    """(seconds to the first message, every message) of one Generate call as ``key``."""
    t0 = time.monotonic()
    call = h.client.stub.Generate(request, metadata=_meta(key))
    first = await anext(aiter(call))
    ttft = time.monotonic() - t0
    return ttft, [first, *[m async for m in call]]


async def _flood_then_bob(per_key: int) -> tuple[Any, ...]:
    """Alice fills her share of the waiting queue (one of hers running, ``per_key`` waiting),
    sends one more, then Bob sends one request on each front. Returns (Alice's extra
    request's code and details, Bob's gRPC code, Bob's HTTP status).

    Driven by the engine's own counts, not by time: Alice's first request is running (it asks
    for more steps than the test lasts) before her others are sent, one at a time (admitted in
    one inbox drain, they would all count at once), and Bob's two are admitted (or refused)
    before Alice's are cancelled."""
    runner = make_fake_runner(max_model_len=8192, sleep_s=0.01)
    async with serve(
        runner, http=True, security=_security(), max_num_seqs=1, num_blocks=4096,
        max_waiting_requests=8, max_waiting_requests_per_tenant=per_key,
    ) as h:  # fmt: skip

        def stats() -> SchedulerStats:
            return h.engine.latest_stats

        calls, flood = [], []
        for i in range(1 + per_key):
            request = _request("x", 8000, f"a{i}")
            calls.append(h.client.stub.Generate(request, metadata=_meta(ALICE)))
            flood.append(asyncio.ensure_future(collect(calls[-1])))
            if i == 0:
                await wait_until(lambda: stats().num_running == 1)
            else:
                await wait_until(lambda n=i: stats().num_waiting == n)  # type: ignore[misc]
        with pytest.raises(grpc.aio.AioRpcError) as alice:
            await collect(h.client.stub.Generate(_request("x", 1), metadata=_meta(ALICE)))
        async with httpx.AsyncClient(base_url=h.http_url, timeout=60) as http:
            bob_http = asyncio.ensure_future(
                http.post(
                    "/v1/completions",
                    json={"prompt": "y", "max_tokens": 1, "stream": True},
                    headers={"Authorization": f"Bearer {BOB}"},
                )
            )
            bob = asyncio.ensure_future(
                collect(h.client.stub.Generate(_request("y", 1), metadata=_meta(BOB)))
            )
            # Admitted (both wait behind Alice's running request) or refused (the control).
            await wait_until(
                lambda: stats().num_waiting == per_key + 2 or (bob.done() and bob_http.done())
            )
            for call in calls:
                call.cancel()
            await asyncio.gather(*flood, return_exceptions=True)
            try:
                bob_code = grpc.StatusCode.OK if (await bob)[-1].finished else None
            except grpc.aio.AioRpcError as exc:
                bob_code = exc.code()
            bob_http_status = (await bob_http).status_code
    return alice.value.code(), alice.value.details(), bob_code, bob_http_status


async def test_one_keys_flood_is_refused_while_another_key_is_admitted() -> None:
    """One request runs at a time, 8 may wait, 3 per key. Alice's 4th waiting request gets
    RESOURCE_EXHAUSTED naming her share (HTTP: 429) while Bob's are admitted, on both
    fronts; with the per-key bound at the global one (the control), Bob is refused too."""
    code, details, bob_code, bob_http_status = await _flood_then_bob(per_key=3)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting_requests_per_tenant=3" in (details or "")
    assert (bob_code, bob_http_status) == (grpc.StatusCode.OK, 200)
    code, details, bob_code, bob_http_status = await _flood_then_bob(per_key=8)  # the control
    assert code == bob_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert bob_http_status == 429


PROMPT = "the secret prompt of alice, which bob wants to find out about!" * 3  # 189 tokens


async def test_another_keys_cached_prompt_shows_no_cached_tokens() -> None:
    """Alice's prompt, cached: Alice gets its full blocks back as cached tokens; Bob sending
    the same prompt gets 0, and so does Alice with a cache_salt (which narrows her cache).
    With --share-prefix-cache-across-keys (the control) Bob gets Alice's cached tokens."""
    cached = {}
    for share in (False, True):
        async with serve(make_fake_runner(max_model_len=1024), security=_security(share)) as h:
            await _run(h, ALICE, _request(PROMPT, 1))
            for who, key, salt in (("alice", ALICE, ""), ("bob", BOB, ""), ("salted", ALICE, "s")):
                _, msgs = await _run(h, key, _request(PROMPT, 1, salt=salt))
                cached[share, who] = msgs[-1].usage.cached_prompt_tokens
    full = (len(PROMPT) + 1 - 1) // 4 * 4  # BOS + bytes; the last token is always computed
    assert cached[False, "alice"] == full
    assert cached[False, "bob"] == 0 and cached[False, "salted"] == 0
    assert cached[True, "bob"] == full


async def test_another_keys_cached_prompt_does_not_shorten_the_time_to_first_token() -> None:
    """Prefill costs 2 ms a token. Bob's first token for Alice's cached prompt takes as long
    as for a fresh prompt of the same length (ratio 0.6..1.7); with the shared cache (the
    control) it comes in under half the time."""
    ratios = {}
    for share in (False, True):
        runner = make_fake_runner(max_model_len=1024, sleep_per_token_s=0.002)
        async with serve(runner, security=_security(share)) as h:
            await _run(h, ALICE, _request(PROMPT, 1))
            fresh = PROMPT.replace("alice", "carol")  # same length, nothing cached
            hit, _ = await _run(h, BOB, _request(PROMPT, 1))
            miss, _ = await _run(h, BOB, _request(fresh, 1))
            ratios[share] = hit / miss
            print(f"share={share}: B's TTFT {hit:.3f} s on A's prompt, {miss:.3f} s fresh")
    assert 0.6 <= ratios[False] <= 1.7, ratios
    assert ratios[True] < 0.5, ratios


async def test_global_views_need_the_admin_key() -> None:
    """GetKVCacheStats (every tenant's figures): UNAUTHENTICATED without a key,
    PERMISSION_DENIED for a tenant's key (naming --admin-api-key), served for the admin key."""
    async with serve(security=_security()) as h:
        with pytest.raises(grpc.aio.AioRpcError) as nobody:
            await h.client.stub.GetKVCacheStats(pb.GetKVCacheStatsRequest())
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await h.client.stub.GetKVCacheStats(pb.GetKVCacheStatsRequest(), metadata=_meta(BOB))
        stats = await h.client.stub.GetKVCacheStats(
            pb.GetKVCacheStatsRequest(), metadata=_meta(ADMIN)
        )
    assert nobody.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "--admin-api-key" in (denied.value.details() or "")
    assert stats.total_memory_bytes > 0


async def test_deadline_and_cancel_counts_match_what_clients_saw(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Six calls that pass their 0.3 s deadline, four that their client cancels after the
    first token, and an HTTP client that hangs up mid-body: the server counts 6 deadline
    and 4 client_cancel aborts, Generate 6 DEADLINE_EXCEEDED and 4 CANCELLED, the hang-up
    one Completions CANCELLED, and logs no ERROR."""
    runner = make_fake_runner(sleep_s=0.01)
    seen: Counter[str] = Counter()
    async with serve(runner, http=True) as h:

        async def until_deadline(i: int) -> None:
            try:
                await collect(h.client.stub.Generate(_request("d", 100, f"d{i}"), timeout=0.3))
            except grpc.aio.AioRpcError as exc:
                seen[exc.code().name] += 1

        async def cancel_after_first(i: int) -> None:
            call = h.client.stub.Generate(_request("c", 100, f"c{i}"))
            await anext(aiter(call))
            call.cancel()
            seen["CANCELLED"] += 1

        with caplog.at_level(logging.ERROR):
            await asyncio.gather(
                *(until_deadline(i) for i in range(6)), *(cancel_after_first(i) for i in range(4))
            )
            _, writer = await asyncio.open_connection("127.0.0.1", h.server.http_port)
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                b"\r\ncontent-length: 100\r\n\r\n" + b'{"prompt": "hi"'
            )
            await writer.drain()
            writer.close()
            await wait_until(lambda: len(h.sink.requests) == 10)
            await wait_until(lambda: len(h.sink.rpcs) == 11)
    aborts = Counter(r.abort_reason for r in h.sink.requests)
    assert seen == {"DEADLINE_EXCEEDED": 6, "CANCELLED": 4}
    assert aborts == {"deadline": 6, "client_cancel": 4}
    assert Counter(h.sink.rpcs) == {
        ("Generate", "DEADLINE_EXCEEDED"): 6,
        ("Generate", "CANCELLED"): 4,
        ("Completions", "CANCELLED"): 1,
    }
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
