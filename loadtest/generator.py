"""The asyncio load generator: open loop (Poisson / gamma arrivals) or closed loop (N users).

Both loops are bounded by a request count AND a time limit. At the time limit no new request
is sent and the requests still in flight are cancelled (recorded as ``interrupted``), so a run
ends by itself within ``duration_s`` plus the time a cancellation takes.

Arrivals (open loop) are drawn before the run from ``random.Random(f"{seed}:arrivals")``:
inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean ``1 / rate``
(``burstiness == 1`` is a Poisson process; below 1 burstier, above 1 more regular).
``rate == inf`` sends everything at once.

Every request of a run carries the run's ``cache_salt``, so a run finds nothing in the prefix
cache that an earlier run (or an earlier point of a sweep) left there: its hits are its own.
By default each ``LoadConfig`` draws a fresh salt; ``cache_salt=None`` sends none and lets a
run reuse what earlier runs cached (``--reuse-cache``).

The wire protocol is a backend's (``loadtest.backend``): kvserve's gRPC service (``api="grpc"``)
or any OpenAI-compatible HTTP server (``api="openai"``). Loops, clocks and records are the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from loadtest import server_stats
from loadtest.backend import Backend, RequestFailed
from loadtest.stats import SLO, Outcome, RequestResult
from loadtest.workload import RequestSpec, Workload, arrival_offsets
from server.client import CONNECT_TIMEOUT_S

API_CHOICES = ("grpc", "openai")


def make_backend(api: str, target: str) -> Backend:
    """The backend for ``api`` ("grpc" or "openai") at ``target`` (host:port, or a URL)."""
    if api == "grpc":
        from loadtest.grpc_backend import GrpcBackend

        return GrpcBackend(target)
    if api == "openai":
        from loadtest.openai_backend import OpenAIBackend

        return OpenAIBackend(target)
    raise ValueError(f"api must be one of {', '.join(API_CHOICES)}, got {api!r}")


def new_cache_salt() -> str:
    """A salt no earlier run used: its requests share no prefix-cache entry with theirs."""
    return f"loadtest-{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class LoadConfig:
    """How to drive the server. ``mode`` is "open" (``rate``) or "closed" (``users``).

    ``cache_salt`` goes with every request (default: a fresh one per config); None sends no
    salt, so the run may hit what earlier runs left in the prefix cache.
    ``api`` picks the backend: "grpc" (``target`` is host:port) or "openai" (``target`` is the
    server's base URL, ``http://host:port``).
    """

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
    cache_salt: str | None = field(default_factory=new_cache_salt)
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    api: str = "grpc"

    def __post_init__(self) -> None:
        if self.api not in API_CHOICES:
            raise ValueError(f"api must be one of {', '.join(API_CHOICES)}, got {self.api!r}")
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
        if self.cache_salt == "":
            raise ValueError("cache_salt must be a non-empty string, or None for no salt")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")

    def describe(self) -> dict[str, Any]:
        return {
            "api": self.api,
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
            "reuse_cache": self.cache_salt is None,
            "cache_salt": self.cache_salt,
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


class LoadGenerator:
    """Runs one workload against one server. Use ``asyncio.run(LoadGenerator(...).run())``.

    ``backend`` defaults to the one ``config.api`` names, at ``config.target``.
    """

    def __init__(
        self, config: LoadConfig, workload: Workload, backend: Backend | None = None
    ) -> None:
        self.config = config
        self.workload = workload
        self.backend = backend if backend is not None else make_backend(config.api, config.target)
        self.specs: list[RequestSpec] = []  # drawn once the server's vocabulary is known
        self._tag = uuid.uuid4().hex[:8]
        self._results: list[RequestResult] = []
        self._bar: tqdm[Any] | None = None
        self._num_ok = 0
        self._num_failed = 0

    async def run(self) -> RunResult:
        cfg = self.config
        await self.backend.open(wait_s=cfg.connect_timeout_s)
        try:
            self.specs = self.workload.build(
                cfg.num_requests, vocab_size=await self.backend.vocab_size()
            )
            view = await self._server_snapshot(None)
            sampler = asyncio.create_task(self._sample_usage(view)) if view else None
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
                    await self._open_loop(start, deadline)
                else:
                    await self._closed_loop(deadline)
            finally:
                self._bar.close()
                if sampler is not None:
                    sampler.cancel()
                    await asyncio.gather(sampler, return_exceptions=True)
            end = max([start, *(r.end_s for r in self._results)])
            server = None
            if view is not None:
                await self._server_snapshot(view)
                server = view.report()
        finally:
            await self.backend.close()
        self._results.sort(key=lambda r: r.index)
        return RunResult(cfg, self._results, len(self.specs), start, end, server)

    # ------------------------------------------------------------------ loops

    async def _open_loop(self, start: float, deadline: float) -> None:
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
            tasks.append(asyncio.create_task(self._one(spec)))
        await self._wait_until(tasks, deadline)

    async def _closed_loop(self, deadline: float) -> None:
        queue = iter(self.specs)

        async def user() -> None:
            for spec in queue:  # a shared iterator: each request is taken by exactly one user
                if time.perf_counter() >= deadline:
                    return
                await self._one(spec)

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

    async def _one(self, spec: RequestSpec) -> None:
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
        stream = self.backend.generate(
            spec, request_id, self.config.request_timeout_s, cache_salt=self.config.cache_salt
        )
        finished = False
        try:
            # Leaving the block closes the stream, which stops the request on the server.
            async with contextlib.aclosing(stream):
                async for event in stream:
                    now = time.perf_counter()
                    if event.num_tokens:
                        res.token_arrivals.append((now, event.num_tokens))
                    if event.finish_reason is not None:
                        finished = True
                        res.finish_reason = event.finish_reason
                        res.num_prompt_tokens = event.num_prompt_tokens or res.num_prompt_tokens
                        if event.num_cached_tokens is not None:
                            res.num_cached_tokens = event.num_cached_tokens
                        if event.failed:
                            res.outcome, res.code = Outcome.FAILED, event.finish_reason
                        else:
                            res.outcome, res.code = Outcome.OK, "OK"
                        break
                    cancel_at = spec.cancel_after_tokens
                    if cancel_at is not None and res.num_output_tokens >= cancel_at:
                        res.outcome, res.code = Outcome.CANCELLED, "CANCELLED"
                        finished = True
                        break
            if not finished:
                res.outcome, res.code = Outcome.FAILED, "INCOMPLETE_STREAM"
        except RequestFailed as e:
            res.outcome, res.code, res.error = Outcome.FAILED, e.code, e.error
        except asyncio.CancelledError:
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
        self, view: server_stats.ServerView | None
    ) -> server_stats.ServerView | None:
        """First call: the 'before' view (None when the server offers no stats); then 'after'."""
        samples = await self._read_server()
        if samples is None:
            return None
        if view is None:
            source = "metrics" if self.config.metrics_url else self.backend.api
            view = server_stats.ServerView(source=source, before=samples)
        else:
            view.after = samples
        view.sample_usage(samples)
        return view

    async def _read_server(self) -> server_stats.Samples | None:
        url = self.config.metrics_url
        if url:
            return await asyncio.to_thread(server_stats.scrape, url)
        return await self.backend.read_server()

    async def _sample_usage(self, view: server_stats.ServerView) -> None:
        while True:
            await asyncio.sleep(self.config.sample_interval_s)
            try:
                samples = await self._read_server()
            except OSError:
                continue  # a missed scrape lowers the resolution of the peak, nothing else
            if samples is not None:
                view.sample_usage(samples)
