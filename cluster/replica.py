"""One kvserve engine as a Ray Serve replica, serving ``kvserve.v1.Generation``.

A replica is today's server started from code: ``server.build.build_engine`` makes the
runner, scheduler, cache manager and engine loop, and ``server.grpc_service.GenerationServicer``
answers the RPCs that Ray Serve's gRPC proxy hands over. Only the gRPC status plumbing
differs: a Ray replica sets the code on Ray's context object instead of aborting a call.

    proxy --(pickled GenerateRequest)--> KVServeReplica.Generate --> GenerationServicer
                                              | record_routing_stats(): load, draining,
                                              v recent block keys -> the router

The replica also reports, through ``record_routing_stats`` (Ray polls it), the chained block
keys of the prompts it admitted recently: a bounded LRU as large as its KV pool, the cheap
stand-in for "which prefixes does my cache hold".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from cache_manager import prefix_block_keys
from cluster.drain import watch_drain
from cluster.metrics import (
    advertised_host,
    labelled_registry,
    start_metrics_server,
)
from cluster.openai_ingress import EXPECTED_CODES, Refusal
from cluster.pd import DEFAULT_MIN_TRANSFER_TOKENS, ROLES, PrefillHandoff, Role, prefill_job
from cluster.routing import routing_keys
from model_runner.lora.info import AdapterInfo
from scheduler.request import Request
from server.config import ServerConfig, build_config
from server.engine import EngineDeadError
from server.engine_client import EngineClient
from server.front import assemble_front
from server.frontend import ServedModel, status_of
from server.lifecycle import drain
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb

if TYPE_CHECKING:
    from metrics.records import MetricsSink
    from server.build import BuiltEngine

logger = logging.getLogger(__name__)


class ReplicaRpcError(Exception):
    """Ends a replica's RPC; the code is already set on Ray's gRPC context."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(code, details)  # both in args: Ray pickles it to the proxy
        self.code, self.details = code, details

    def __str__(self) -> str:
        return f"{self.code.name}: {self.details}"


class QuietRefusals(logging.Filter):
    """Ray's replica logs every exception a method raised, with its traceback (wrapped in
    Ray's ``gRPCStatusError``): a refusal (a status set on purpose: UNAUTHENTICATED,
    RESOURCE_EXHAUSTED, ...) is the client's answer, not a failure; a single server logs
    none."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, ReplicaRpcError):
                return exc.code not in EXPECTED_CODES
            exc = exc.__cause__
        return True


class _RayContext:
    """What ``GenerationServicer`` reads from a grpc.aio context, over Ray's context."""

    def __init__(self, grpc_context: Any) -> None:
        self._context = grpc_context

    def time_remaining(self) -> float | None:
        return None  # the proxy holds the client's deadline and cancels the call at it

    def invocation_metadata(self) -> Any:
        """The client's metadata as the proxy passed it on (its API key, for ownership)."""
        return () if self._context is None else self._context.invocation_metadata()

    def peer(self) -> str:
        """The client's address as the proxy saw it (ownership when auth is off)."""
        return "" if self._context is None else str(self._context.peer())

    def cancelled(self) -> bool:
        return False  # the proxy ends a call its client left; the replica always answers

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        if self._context is not None:
            self._context.set_code(code)
            self._context.set_details(details)
        raise ReplicaRpcError(code, details)


class _ArrivalKeys:
    """Block keys of recently admitted prompts, most recent last, at most ``capacity``."""

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self._keys: OrderedDict[int, None] = OrderedDict()

    def add(self, request: Request) -> None:
        keys = self._keys
        for key in routing_keys(request.prompt_token_ids, self.block_size, request.cache_salt):
            keys[key] = None
            keys.move_to_end(key)
        while len(keys) > self.capacity:
            keys.popitem(last=False)

    def snapshot(self) -> list[int]:
        return list(self._keys)


class _ReportingClient(EngineClient):
    """An ``EngineClient`` that notes each admitted prompt's block keys for the router; on a
    decode replica it first hands the prompt to a prefill replica (``cluster.pd``)."""

    def __init__(
        self,
        engine: Any,
        arrivals: _ArrivalKeys,
        handoff: PrefillHandoff | None = None,
        adapters: Any = None,
    ) -> None:
        super().__init__(engine, adapters)
        self.arrivals = arrivals
        self.handoff = handoff

    async def generate(
        self, request: Request, *, deadline_s: float | None = None
    ) -> AsyncIterator[GenerationOutput]:
        self.arrivals.add(request)
        if self.handoff is not None:
            await self.handoff.before(request)
        async for out in super().generate(request, deadline_s=deadline_s):
            yield out


