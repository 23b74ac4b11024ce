"""The cluster's edges, measured: ``python -m loadtest.cluster_edges`` prints issue 42's
closing figures for ``kvserve cluster serve --replicas 2 --runner fake`` (two API keys and an
admin key, 2 s timeouts):

    slow      100 idle + 100 slow-header HTTP connections: the last one closed after (s)
    flood     --flood idle HTTP connections (default 20,000, from two child processes): the
              longest a new HTTP and a new gRPC client waited to be served or refused, and
              the errors a keep-alive client saw meanwhile
    metrics   /metrics on every port (router and replicas) and /targets without a key
    abort     4 streams over both replicas, each read to its first message, then Aborted:
              found of 4 x --abort-rounds (default 20); a duplicate in-flight id's status
    log       bytes of log per 429
    internal  POST /_kvserve_grpc from outside
    drain     SIGTERM to the CLI, then (a second cluster) to its process group: a new call's
              status and body type, the last events of a long stream, seconds to exit
    startup   a P/D split whose replicas need more CPUs than Ray has: exit code, seconds

The CPU model and the load average are printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx

from loadtest.launch import REPO_ROOT, cpu_model
from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc

ALICE, BOB, ADMIN = "edge-alice", "edge-bob", "edge-admin"
TIMEOUT_S = 2.0
GRACE_S = 5.0
FLAGS = [
    "--runner", "fake", "--replicas", "2", "--replica-cpus", "0", "--fake-step-sleep-s", "0.02",
    "--api-key", ALICE, "--api-key", BOB, "--admin-api-key", ADMIN,
    "--http-header-timeout-s", str(TIMEOUT_S), "--http-body-timeout-s", str(TIMEOUT_S),
    "--http-idle-timeout-s", str(TIMEOUT_S), "--grace-period-s", str(GRACE_S),
    "--max-num-seqs", "2", "--max-waiting-requests-per-tenant", "4", "--log-level", "warning",
]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Cluster:
    """``kvserve cluster serve`` in a process group of its own, its output in ``log``."""

    def __init__(self, extra: list[str] | None = None) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="kvserve-edges-"))
        self.ports = {k: _free_port() for k in ("grpc", "http", "metrics")}
        self.log = self.tmp / "cluster.log"
        args = [
            sys.executable, "-m", "server.cli", "cluster", "serve", *FLAGS, *(extra or []),
            "--port", str(self.ports["grpc"]), "--http-port", str(self.ports["http"]),
            "--metrics-port", str(self.ports["metrics"]),
            "--http-port-file", str(self.tmp / "http"),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                args, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 600
        while not (self.tmp / "http").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not start: {self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


async def _generate(address: str, key: str, request_id: str, max_tokens: int) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            text=f"edge {request_id} " * 4,
            request_id=request_id,
            stopping=pb.StoppingOptions(max_tokens=max_tokens),
        )
        metadata = (("authorization", f"Bearer {key}"),)
        async for response in stub.Generate(request, metadata=metadata, timeout=300):
            yield response


async def slow_connections(cluster: Cluster, count: int) -> dict[str, Any]:
    """``count`` idle and ``count`` slow-header connections: when the last one closed."""
    conns = [
        await asyncio.open_connection("127.0.0.1", cluster.ports["http"]) for _ in range(2 * count)
    ]
    for _, writer in conns[count:]:
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # headers never finished
    t0 = time.monotonic()

    async def closed(reader: asyncio.StreamReader) -> float:
        async with asyncio.timeout(120):
            while await reader.read(4096):
                pass
        return time.monotonic() - t0

    times = await asyncio.gather(*(closed(r) for r, _ in conns))
    return {"closed": f"{len(times)}/{2 * count}", "last_s": round(max(times), 2),
            "timeout_s": TIMEOUT_S}  # fmt: skip


_FLOODER = """
import resource, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held, failed = [], 0
for _ in range(int(sys.argv[2])):
    try:
        s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5)
        held.append(s)
    except OSError:
        failed += 1
