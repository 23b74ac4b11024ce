"""The kvserve Ray Serve application: N replicas of one engine behind the gRPC proxy.

    from cluster.app import build_app, grpc_options
    serve.start(grpc_options=grpc_options(50051))
    serve.run(build_app({"runner": "fake"}, num_replicas=2, router="prefix"), name="kvserve")

or from a Ray Serve config file (``cluster/kvserve.yaml``; ``serve run`` / ``serve deploy``),
whose ``args`` reach ``app_builder``. The engine settings are ``kvserve serve``'s
(``server.config.ServerConfig`` keys), validated here, before any replica starts.

The hook for an HTTP front end (the OpenAI-compatible API): an ingress deployment that takes
the replicas' handle and streams their ``Generate``, routed by the same router::

    @serve.deployment
    class HTTPIngress:
        def __init__(self, replicas: DeploymentHandle) -> None:
            self.replicas = replicas.options(stream=True, method_name="Generate")
        ...   # async for response in self.replicas.remote(pb.GenerateRequest(...)): ...

    serve.run(HTTPIngress.bind(build_app(cfg)), name="kvserve")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.routing import ROUTERS
from server.config import build_config

GENERATION_SERVICER = "cluster.ingress.add_generation_service"
ROUTER_CLASS = "cluster.ray_router:KVServeRequestRouter"
DEFAULT_APP_NAME = "kvserve"


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How many replicas, how requests find them, and each replica's engine settings."""

    engine: dict[str, Any] = field(default_factory=dict)  # ServerConfig keys
    num_replicas: int = 2
    router: str = "cost"
    imbalance_abs: int = 8  # prefix router's load guard: busiest - idlest > this ...
    imbalance_rel: float = 1.5  # ... and busiest > this x idlest -> power of two choices
    router_metrics_port: int | None = None  # /metrics + /targets of the router (proxy)
    metrics_host: str = "127.0.0.1"  # where replicas and the router serve /metrics
    replica_num_cpus: float = 0.0  # Ray CPUs each replica reserves
    max_ongoing_requests: int = 1024  # per replica; the engine queues and admits itself
    routing_stats_period_s: float = 1.0  # how often Ray polls each replica's report
    health_check_period_s: float = 2.0
    graceful_shutdown_timeout_s: float = 30.0  # a stopping replica drains this long

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        if self.imbalance_abs < 0 or self.imbalance_rel < 1.0:
            raise ValueError(
                f"imbalance_abs must be >= 0 and imbalance_rel >= 1.0, "
                f"got {self.imbalance_abs} and {self.imbalance_rel}"
            )
        if self.replica_num_cpus < 0:
            raise ValueError(f"replica_num_cpus must be >= 0, got {self.replica_num_cpus}")
        build_config(self.engine, environ={})  # engine settings fail here, with their name


def grpc_options(port: int = 50051) -> Any:
    """Ray Serve's gRPC proxy options that serve ``kvserve.v1.Generation`` on ``port``."""
    from ray.serve.config import gRPCOptions

    if not 1 <= port <= 65535:
        raise ValueError(f"the gRPC proxy needs a fixed port in [1, 65535], got {port}")
    return gRPCOptions(port=port, grpc_servicer_functions=[GENERATION_SERVICER])


def build_app(cfg: ClusterConfig) -> Any:
    """The Ray Serve application (``serve.run`` it)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cluster.replica import KVServeReplica

    engine = build_config(cfg.engine, environ={})
    capacity_blocks = engine.num_blocks or 4096  # refined by each replica's own report
    shared_tier_blocks = None
    if engine.kv_disk_dir is not None:  # one store shared by the replicas: a key per block
        shared_tier_blocks = 8 * capacity_blocks
    router_config = RequestRouterConfig(
        request_router_class=ROUTER_CLASS,
        request_router_kwargs={
            "router": cfg.router,
            "engine": {"runner": engine.runner, "model": engine.model},
            "block_size": engine.block_size,
            "capacity_blocks": capacity_blocks,
            "imbalance_abs": cfg.imbalance_abs,
            "imbalance_rel": cfg.imbalance_rel,
            "metrics_host": cfg.metrics_host,
            "metrics_port": cfg.router_metrics_port,
            "shared_tier_blocks": shared_tier_blocks,
            "chunk_tokens": engine.long_prefill_token_threshold or engine.max_num_batched_tokens,
        },
        request_routing_stats_period_s=cfg.routing_stats_period_s,
        request_routing_stats_timeout_s=max(cfg.routing_stats_period_s, 1.0),
    )
    deployment = serve.deployment(
        KVServeReplica,
        name="KVServeReplica",
        num_replicas=cfg.num_replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.replica_num_cpus},
        health_check_period_s=cfg.health_check_period_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        request_router_config=router_config,
    )
    return deployment.bind(
        dict(cfg.engine),
        metrics_host=cfg.metrics_host,
        metrics_port=0,
        report_prices=cfg.router == "cost",
    )


def app_builder(args: dict[str, Any]) -> Any:
    """``import_path: cluster.app:app_builder`` for ``serve run`` / ``serve deploy``."""
    known = set(ClusterConfig.__dataclass_fields__)
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(
            f"unknown kvserve cluster setting(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(known))}"
        )
    return build_app(ClusterConfig(**args))
