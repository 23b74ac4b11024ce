"""``make soak``: minutes of mixed, partly hostile traffic against a real ``kvserve serve``
(the fake runner: the soak checks the server, not a model), then a runner-crash drill.

Traffic, from ``--workers`` concurrent clients on both fronts, with two API keys::

    gRPC   whole streams, n = 3, streams cut after a few tokens, deadlines that pass, Abort
           calls, invalid requests, slow readers
    HTTP   streamed and whole completions (n = 2), streams cut early, bodies that are not JSON
    faults a stalled client (reads nothing: aborted by --stalled-stream-timeout-s), idle and
           slow-header connections (closed by the header timeout), and after the run a second
           server whose runner crashes mid-traffic (clients get UNAVAILABLE, it exits 1)

Every ``--sample-s`` it prints the server's RSS, KV blocks in use, running and waiting. It
fails (exit 1) on an unintended outcome, RSS growth over ``--max-rss-growth`` after the
warm-up (the first fifth of the run, at least 30 s), blocks / running / waiting not back to 0
once idle, server deadline or cancel counts that differ from what the clients saw, or a crash
drill that does not end as described.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from loadtest.launch import ServerProcess
from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc

KEYS = ("soak-key-a", "soak-key-b")
ADMIN = "soak-admin"
STALLED_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0


# The soak's server: the fake runner, slow enough to hold streams, quick to stall and time out.
SERVE_ARGS = [
    "--runner", "fake", "--fake-step-sleep-s", "0.002",
    "--stalled-stream-timeout-s", str(STALLED_TIMEOUT_S), "--max-unread-outputs", "8",
    "--http-header-timeout-s", str(HEADER_TIMEOUT_S), "--log-level", "warning",
    *(a for k in KEYS for a in ("--api-key", k)), "--admin-api-key", ADMIN,
]  # fmt: skip


def start_server(log: Path, extra: list[str]) -> ServerProcess:
    """A soak server (``loadtest.launch``: ports from its port files), its output in ``log``."""
    return ServerProcess([*SERVE_ARGS, *extra], startup_timeout_s=120, log_path=log).start()


def rss_bytes(server: ServerProcess) -> int:
    assert server.proc is not None
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def scrape(server: ServerProcess) -> str:
    """The server's /metrics (with the admin key)."""
    assert server.metrics_url is not None
    async with httpx.AsyncClient(timeout=10.0) as http:
        reply = await http.get(server.metrics_url, headers={"Authorization": f"Bearer {ADMIN}"})
    reply.raise_for_status()
    return reply.text


def metric(text: str, name: str, labels: str = "") -> float:
    """One sample of the exposition (0 when absent)."""
    pattern = rf"^{re.escape(name)}{re.escape(labels) if labels else ''}(?:\{{[^}}]*\}})? (\S+)$"
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@dataclass
class Tally:
    """What the clients saw: outcome -> count; unintended ones with a sample message."""

    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)

    def error(self, what: str, detail: str) -> None:
        self.errors[what] += 1
        self.examples.setdefault(what, detail[:300])


async def _drain(call: AsyncIterator[object]) -> None:
    async for _ in call:
        pass


