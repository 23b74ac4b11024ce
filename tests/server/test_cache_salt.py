"""cache_salt is capped at 256 bytes and only its digest reaches the cache."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client import CollectorRegistry

from metrics.prometheus import PrometheusSink
from server.rpc import generation_pb2 as pb
from server.validation import MAX_CACHE_SALT_BYTES
from tests.server.helpers import Harness, collect, serve


def _salted(salt: str, rid: str = "") -> pb.GenerateRequest:
    # 8 bytes + BOS = 9 tokens: two full blocks of 4 get prefix keys (with the salt).
    return pb.GenerateRequest(
        text="hello wo", request_id=rid, cache_salt=salt, stopping=pb.StoppingOptions(max_tokens=1)
    )


def _block_salts(h: Harness) -> set[str | None]:
    return {block.cache_salt for block in h.scheduler.kv._pool.blocks}


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def test_a_1mb_salt_is_invalid_argument_and_the_cache_keeps_only_digests() -> None:
    """1 MB and 257 bytes are refused with the limit in the message (gRPC and HTTP); a
    256-byte salt is served, and the blocks it cached hold its 32-hex-digit digest."""
    async with serve(http=True) as h:
        for salt in ("s" * 2**20, "é" * 129):  # 1 MiB; 258 bytes in UTF-8
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(h.client.stub.Generate(_salted(salt)))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"at most {MAX_CACHE_SALT_BYTES} are allowed" in (refused.value.details() or "")
        salt = "t" * MAX_CACHE_SALT_BYTES
        msgs = await collect(h.client.stub.Generate(_salted(salt, "ok")))
        async with httpx.AsyncClient(base_url=h.http_url) as http:
            body = {"prompt": "x", "max_tokens": 1, "cache_salt": "s" * 1000}
            reply = await http.post("/v1/completions", json=body)
        salts = _block_salts(h)
    assert msgs[-1].finished
    assert reply.status_code == 400 and "cache_salt has 1000 bytes" in reply.text
    assert hashlib.blake2b(salt.encode(), digest_size=16).hexdigest() in salts
    assert salt not in salts and all(s is None or len(s) == 32 for s in salts)


@pytest.mark.slow
async def test_ten_thousand_maximal_salts_keep_resident_memory_flat() -> None:
    """10,000 requests, each with its own 256-byte salt, leave resident memory within 20 MB
    of where it stood after a warm-up of 500 (the cache holds digests in a bounded pool)."""

    async def run(start: int, count: int, h: Harness) -> None:
        """32 clients in a loop (not 10,000 tasks: the test's own memory stays flat)."""
        numbers = iter(range(start, start + count))

        async def worker() -> None:
            for i in numbers:
                salt = f"{i:08d}".ljust(MAX_CACHE_SALT_BYTES, "s")
                await collect(h.client.stub.Generate(_salted(salt)))

        await asyncio.gather(*(worker() for _ in range(32)))

    async with serve() as h:
        # The server's own sink, not the test's recorder (which keeps every record).
        sink = PrometheusSink(CollectorRegistry())
        h.engine.sink = h.server.servicer.sink = sink
        await run(0, 500, h)
        before = _rss_bytes()
        await run(500, 10_000, h)
        after = _rss_bytes()
        stats = await h.client.kv_cache_stats()
    assert stats.num_blocks_used == 0
    assert after - before < 20 * 2**20, f"RSS grew by {(after - before) / 2**20:.1f} MiB"
