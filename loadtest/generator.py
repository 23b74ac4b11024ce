"""The asyncio gRPC load generator: open loop (Poisson / gamma arrivals) or closed loop (N users).

Both loops are bounded by a request count AND a time limit. At the time limit no new request
is sent and the requests still in flight are cancelled (recorded as ``interrupted``), so a run
ends by itself within ``duration_s`` plus the time a cancellation takes.

Arrivals (open loop) are drawn before the run from ``random.Random(f"{seed}:arrivals")``:
inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean ``1 / rate``
(``burstiness == 1`` is a Poisson process; below 1 burstier, above 1 more regular).
``rate == inf`` sends everything at once.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from tqdm import tqdm

from loadtest import server_stats
from loadtest.stats import SLO, Outcome, RequestResult
from loadtest.workload import RequestSpec, Workload, arrival_offsets
from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc

_FAILED_FINISH = {
    pb.FINISH_REASON_ERROR: "FINISH_REASON_ERROR",
    pb.FINISH_REASON_ABORT: "FINISH_REASON_ABORT",
}


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to drive the server. ``mode`` is "open" (``rate``) or "closed" (``users``)."""

    target: str
    mode: str = "closed"
    rate: float = math.inf  # requests/s (open loop)
    burstiness: float = 1.0
    users: int = 1  # concurrent users (closed loop)
    num_requests: int = 100
    duration_s: float = 600.0
    seed: int = 0
    request_timeout_s: float | None = None
    slo: SLO = field(default_factory=SLO)
    metrics_url: str | None = None
    sample_interval_s: float = 1.0
    progress: bool = True
    progress_desc: str = "loadtest"

    def __post_init__(self) -> None:
        if self.mode not in ("open", "closed"):
            raise ValueError(f"mode must be open|closed, got {self.mode!r}")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}")
        if self.users < 1:
            raise ValueError(f"users must be >= 1, got {self.users}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.sample_interval_s > 0:
            raise ValueError(f"sample_interval_s must be > 0, got {self.sample_interval_s}")

    def describe(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "mode": self.mode,
            "rate": None if self.mode == "closed" or math.isinf(self.rate) else self.rate,
            "burstiness": self.burstiness if self.mode == "open" else None,
            "users": self.users if self.mode == "closed" else None,
            "num_requests": self.num_requests,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "request_timeout_s": self.request_timeout_s,
            "metrics_url": self.metrics_url,
        }


@dataclass(slots=True)
class RunResult:
    """Everything one run measured; ``loadtest.report`` turns it into the summary and JSON."""

    config: LoadConfig
    results: list[RequestResult]  # one per request sent, in send order
    num_planned: int
    start_s: float
    end_s: float
    server: dict[str, Any] | None = None


def build_request(spec: RequestSpec, request_id: str) -> pb.GenerateRequest:
    sampling = pb.SamplingOptions(**{k: v for k, v in spec.sampling.items()})
    stopping = pb.StoppingOptions(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos)
    req = pb.GenerateRequest(
        sampling=sampling, stopping=stopping, request_id=request_id, priority=spec.priority
    )
    if spec.prompt_token_ids is not None:
        req.token_ids.ids.extend(spec.prompt_token_ids)
    else:
        assert spec.prompt_text is not None
        req.text = spec.prompt_text
    return req


class LoadGenerator:
    """Runs one workload against one server. Use ``asyncio.run(LoadGenerator(...).run())``."""

    def __init__(self, config: LoadConfig, workload: Workload) -> None:
        self.config = config
        self.workload = workload
        self.specs: list[RequestSpec] = []  # drawn once the server's vocabulary is known
        self._tag = uuid.uuid4().hex[:8]
        self._results: list[RequestResult] = []
        self._bar: tqdm[Any] | None = None
        self._num_ok = 0
        self._num_failed = 0

    async def run(self) -> RunResult:
        cfg = self.config
        async with grpc.aio.insecure_channel(
            cfg.target, options=[("grpc.max_receive_message_length", 64 << 20)]
        ) as channel:
            stub = pb_grpc.GenerationStub(channel)
            wait_s = min(30.0, cfg.duration_s)
            try:
                await asyncio.wait_for(channel.channel_ready(), timeout=wait_s)
            except TimeoutError:
                raise ConnectionError(
                    f"no server answered at {cfg.target} within {wait_s:g}s"
                ) from None
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10.0)
            self.specs = self.workload.build(cfg.num_requests, vocab_size=info.vocab_size)
            view = await self._server_snapshot(stub, None)
            sampler = asyncio.create_task(self._sample_usage(stub, view)) if view else None
            self._bar = tqdm(
                total=len(self.specs),
                desc=cfg.progress_desc,
                unit="req",
                file=sys.stderr,
                disable=not cfg.progress,
                dynamic_ncols=True,
            )
            start = time.perf_counter()
            deadline = start + cfg.duration_s
            try:
                if cfg.mode == "open":
                    await self._open_loop(stub, start, deadline)
                else:
                    await self._closed_loop(stub, deadline)
            finally:
                self._bar.close()
                if sampler is not None:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
            end = max([start, *(r.end_s for r in self._results)])
            server = None
            if view is not None:
                await self._server_snapshot(stub, view)
                server = view.report()
        self._results.sort(key=lambda r: r.index)
        return RunResult(cfg, self._results, len(self.specs), start, end, server)

    # ------------------------------------------------------------------ loops

    async def _open_loop(self, stub: pb_grpc.GenerationStub, start: float, deadline: float) -> None:
        cfg = self.config
        offsets = arrival_offsets(len(self.specs), cfg.rate, cfg.burstiness, cfg.seed)
        tasks: list[asyncio.Task[None]] = []
        for spec, offset in zip(self.specs, offsets, strict=True):
            send_at = start + offset
            if send_at >= deadline:
                break
            delay = send_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._one(stub, spec)))
        await self._wait_until(tasks, deadline)

    async def _closed_loop(self, stub: pb_grpc.GenerationStub, deadline: float) -> None:
        queue = iter(self.specs)

        async def user() -> None:
            for spec in queue:  # a shared iterator: each request is taken by exactly one user
                if time.perf_counter() >= deadline:
                    return
                await self._one(stub, spec)

        users = [asyncio.create_task(user()) for _ in range(self.config.users)]
        await self._wait_until(users, deadline)

    async def _wait_until(self, tasks: list[asyncio.Task[None]], deadline: float) -> None:
        """Wait for ``tasks`` until ``deadline``; cancel the rest (their requests: interrupted)."""
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        # Retrieve every outcome (a bug inside _one surfaces here instead of being lost).
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, BaseException) and not isinstance(
                outcome, asyncio.CancelledError
            ):
                raise outcome

    # ------------------------------------------------------------------ one request

    async def _one(self, stub: pb_grpc.GenerationStub, spec: RequestSpec) -> None:
        request_id = f"lt-{self._tag}-{spec.index}"
        res = RequestResult(
            index=spec.index,
            request_id=request_id,
            priority=spec.priority,
            num_prompt_tokens=spec.num_prompt_tokens or 0,
            max_tokens=spec.max_tokens,
            cancel_after_tokens=spec.cancel_after_tokens,
            send_s=time.perf_counter(),
        )
        self._results.append(res)
        call = stub.Generate(build_request(spec, request_id), timeout=self.config.request_timeout_s)
        finished = False
        try:
            async for msg in call:
                now = time.perf_counter()
                if msg.token_ids:
                    res.token_arrivals.append((now, len(msg.token_ids)))
                if msg.finished:
                    finished = True
                    res.finish_reason = pb.FinishReason.Name(msg.finish_reason)
                    if msg.HasField("usage"):
                        res.num_prompt_tokens = msg.usage.prompt_tokens or res.num_prompt_tokens
                        res.num_cached_tokens = msg.usage.cached_prompt_tokens
                    if msg.finish_reason in _FAILED_FINISH:
                        res.outcome, res.code = Outcome.FAILED, _FAILED_FINISH[msg.finish_reason]
                    else:
                        res.outcome, res.code = Outcome.OK, "OK"
                    break
                cancel_at = spec.cancel_after_tokens
                if cancel_at is not None and res.num_output_tokens >= cancel_at:
                    call.cancel()
                    res.outcome, res.code = Outcome.CANCELLED, "CANCELLED"
                    finished = True
                    break
            if not finished:
                res.outcome, res.code = Outcome.FAILED, "INCOMPLETE_STREAM"
        except grpc.aio.AioRpcError as e:
            res.outcome, res.code, res.error = Outcome.FAILED, e.code().name, e.details() or ""
        except asyncio.CancelledError:
            call.cancel()
            res.outcome, res.code = Outcome.INTERRUPTED, "INTERRUPTED"
            raise
        finally:
            res.end_s = time.perf_counter()
            self._on_done(res)

    def _on_done(self, res: RequestResult) -> None:
        if res.outcome == Outcome.OK:
            self._num_ok += 1
        elif res.outcome == Outcome.FAILED:
            self._num_failed += 1
        if self._bar is not None and res.outcome != Outcome.INTERRUPTED:
            self._bar.set_postfix(ok=self._num_ok, failed=self._num_failed, refresh=False)
            self._bar.update(1)

    # ------------------------------------------------------------------ server stats

    async def _server_snapshot(
        self, stub: pb_grpc.GenerationStub, view: server_stats.ServerView | None
    ) -> server_stats.ServerView | None:
        """First call: the 'before' view (None when the server offers no stats); then 'after'."""
        samples = await self._read_server(stub)
        if samples is None:
            return None
        if view is None:
            source = "metrics" if self.config.metrics_url else "grpc"
            view = server_stats.ServerView(source=source, before=samples)
        else:
            view.after = samples
        view.sample_usage(samples)
        return view

    async def _read_server(self, stub: pb_grpc.GenerationStub) -> server_stats.Samples | None:
        url = self.config.metrics_url
        if url:
            return await asyncio.to_thread(server_stats.scrape, url)
        try:
            reply = await stub.GetKVCacheStats(pb.GetKVCacheStatsRequest(), timeout=5.0)
        except grpc.aio.AioRpcError:
            return None
        return server_stats.kv_stats_samples(reply)

    async def _sample_usage(
        self, stub: pb_grpc.GenerationStub, view: server_stats.ServerView
    ) -> None:
        while True:
            await asyncio.sleep(self.config.sample_interval_s)
            try:
                samples = await self._read_server(stub)
            except OSError:
                continue  # a missed scrape lowers the resolution of the peak, nothing else
            if samples is not None:
                view.sample_usage(samples)
