"""A client process for the vanishing-client tests: opens N long streams on one API, prints
``ready`` once each has its first token, then reads on until it is killed.

    python -m tests.server.vanishing_client grpc 127.0.0.1:PORT 16 1000 [API_KEY]
    python -m tests.server.vanishing_client http http://127.0.0.1:PORT 16 1000 [API_KEY]
"""

from __future__ import annotations

import asyncio
import sys

import httpx

from server.client import KVServeClient


async def _grpc(
    address: str, num: int, max_tokens: int, first: asyncio.Queue[int], key: str | None
) -> None:
    async with KVServeClient(address, api_key=key) as client:

        async def one(i: int) -> None:
            stream = client.generate("vanish", request_id=f"v{i}", max_tokens=max_tokens)
            async for _ in stream:
                first.put_nowait(i)

        await asyncio.gather(*(one(i) for i in range(num)))


async def _http(
    url: str, num: int, max_tokens: int, first: asyncio.Queue[int], key: str | None
) -> None:
    limits = httpx.Limits(max_connections=num)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as http:

        async def one(i: int) -> None:
            body = {"prompt": "vanish", "max_tokens": max_tokens, "stream": True}
            headers = {"X-Request-Id": f"v{i}"}
            if key is not None:
                headers["Authorization"] = f"Bearer {key}"
            async with http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        first.put_nowait(i)

        await asyncio.gather(*(one(i) for i in range(num)))


async def main(api: str, target: str, num: int, max_tokens: int, key: str | None) -> None:
    first: asyncio.Queue[int] = asyncio.Queue()
    run = _grpc if api == "grpc" else _http
    task = asyncio.create_task(run(target, num, max_tokens, first, key))
    seen: set[int] = set()
    while len(seen) < num:
        seen.add(await first.get())
    print("ready", flush=True)
    while True:  # read on until killed (an end of every stream first is a test failure)
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            task.result()
            print("finished", flush=True)
            return
        while not first.empty():
            first.get_nowait()


if __name__ == "__main__":
    key = sys.argv[5] if len(sys.argv) > 5 else None
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), key))