class Traffic:
    """The scenarios; each records its outcome in ``tally``."""

    def __init__(self, server: ServerProcess, rng: random.Random, tally: Tally) -> None:
        self.server, self.rng, self.tally = server, rng, tally
        self.channel = grpc.aio.insecure_channel(server.target)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.http = httpx.AsyncClient(base_url=server.http_url, timeout=60.0)
        self.seq = 0

    def _key(self) -> str:
        return self.rng.choice(KEYS)

    def _meta(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self._key()}"),)

    def _text(self) -> str:
        # A shared system prefix (prefix-cache hits within a key) and a random tail.
        return "You are a soak test. " + "".join(
            self.rng.choice("abcdefgh ") for _ in range(self.rng.randint(1, 200))
        )

    def _request(self, max_tokens: int, **kw: object) -> pb.GenerateRequest:
        self.seq += 1
        return pb.GenerateRequest(
            text=self._text(),
            request_id=f"s{self.seq}",
            stopping=pb.StoppingOptions(max_tokens=max_tokens),
            **kw,  # type: ignore[arg-type]
        )

    def scenarios(self) -> list[tuple[int, Callable[[], Awaitable[None]]]]:
        """(weight, scenario)."""
        return [
            (20, self.grpc_stream),
            (6, self.grpc_n3),
            (8, self.grpc_cut),
            (6, self.grpc_deadline),
            (3, self.grpc_abort),
            (5, self.grpc_invalid),
            (3, self.grpc_slow_reader),
            (20, self.http_stream),
            (8, self.http_whole_n2),
            (8, self.http_cut),
            (5, self.http_not_json),
        ]

    async def grpc_stream(self) -> None:
        msgs = [
            m
            async for m in self.stub.Generate(
                self._request(self.rng.randint(1, 48)), metadata=self._meta()
            )
        ]
        ok = msgs and msgs[-1].finished
        self.tally.outcomes["grpc_ok"] += 1 if ok else 0
        if not ok:
            self.tally.error("grpc_stream_unfinished", str(msgs[-1:]))

    async def grpc_n3(self) -> None:
        request = self._request(self.rng.randint(1, 24), n=3)
        msgs = [m async for m in self.stub.Generate(request, metadata=self._meta())]
        done = sorted(m.index for m in msgs if m.finished)
        if done == [0, 1, 2]:
            self.tally.outcomes["grpc_n3_ok"] += 1
        else:
            self.tally.error("grpc_n3_samples", str(done))

    async def grpc_cut(self) -> None:
        call = self.stub.Generate(self._request(500), metadata=self._meta())
        async for _ in call:
            break
        call.cancel()
        self.tally.outcomes["cancel"] += 1

    async def _expect(
        self, calls: Awaitable[None], code: grpc.StatusCode, outcome: str, what: str
    ) -> None:
        """``calls`` must end with ``code`` (an intended outcome, counted as ``outcome``)."""
        try:
            await calls
        except grpc.aio.AioRpcError as exc:
            if exc.code() is code:
                self.tally.outcomes[outcome] += 1
                return
            raise
        self.tally.error(f"not_{outcome}", what)

    async def grpc_deadline(self) -> None:
        call = self.stub.Generate(
            self._request(2000), metadata=self._meta(), timeout=self.rng.uniform(0.05, 0.3)
        )
        await self._expect(
            _drain(call),
            grpc.StatusCode.DEADLINE_EXCEEDED,
            "deadline",
            "a 2000-token stream beat its deadline",
        )

    async def grpc_abort(self) -> None:
        meta = self._meta()
        request = self._request(500)
        call = self.stub.Generate(request, metadata=meta)
        msgs = []
        async for m in call:
            msgs.append(m)
            if len(msgs) == 1:
                await self.stub.Abort(pb.AbortRequest(request_id=request.request_id), metadata=meta)
        if msgs[-1].finish_reason == pb.FINISH_REASON_ABORT:
            self.tally.outcomes["abort_call"] += 1
        else:
            self.tally.error("abort_not_reported", str(msgs[-1]))

    async def grpc_invalid(self) -> None:
        call = self.stub.Generate(self._request(10**6), metadata=self._meta())  # past the context
        await self._expect(
            _drain(call),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid",
            "max_tokens beyond the context was served",
        )

    async def grpc_slow_reader(self) -> None:
        async for m in self.stub.Generate(self._request(40), metadata=self._meta()):
            await asyncio.sleep(0.02)
            if m.finished:
                self.tally.outcomes["slow_reader_ok"] += 1

    def _http_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._key()}"}

    async def http_stream(self) -> None:
        body = {"prompt": self._text(), "max_tokens": self.rng.randint(1, 48), "stream": True}
        async with self.http.stream(
            "POST", "/v1/completions", json=body, headers=self._http_headers()
        ) as reply:
            lines = [line async for line in reply.aiter_lines() if line]
        if reply.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in lines[-2]:
            self.tally.outcomes["http_ok"] += 1
        else:
            self.tally.error("http_stream", f"{reply.status_code} {lines[-2:]}")

    async def http_whole_n2(self) -> None:
        body = {"messages": [{"role": "user", "content": self._text()}], "max_tokens": 16, "n": 2}
        reply = await self.http.post(
            "/v1/chat/completions", json=body, headers=self._http_headers()
        )
        if reply.status_code == 200 and len(reply.json()["choices"]) == 2:
            self.tally.outcomes["http_ok"] += 1
        else:
            self.tally.error("http_chat_n2", f"{reply.status_code} {reply.text}")

    async def http_cut(self) -> None:
        body = {"prompt": self._text(), "max_tokens": 500, "stream": True}
        async with self.http.stream(
            "POST", "/v1/completions", json=body, headers=self._http_headers()
        ) as reply:
            async for _ in reply.aiter_lines():
                break  # leaving the block closes the connection mid-stream
        self.tally.outcomes["cancel"] += 1

    async def http_not_json(self) -> None:
        reply = await self.http.post(
            "/v1/completions", content=b"{not json", headers=self._http_headers()
        )
        if reply.status_code == 400:
            self.tally.outcomes["invalid"] += 1
        else:
            self.tally.error("http_not_json", f"{reply.status_code} {reply.text}")

    async def stalled_client(self) -> None:
        """A stream its client never reads: parked, then aborted (ABORTED) by the server."""
        channel = grpc.aio.insecure_channel(
            self.server.target, options=[("grpc.http2.bdp_probe", 0)]
        )
        try:
            stub = pb_grpc.GenerationStub(channel)
            request = self._request(2000, sampling=pb.SamplingOptions(logprobs=20))
            call = stub.Generate(request, metadata=self._meta())
            await asyncio.sleep(STALLED_TIMEOUT_S + 3.0)  # reads nothing meanwhile
            await self._expect(
                _drain(call),
                grpc.StatusCode.ABORTED,
                "stalled",
                "a never-read stream ran to its end",
            )
        finally:
            await channel.close()

    async def idle_connections(self) -> None:
        """Idle and slow-header connections: the server closes them at its header timeout."""
        conns = [
            await asyncio.open_connection("127.0.0.1", self.server.http_port) for _ in range(20)
        ]
        conns[0][1].write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")
        t0 = time.monotonic()
        for reader, writer in conns:
            with contextlib.suppress(ConnectionError):
                async with asyncio.timeout(HEADER_TIMEOUT_S + 10):
                    await reader.read()
            writer.close()
        took = time.monotonic() - t0
        if took <= HEADER_TIMEOUT_S + 5:
            self.tally.outcomes["idle_closed"] += 20
        else:
            self.tally.error("idle_not_closed", f"{took:.1f}s")

    async def run_one(self, scenario: Callable[[], Awaitable[None]]) -> None:
        try:
            await scenario()
        except Exception as exc:  # an unintended outcome to report, never the soak's end
            detail = (
                f"{exc.code().name}: {exc.details()}"
                if isinstance(exc, grpc.aio.AioRpcError)
                else repr(exc)
            )
            self.tally.error(f"{scenario.__name__}", detail)

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()