print(len(held), failed, flush=True)
time.sleep(3600)
"""


async def flood(cluster: Cluster, count: int) -> dict[str, Any]:
    """``count`` idle connections on the HTTP port from two processes; meanwhile a new HTTP
    client and a new gRPC client every 0.5 s (seconds to an answer) and a keep-alive client
    asking without pause (its errors)."""
    stop = asyncio.Event()
    errors: list[str] = []
    asked = 0

    async def keep_alive() -> None:
        nonlocal asked
        async with httpx.AsyncClient(base_url=cluster.http, timeout=10) as client:
            while not stop.is_set():
                try:
                    reply = await client.get("/health")
                    asked += 1
                    if reply.status_code != 200:
                        errors.append(str(reply.status_code))
                except httpx.HTTPError as exc:
                    errors.append(type(exc).__name__)

    async def new_clients() -> tuple[list[float], list[float], list[str]]:
        http_s, grpc_s, outcomes = [], [], []
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                async with httpx.AsyncClient(timeout=10) as client:
                    reply = await client.get(f"{cluster.http}/v1/models", headers=_auth(ALICE))
                outcomes.append(f"http {reply.status_code}")
            except httpx.HTTPError as exc:
                outcomes.append(f"http {type(exc).__name__}")
            http_s.append(time.monotonic() - t0)
            t0 = time.monotonic()
            try:
                msgs = [m async for m in _generate(cluster.grpc, ALICE, f"f-{len(grpc_s)}", 2)]
                outcomes.append("grpc OK" if msgs[-1].finished else "grpc ?")
            except grpc.aio.AioRpcError as exc:
                outcomes.append(f"grpc {exc.code().name}")
            grpc_s.append(time.monotonic() - t0)
            await asyncio.sleep(0.5)
        return http_s, grpc_s, outcomes

    asking = asyncio.create_task(keep_alive())
    probing = asyncio.create_task(new_clients())
    half = count // 2
    flooders = [
        subprocess.Popen(
            [sys.executable, "-c", _FLOODER, str(cluster.ports["http"]), str(n)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in (half, count - half)
    ]
    t0 = time.monotonic()
    opened = [await asyncio.to_thread(f.stdout.readline) for f in flooders]  # type: ignore[union-attr]
    flood_s = time.monotonic() - t0
    await asyncio.sleep(5)  # clients keep coming while the flood is held
    stop.set()
    await asking
    http_s, grpc_s, outcomes = await probing
    for f in flooders:
        f.kill()
        f.wait()
    held = sum(int(line.split()[0]) for line in opened)
    refused = sum(int(line.split()[1]) for line in opened)
    return {
        "flood": f"{held} opened, {refused} failed to open, in {flood_s:.1f}s",
        "new_http_s": _spread(http_s),
        "new_grpc_s": _spread(grpc_s),
        "new_client_outcomes": sorted(set(outcomes)),
        "keep_alive": f"{asked} requests, {len(errors)} errors {sorted(set(errors))}",
    }


async def metrics_auth(cluster: Cluster) -> dict[str, Any]:
    """Every /metrics address (the router's lists the replicas') and /targets, no key."""
    router = f"127.0.0.1:{cluster.ports['metrics']}"
    async with httpx.AsyncClient(timeout=10) as client:
        listed = (await client.get(f"http://{router}/targets", headers=_auth(ADMIN))).json()
        addresses = listed[0]["targets"]
        codes = {a: (await client.get(f"http://{a}/metrics")).status_code for a in addresses}
        codes["targets"] = (await client.get(f"http://{router}/targets")).status_code
    return {"no_key": codes}


async def abort_round(cluster: Cluster, tag: str) -> list[bool]:
    """Alice's 4 streams (the replicas each serve some), each read to its first message (it
    runs: a single server would find it), then her Abort of each; every stream must end."""
    started = [asyncio.Event() for _ in range(4)]

    async def read(i: int) -> list[Any]:
        out = []
        async for m in _generate(cluster.grpc, ALICE, f"{tag}-{i}", 3000):
            out.append(m)
            started[i].set()
        return out

    readers = [asyncio.create_task(read(i)) for i in range(4)]
    async with asyncio.timeout(120):
        await asyncio.gather(*(e.wait() for e in started))
    async with grpc.aio.insecure_channel(cluster.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {ALICE}"),)
        found = [
            (await stub.Abort(pb.AbortRequest(request_id=f"{tag}-{i}"), metadata=metadata)).found
            for i in range(4)
        ]
    async with asyncio.timeout(120):
        await asyncio.gather(*readers)
    return found


async def abort_and_duplicate(cluster: Cluster, rounds: int) -> dict[str, Any]:
    """``rounds`` of ``abort_round`` in a row (Aborts found of 4 x rounds; which missed);
    then a second in-flight "dup-g" (gRPC) and "dup-h" (HTTP)."""
    found = [await abort_round(cluster, f"ab{r}") for r in range(rounds)]
    missed = [f"ab{r}-{i}" for r, row in enumerate(found) for i, ok in enumerate(row) if not ok]
    await _first(cluster, "dup-g")  # "dup-g" runs
    try:
        [m async for m in _generate(cluster.grpc, ALICE, "dup-g", 1)]
        duplicate = "OK"
    except grpc.aio.AioRpcError as exc:
        duplicate = exc.code().name
    async with grpc.aio.insecure_channel(cluster.grpc) as channel:
        stub = pb_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {ALICE}"),)
        await stub.Abort(pb.AbortRequest(request_id="dup-g"), metadata=metadata)
    async with httpx.AsyncClient(base_url=cluster.http, timeout=60) as client:
        body = {"model": "fake", "prompt": "long", "max_tokens": 3000, "stream": True}
        headers = _auth(ALICE) | {"X-Request-Id": "dup-h"}
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as sse:
            lines = sse.aiter_lines()
            await anext(lines)
            again = await client.post(
                "/v1/completions", json={"model": "fake", "prompt": "x"}, headers=headers
            )
    total = sum(map(sum, found))
    return {"abort_found": f"{total}/{4 * rounds}", "rounds": rounds, "missed": missed,
            "duplicate_grpc": duplicate, "duplicate_http": again.status_code}  # fmt: skip


async def _first(cluster: Cluster, request_id: str) -> None:
    """Start Alice's long stream ``request_id`` and return once its first message came (the
    stream goes on in a task of its own until aborted)."""
    came = asyncio.Event()

    async def read() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in _generate(cluster.grpc, ALICE, request_id, 3000):
                came.set()

    _BACKGROUND.add(asyncio.create_task(read()))
    async with asyncio.timeout(120):
        await came.wait()


_BACKGROUND: set[asyncio.Task[None]] = set()


async def log_per_429(cluster: Cluster) -> dict[str, Any]:
    """Bytes of the CLI's log per refused request (a flood of one key)."""
    before = cluster.log.stat().st_size
    async with httpx.AsyncClient(base_url=cluster.http, timeout=120) as client:
        body = {"model": "fake", "prompt": "flood", "max_tokens": 40}
        replies = await asyncio.gather(
            *(client.post("/v1/completions", json=body, headers=_auth(ALICE)) for _ in range(20))
        )
    await asyncio.sleep(5)  # Ray forwards its processes' lines to the CLI's output
    num_429 = sum(r.status_code == 429 for r in replies)
    grown = cluster.log.stat().st_size - before
    return {"429s": num_429, "log_bytes": grown,
            "per_429": round(grown / max(num_429, 1), 1)}  # fmt: skip


