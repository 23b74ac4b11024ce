"""Hostile bodies at the HTTP front: JSON the parser cannot take, integers no proto field holds,
and bodies over --max-request-bytes (413, refused before they are buffered), on a live server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from tests.server.helpers import serve

REPO_ROOT = Path(__file__).resolve().parents[2]
JSON = {"Content-Type": "application/json"}


def _error(message: str, status_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": status_type, "param": None, "code": None}}


async def test_deeply_nested_json_is_a_400_not_a_500() -> None:
    """100,000 nested arrays (and objects) were a RecursionError and a 500: now a 400 in
    OpenAI's error shape, on both endpoints, counted as an invalid request, and the server
    keeps serving."""
    nested = [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000]
    async with serve(http=True) as h, httpx.AsyncClient(base_url=h.http_url) as c:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for body in nested:
                r = await c.post(path, content=body, headers=JSON)
                assert r.status_code == 400
                assert r.json() == _error(
                    "the request body nests arrays / objects too deeply to parse; no field of "
                    "this API nests more than 4 levels"
                )
        ok = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200
    assert [code for _, code in h.sink.rpcs] == ["INVALID_ARGUMENT"] * 4 + ["OK"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("seed", -1, "seed must be in [0, 18446744073709551615], got -1"),
        ("seed", 2**70, "seed must be in [0, 18446744073709551615], got 1180591620717411303424"),
        ("top_k", 2**31, "top_k must be in [-2147483648, 2147483647], got 2147483648"),
        ("priority", -(2**40), "priority must be in [-2147483648, 2147483647], got -1099511627776"),
        ("max_tokens", 2**40, "max_tokens must be in [-2147483648, 2147483647], got 1099511627776"),
    ],
)
async def test_out_of_range_integers_are_a_400_naming_the_field(
    field: str, value: int, message: str
) -> None:
    """seed -1 and seed 2**70 were accepted without a word (wrapped into the uint64), and
    priority / max_tokens clamped: each is a 400 that names the field, its range and the
    value, and no request reaches the engine."""
    async with serve(http=True) as h, httpx.AsyncClient(base_url=h.http_url) as c:
        r = await c.post("/v1/completions", json={"prompt": "x", field: value})
    assert r.status_code == 400
    assert r.json() == _error(message)
    assert h.sink.requests == []


async def _raw_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one HTTP/1.1 response with a Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return int(lines[0].split()[1]), json.loads(body)


async def test_body_over_max_request_bytes_is_a_413_before_it_is_read() -> None:
    """A declared Content-Length over --max-request-bytes gets a 413 before a byte of the body
    is sent (so nothing was buffered); a chunked body gets it as soon as the bytes streamed
    pass the bound, while the client is still sending; a body of exactly the bound is served."""
    limit = 1000
    too_large = _error(
        "the request body declares 1000000000 bytes; this server takes at most 1000 bytes "
        "(--max-request-bytes)"
    )
    async with serve(http=True, server_options={"max_request_bytes": limit}) as h:
        host, port = h.http_url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000\r\n\r\n"
        )
        assert await _raw_response(reader) == (413, too_large)
        writer.close()

        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for _ in range(2):  # 1,200 bytes, and the body never ends
            writer.write(b"258\r\n" + b" " * 600 + b"\r\n")
        assert await _raw_response(reader) == (
            413,
            _error(
                "the request body runs past 1000 bytes; this server takes at most 1000 bytes "
                "(--max-request-bytes)"
            ),
        )
        writer.close()

        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        async with httpx.AsyncClient(base_url=h.http_url) as c:
            exact = await c.post("/v1/completions", content=body.ljust(limit), headers=JSON)
            over = await c.post("/v1/completions", content=body.ljust(limit + 1), headers=JSON)
    assert exact.status_code == 200
    assert over.status_code == 413
    assert over.json()["error"]["message"].startswith("the request body declares 1001 bytes")
    assert [code for _, code in h.sink.rpcs] == [
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "OK",
        "INVALID_ARGUMENT",
    ]


async def test_grpc_message_over_max_request_bytes_is_resource_exhausted() -> None:
    """The same bound holds on gRPC: a larger message is refused by grpc itself."""
    async with serve(server_options={"max_request_bytes": 1000}) as h:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in h.client.generate("x" * 2000):
                pass
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_four_64mb_bodies_get_413_with_bounded_rss(tmp_path: Path) -> None:
    """Four authenticated 64 MB bodies at once (declared, and chunked) get 413 while the
    server process's RSS (sampled every 5 ms) grows by less than 50 MB: they took it from
    127 MB to 2.9 GB before."""
    port_file = tmp_path / "http_port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--runner", "fake", "--port", "0",
         "--metrics-port", "0", "--http-port", "0", "--http-port-file", str(port_file),
         "--api-key", "k1"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.05)
        url = f"http://127.0.0.1:{int(port_file.read_text())}"
        headers = {"Authorization": "Bearer k1", **JSON}
        body = b" " * (64 * 1024 * 1024)
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:  # warm-up
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
            assert c.post("/v1/completions", content=body[: 5 * 1024 * 1024]).status_code == 413
        baseline = _rss_bytes(proc.pid)
        peak = [baseline]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], _rss_bytes(proc.pid))
                time.sleep(0.005)

        async def chunks() -> Any:
            for i in range(0, len(body), 1 << 20):
                yield body[i : i + (1 << 20)]

        async def flood() -> list[int]:
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:
                declared = [c.post("/v1/completions", content=body) for _ in range(2)]
                chunked = [c.post("/v1/chat/completions", content=chunks()) for _ in range(2)]
                return [r.status_code for r in await asyncio.gather(*declared, *chunked)]

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            statuses = asyncio.run(flood())
        finally:
            done.set()
            sampler.join()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(timeout=30)
    growth_mb = (peak[0] - baseline) / 2**20
    print(f"RSS {baseline / 2**20:.0f} MiB -> peak {peak[0] / 2**20:.0f} MiB (+{growth_mb:.1f})")
    assert statuses == [413] * 4
    assert growth_mb < 50