def _check_role(role: str, cfg: ServerConfig, prefill: Any) -> None:
    """``ValueError`` unless a replica of ``role`` can run as ``cfg`` and ``prefill`` say."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if role != "both" and cfg.kv_disk_dir is None:
        raise ValueError(f"a {role} replica needs the shared KV tier: set kv_disk_dir")
    if role == "decode" and prefill is None:
        raise ValueError("a decode replica needs the prefill deployment's handle")


def _calibrate(built: BuiltEngine) -> None:
    """The cost router prices prefills with this replica's own step-cost model (fitted
    online from every step, as the slo policy's is): calibrated now, where the policy is not
    slo."""
    from server.calibration import calibrate

    built.engine.cost_model = calibrate(
        built.runner, built.scheduler.kv.config, built.model.max_model_len
    )


def _handoff(
    role: str,
    built: BuiltEngine,
    prefill: Any,
    sink: MetricsSink,
    timeout_s: float,
    min_tokens: int,
) -> PrefillHandoff | None:
    """A decode replica's handoff of its prompts to the prefill deployment (``cluster.pd``);
    None for the other roles."""
    if role != "decode":
        return None
    model = built.model
    return PrefillHandoff(
        prefill,
        built.scheduler.kv.has_cached_key,
        model.block_size,
        model.kv_memory_bytes // max(model.num_blocks, 1),
        sink,
        timeout_s=timeout_s,
        min_tokens=min_tokens,
    )


class KVServeReplica:
    """The Ray Serve deployment class (``cluster.app`` wraps it with ``serve.deployment``).

    ``engine`` holds ``ServerConfig`` settings (the same keys as ``kvserve serve``'s flags);
    ``metrics_host`` / ``metrics_port`` say where this replica serves ``/metrics`` (port 0:
    a free one, reported to the router, which lists it at ``/targets``).
    """

    async def __init__(
        self,
        engine: dict[str, Any] | None = None,
        *,
        metrics_host: str = "127.0.0.1",
        metrics_port: int = 0,
        report_prices: bool = False,
        role: Role = "both",
        prefill: Any = None,
        transfer_timeout_s: float = 60.0,
        transfer_min_tokens: int = DEFAULT_MIN_TRANSFER_TOKENS,
    ) -> None:
        from ray import serve

        from server.build import attach_metrics, build_engine

        cfg: ServerConfig = build_config(engine or {}, environ={})
        _check_role(role, cfg, prefill)
        self.role = role
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        logging.getLogger("ray.serve").addFilter(QuietRefusals())
        rank = getattr(context, "rank", None)
        self.replica = str(getattr(rank, "rank", rank) if rank is not None else self.replica_id)
        built = build_engine(cfg)
        if report_prices and built.engine.cost_model is None:
            _calibrate(built)
        self.built = built
        self.model = built.model
        self.arrivals = _ArrivalKeys(built.model.num_blocks, built.model.block_size)
        self.draining = False
        self._metrics_server: Any = None
        self.metrics_url = ""
        sink, registry = attach_metrics(built, cfg, replica_id=self.replica_id)
        # A single server's API keys, tenants and structured outputs, on the gRPC path too.
        security = cfg.security()
        if registry is not None:
            served = labelled_registry(registry, {"replica": self.replica, "role": role})
            self._metrics_server = start_metrics_server(
                metrics_host, metrics_port, served, security, cfg.edge_limits().metrics
            )
            self.metrics_url = f"{advertised_host(metrics_host)}:{self._metrics_server.port}"
        handoff = _handoff(role, built, prefill, sink, transfer_timeout_s, transfer_min_tokens)
        client = _ReportingClient(built.engine, self.arrivals, handoff, built.adapters)
        front = assemble_front(client, built.tokenizer, built.model, security, sink=sink)
        self.client, self.frontend, self.servicer = client, front.frontend, front.servicer
        built.engine.start()
        self._drain = watch_drain(context.app_name, f"replica {self.replica}", self.drain)
        logger.info(
            "replica %s (%s, %s): %s, %d KV blocks, metrics %s", self.replica, role,
            self.replica_id, built.model.name, built.model.num_blocks, self.metrics_url or "off",
        )  # fmt: skip

    # ------------------------------------------------------------------ Ray Serve hooks
    def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads (Ray polls it every ``request_routing_stats_period_s``):
        load, recent block keys, and the prices the cost router charges (this replica's
        step-cost model and its mean tier-2 restore time per block, when it has them)."""
        engine = self.built.engine
        handoff = self.client.handoff
        model = engine.cost_model
        tier2 = engine.latest_stats.kv.tier2
        restore_s = tier_blocks = None
        if tier2 is not None and tier2.restore_blocks_total:
            restore_s = tier2.restore_seconds_total / tier2.restore_blocks_total
        if tier2 is not None and self.model.num_blocks:
            tier_blocks = tier2.capacity_bytes * self.model.num_blocks // self.model.kv_memory_bytes
        return {
            "replica": self.replica,
            "role": self.role,
            "num_ongoing": self.client.num_in_flight,
            # A dead engine answers UNAVAILABLE until Ray replaces the replica: route around it.
            "draining": self.draining or not engine.is_alive,
            "block_size": self.model.block_size,
            "kv_blocks": self.model.num_blocks,  # the router's index of it holds as many keys
            "keys": self.arrivals.snapshot(),
            "metrics_url": self.metrics_url,
            "cost_model_s": None if model is None else list(model.coefficients_s),
            "restore_s_per_block": restore_s,
            # A decode replica's prefill replicas: listed at the router's /targets too.
            "peer_metrics_urls": handoff.peer_metrics_urls() if handoff is not None else [],
            "tier2_capacity_blocks": tier_blocks,
            # LoRA adapters -> the key of their weights: the router salts an adapter's prompt
            # keys as this replica's cache does (server.lora.cache_salt_with).
            "adapters": {a.name: a.key for a in self.frontend.adapters.infos()},
        }

    async def drain(self, grace_s: float) -> None:
        """The cluster's drain (``cluster.drain``): refuse new generations, give in-flight
        ones ``grace_s``, then abort the rest (their streams end saying retry)."""
        self.draining = True
        await drain(self.frontend, self.client, grace_s, abort_grace_s=1.0)

    def check_health(self) -> None:
        """Ray restarts a replica whose engine thread died."""
        if not self.built.engine.is_alive:
            error = self.built.engine.dead_error
            raise RuntimeError(f"replica {self.replica}: engine died: {error!r}")

    def __del__(self) -> None:
        """Ray Serve calls this after the replica drained: it takes no new requests (Ray took
        it out of routing first) and waited up to ``graceful_shutdown_timeout_s``."""
        self.draining = True
        self.frontend.accepting = False
        with contextlib.suppress(Exception):
            self.built.engine.stop(timeout_s=1.0)
        if self._metrics_server is not None:
            with contextlib.suppress(Exception):
                self._metrics_server.stop()

    # ------------------------------------------------------------------ kvserve.v1.Generation
    async def Generate(
        self, request: pb.GenerateRequest, grpc_context: Any = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        context = _RayContext(grpc_context)
        async for response in self.servicer.Generate(request, context):  # type: ignore[arg-type]
            yield response

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context: Any = None) -> Any:
        return await self.servicer.Tokenize(request, _RayContext(grpc_context))  # type: ignore[arg-type]

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context: Any = None) -> Any:
        return await self.servicer.GetModelInfo(request, _RayContext(grpc_context))  # type: ignore[arg-type]

    async def GetKVCacheStats(
        self, request: pb.GetKVCacheStatsRequest, grpc_context: Any = None
    ) -> Any:
        return await self.servicer.GetKVCacheStats(request, _RayContext(grpc_context))  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the OpenAI ingress
    async def generate_request(
        self, request: Request, timeout_s: float | None = None
    ) -> AsyncIterator[GenerationOutput | Refusal]:
        """An engine request the cluster's OpenAI ingress built (validated, tokenized, its
        owner's salt and tenant set): its outputs as the engine publishes them, or a
        ``Refusal`` (a status set on purpose: an exception here would be logged by Ray with
        its traceback). The caller cancelling the call aborts the request here."""
        now = time.monotonic()
        request.arrival_time_s = now  # this host's clock: queue and TTFT are timed here
        deadline_s = None if timeout_s is None else now + timeout_s
        try:
            if not self.frontend.accepting:
                raise EngineDeadError("server is shutting down")
            async for out in self.client.generate(request, deadline_s=deadline_s):
                yield out
        except Exception as exc:
            code, details = status_of(exc)
            if code not in EXPECTED_CODES:
                raise
            yield Refusal(code.name, details)

    async def prefill_request(self, request: Request) -> dict[str, Any]:
        """A decode replica's handoff (``cluster.pd``): compute ``request``'s prompt KV here
        and publish its full blocks to the shared store; once written, how many (``blocks``)
        and where this replica's metrics are (``metrics_url``)."""
        job = prefill_job(request)
        async for _ in self.client.generate(job):
            pass
        tokens = job.prompt_token_ids
        keys = prefix_block_keys(tokens[: len(tokens) - 1], self.model.block_size, job.cache_salt)
        tier = self.built.engine.tier
        if not await asyncio.to_thread(tier.wait_written, keys, job.cache_salt):
            raise TimeoutError(
                f"{len(keys)} blocks not published: the shared KV tier (kv_disk_dir) did not "
                "write them in time, or there is none"
            )
        return {"blocks": len(keys), "metrics_url": self.metrics_url}

    def served_model(self) -> ServedModel:
        """What the OpenAI ingress serves: this replica's model, context and limits."""
        return self.model

    def served_adapters(self) -> list[AdapterInfo]:
        """The LoRA adapters this replica serves (every replica loads the same ``--lora``)."""
        return self.frontend.adapters.infos()

    async def Abort(self, request: pb.AbortRequest, grpc_context: Any = None) -> Any:
        """The router sends an Abort to the replica that runs the request it names."""
        return await self.servicer.Abort(request, _RayContext(grpc_context))  # type: ignore[arg-type]