async def internal_route(cluster: Cluster) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=cluster.http, timeout=30) as client:
        without = await client.post("/_kvserve_grpc", json={})
        with_key = await client.post("/_kvserve_grpc", json={}, headers=_auth(ALICE))
    return {"no_key": without.status_code, "key": with_key.status_code}


async def drain(cluster: Cluster, group: bool) -> dict[str, Any]:
    """SIGTERM (to the CLI or its process group) during a long HTTP stream."""
    async with httpx.AsyncClient(base_url=cluster.http, timeout=120) as client:
        body = {"model": "fake", "prompt": "long", "max_tokens": 3000, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=_auth(BOB)) as sse:
            lines = sse.aiter_lines()
            await anext(lines)
            t0 = time.monotonic()
            if group:
                os.killpg(cluster.proc.pid, signal.SIGTERM)
            else:
                cluster.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(1)
            reply = await client.post(
                "/v1/completions", json={"model": "fake", "prompt": "x"}, headers=_auth(BOB)
            )
            rest = [line async for line in lines if line]
    code = await asyncio.to_thread(cluster.proc.wait, 120)
    kind = reply.json().get("error", {}).get("type") if reply.status_code >= 400 else None
    return {
        "new_call": f"{reply.status_code} {kind}",
        "stream_end": [
            json.loads(r[6:])["error"]["type"] if "error" in r else r for r in rest[-2:]
        ],
        "exit": code,
        "exit_s": round(time.monotonic() - t0, 1),
        "grace_s": GRACE_S,
    }