async def soak(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvserve-soak-"))
    server = start_server(workdir / "server.log", [])
    assert server.proc is not None
    print(
        f"soak: {args.minutes:g} min, {args.workers} clients, fake runner, server pid "
        f"{server.proc.pid}, log {server.log_path}",
        flush=True,
    )
    rng = random.Random(args.seed)
    tally = Tally()
    traffic = Traffic(server, rng, tally)
    weights, scenarios = zip(*traffic.scenarios(), strict=True)
    end_s = time.monotonic() + args.minutes * 60
    warmup_s = max(30.0, args.minutes * 60 / 5)
    samples: list[tuple[float, int, float, float, float]] = []
    failures: list[str] = []

    async def worker() -> None:
        while time.monotonic() < end_s:
            await traffic.run_one(rng.choices(scenarios, weights)[0])

    async def faults() -> None:
        while time.monotonic() < end_s - STALLED_TIMEOUT_S - 10:
            await traffic.run_one(traffic.stalled_client)
            await traffic.run_one(traffic.idle_connections)
            await asyncio.sleep(5.0)

    async def sampler() -> None:
        t0 = time.monotonic()
        print(
            f"{'t_s':>6} {'done':>8} {'errors':>6} {'rss_MiB':>8} {'blocks':>6} "
            f"{'running':>7} {'waiting':>7}",
            flush=True,
        )
        while True:
            text = await scrape(server)
            row = (
                time.monotonic() - t0,
                rss_bytes(server),
                metric(text, "kvserve_kv_cache_blocks", '{state="used"}'),
                metric(text, "kvserve_requests_running"),
                metric(text, "kvserve_requests_waiting"),
            )
            samples.append(row)
            print(
                f"{row[0]:6.0f} {sum(tally.outcomes.values()):8d} {sum(tally.errors.values()):6d}"
                f" {row[1] / 2**20:8.1f} {row[2]:6.0f} {row[3]:7.0f} {row[4]:7.0f}",
                flush=True,
            )
            if time.monotonic() >= end_s:
                return
            await asyncio.sleep(args.sample_s)

    try:
        await asyncio.gather(sampler(), faults(), *(worker() for _ in range(args.workers)))
        # Idle: every request ended, so nothing may hold a block or a seat.
        deadline = time.monotonic() + 15
        while True:
            text = await scrape(server)
            left = [
                metric(text, "kvserve_kv_cache_blocks", '{state="used"}'),
                metric(text, "kvserve_requests_running"),
                metric(text, "kvserve_requests_waiting"),
            ]
            if left == [0, 0, 0] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        print(f"idle: blocks used {left[0]:.0f}, running {left[1]:.0f}, waiting {left[2]:.0f}")
        if left != [0, 0, 0]:
            failures.append(f"not back to 0 once idle: blocks/running/waiting = {left}")
        aborts = {
            r: metric(text, "kvserve_request_aborts_total", f'{{reason="{r}"}}')
            for r in ("deadline", "client_cancel", "abort_call", "stalled")
        }
        seen = {
            "deadline": tally.outcomes["deadline"],
            "client_cancel": tally.outcomes["cancel"],
            "abort_call": tally.outcomes["abort_call"],
            "stalled": tally.outcomes["stalled"],
        }
        print(f"aborts counted by the server: {aborts}\naborts seen by the clients:   {seen}")
        if aborts != {k: float(v) for k, v in seen.items()}:
            failures.append("the server's abort counts differ from what the clients saw")
        internal = re.findall(
            r'kvserve_rpcs_total\{method="([^"]*)",code="(INTERNAL|UNKNOWN)"\} (\S+)', text
        )
        if any(float(v) > 0 for _, _, v in internal):
            failures.append(f"INTERNAL / UNKNOWN calls counted: {internal}")
    finally:
        await traffic.close()
        code = server.stop()
    log_text = server.log()
    for bad in ("Traceback", "ERROR"):
        if bad in log_text:
            failures.append(f"{bad!r} in the server log ({server.log_path})")
    after = [s for s in samples if s[0] >= warmup_s]
    if len(after) >= 2:
        base, last = after[0][1], after[-1][1]
        growth = last / base - 1
        print(
            f"RSS after warm-up ({warmup_s:.0f}s): {base / 2**20:.1f} -> {last / 2**20:.1f} MiB"
            f" ({growth:+.1%}); peak {max(s[1] for s in samples) / 2**20:.1f} MiB"
        )
        if growth > args.max_rss_growth:
            failures.append(
                f"RSS grew {growth:.1%} after warm-up (limit {args.max_rss_growth:.0%})"
            )
    else:
        failures.append("too few samples after warm-up to judge RSS (run longer)")
    if code != 0:
        failures.append(f"the server exited with status {code} after SIGTERM")
    print(f"outcomes: {dict(sorted(tally.outcomes.items()))}")
    print(f"unintended: {dict(tally.errors)}")
    for what, example in tally.examples.items():
        print(f"  {what}: {example}")
    if tally.errors:
        failures.append(f"{sum(tally.errors.values())} unintended outcomes")
    failures += await crash_drill(workdir, rng)
    for failure in failures:
        print(f"FAIL: {failure}")
    print("soak: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


async def crash_drill(workdir: Path, rng: random.Random) -> list[str]:
    """A server whose runner raises at its 300th step, under streams: every stream ends with
    UNAVAILABLE (none hangs) and the server exits with status 1, saying why."""
    server = start_server(
        workdir / "crash.log", ["--fake-crash-at-step", "300", "--max-step-failures", "0"]
    )
    proc = server.proc
    assert proc is not None
    tally = Tally()
    traffic = Traffic(server, rng, tally)
    codes: Counter[str] = Counter()

    async def stream() -> None:
        try:
            async for _ in traffic.stub.Generate(traffic._request(2000), metadata=traffic._meta()):
                pass
            codes["OK"] += 1
        except grpc.aio.AioRpcError as exc:
            codes[exc.code().name] += 1

    try:
        async with asyncio.timeout(60):
            await asyncio.gather(*(stream() for _ in range(8)))
        exit_code = await asyncio.get_running_loop().run_in_executor(None, proc.wait, 30)
    except (TimeoutError, subprocess.TimeoutExpired):
        exit_code = None
    finally:
        await traffic.close()
        server.stop()
    said = "runner died" in server.log()
    print(
        f"crash drill: streams ended {dict(codes)}, server exit status {exit_code}, "
        f"'runner died' logged: {said}"
    )
    if codes != {"UNAVAILABLE": 8} or exit_code != 1 or not said:
        return ["the runner-crash drill did not end with 8 x UNAVAILABLE and exit status 1"]
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 10)))
    p.add_argument("--workers", type=int, default=12, help="concurrent clients")
    p.add_argument("--sample-s", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--max-rss-growth", type=float, default=0.05, help="after warm-up")
    p.add_argument("--seed", type=int, default=0)
    return asyncio.run(soak(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