def unplaceable() -> dict[str, Any]:
    """A P/D split of 3 replicas x 1 CPU on a Ray of os.cpu_count() CPUs."""
    tmp = tempfile.mkdtemp(prefix="kvserve-pd-")
    args = [
        sys.executable, "-m", "server.cli", "cluster", "serve", "--runner", "fake",
        "--prefill-replicas", "1", "--replicas", "2", "--kv-disk-dir", tmp,
        "--port", str(_free_port()), "--http-port", str(_free_port()), "--no-metrics",
    ]  # fmt: skip
    t0 = time.monotonic()
    done = subprocess.run(args, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    return {"exit": done.returncode, "seconds": round(time.monotonic() - t0, 1),
            "said": done.stderr.strip().splitlines()[-1:]}  # fmt: skip


PHASES = ("slow", "flood", "metrics", "abort", "log", "internal", "drain", "startup")


async def run(args: argparse.Namespace) -> None:
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores, load {os.getloadavg()}", flush=True)
    phases = set(args.phases.split(",")) if args.phases else set(PHASES)
    if unknown := phases - set(PHASES):
        raise SystemExit(f"unknown phases {sorted(unknown)}: choose from {', '.join(PHASES)}")
    results: dict[str, Any] = {}
    one_cluster = {
        "slow": lambda c: slow_connections(c, 100),
        "flood": lambda c: flood(c, args.flood),
        "metrics": metrics_auth,
        "abort": lambda c: abort_and_duplicate(c, args.abort_rounds),
        "log": log_per_429,
        "internal": internal_route,
        "drain": lambda c: drain(c, group=False),
    }
    if phases & set(one_cluster):
        cluster = Cluster()
        try:
            for name, phase in one_cluster.items():
                if name in phases:
                    results["drain_cli" if name == "drain" else name] = await phase(cluster)
        finally:
            cluster.stop()
    if "drain" in phases:
        cluster = Cluster()
        try:
            results["drain_group"] = await drain(cluster, group=True)
        finally:
            cluster.stop()
    if "startup" in phases:
        results["startup"] = unplaceable()
    for name, figures in results.items():
        print(f"{name:12s} {json.dumps(figures)}", flush=True)
    print(f"load after: {os.getloadavg()}")


def _spread(seconds: list[float]) -> str:
    """The median and the largest of ``seconds``, and how many."""
    ordered = sorted(seconds)
    return f"median {ordered[len(ordered) // 2]:.3f}, max {ordered[-1]:.3f} of {len(ordered)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=20_000, help="idle connections")
    parser.add_argument("--abort-rounds", type=int, default=20, help="rounds of 4 Aborts")
    parser.add_argument("--phases", default="", help=f"comma-separated, of {','.join(PHASES)}")
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
