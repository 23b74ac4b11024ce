"""The kvserve Ray Serve application: N replicas of one engine behind the gRPC proxy.

    from cluster.app import build_app, grpc_options
    serve.start(grpc_options=grpc_options(50051))
    serve.run(build_app({"runner": "fake"}, num_replicas=2, router="prefix"), name="kvserve")

or from a Ray Serve config file (``cluster/kvserve.yaml``; ``serve run`` / ``serve deploy``),
whose ``args`` reach ``app_builder``. The engine settings are ``kvserve serve``'s
(``server.config.ServerConfig`` keys), validated here, before any replica starts.

The OpenAI-compatible API is a second application, one ingress (``cluster.openai_ingress``)
at route ``/`` of Ray Serve's HTTP proxy, that reaches the replicas through their handle, so
through the same request router as gRPC::

    serve.start(grpc_options=grpc_options(50051), http_options={"port": 8000})
    serve.run(build_app(cfg), name="kvserve", route_prefix=GRPC_ROUTE_PREFIX)
    serve.run(build_openai_app(cfg, "kvserve"), name="kvserve-openai", route_prefix="/")

(The gRPC proxy sends a call without ``application`` metadata to the replicas' application:
``cluster.ingress`` makes it, so a plain gRPC client works with both applications up.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from cluster.edge import INTERNAL_ROUTE
from cluster.pd import DEFAULT_MIN_TRANSFER_TOKENS
from cluster.routing import DEFAULT_GUARD, ROUTERS, LoadGuard
from server.config import build_config

logger = logging.getLogger(__name__)

GENERATION_SERVICER = "cluster.ingress.add_generation_service"
ROUTER_CLASS = "cluster.ray_router:KVServeRequestRouter"
DEFAULT_APP_NAME = "kvserve"
PREFILL_DEPLOYMENT = "KVServePrefill"  # the prefill replicas of a prefill / decode split
OPENAI_APP_NAME = "kvserve-openai"  # the OpenAI ingress: an application of its own, route "/"
# The replicas' application needs a route for Ray's gRPC proxy to see it at all; "/" is the
# OpenAI ingress's, so it gets this one (the proxy's edge answers 404 there: cluster.edge).
GRPC_ROUTE_PREFIX = INTERNAL_ROUTE
# How often a stopping replica looks whether its requests ended (Ray's default: 2 s, slept
# before the first look, although the cluster's drain has emptied it already).
SHUTDOWN_WAIT_LOOP_S = 0.2

# Ray Serve gives its proxy 5 s to answer a readiness check and kills it after 3 missed
# health checks: on a host whose cores are busy with other work (a compiler, a test run) a
# starting proxy missed them and `serve.start` died with ActorDiedError. Set (unless the
# environment says otherwise) before ray.init, so the processes Ray starts inherit them.
RAY_ENV_FOR_BUSY_HOSTS = {
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
    # The head waits this long for its GCS to write its port file (Ray's default: 30 s;
    # a fresh clone's CI once missed it).
    "RAY_gcs_server_port_wait_time_s": "120",
}


def set_ray_env(environ: MutableMapping[str, str]) -> None:
    """``RAY_ENV_FOR_BUSY_HOSTS`` into ``environ`` (``os.environ``), where it is not set."""
    for key, value in RAY_ENV_FOR_BUSY_HOSTS.items():
        environ.setdefault(key, value)


# Ray 2.60.0 gives a new local node 30 s (hard-coded) to register with its GCS; on a host
# whose cores are busy with other work, starting one took 31-52 s (load 15 on 2 cores).
RAY_START_ATTEMPTS = 3
# What ray.init raises when the local node missed a start-up window (then it starts again).
RAY_START_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def init_ray(**init_kwargs: Any) -> None:
    """``ray.init(**init_kwargs)`` after ``set_ray_env``. A local node that missed its start-up
    window is started again (its processes, children of this one, stopped first), up to
    ``RAY_START_ATTEMPTS`` times."""
    import ray

    set_ray_env(os.environ)
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = descendants(os.getpid())
        try:
            ray.init(**init_kwargs)
            return
        except Exception as exc:
            missed = any(text in str(exc) for text in RAY_START_TIMEOUTS)
            if not missed or attempt == RAY_START_ATTEMPTS:
                raise
            for pid in descendants(os.getpid()) - before:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            ray.shutdown()
            logger.warning("Ray's node did not start in time (busy host?); starting it again")


# Ray Serve waits a fixed 60 s (HTTP_PROXY_TIMEOUT, no setting) for its proxies to start;
# with two test suites' Ray clusters on 2 cores (load 9-24) one took longer. The controller
# is up by then and its proxies keep starting, so `start_serve` waits on for them.
SERVE_PROXY_WAIT_S = 300.0
SERVE_PROXY_TIMEOUT = "proxies not available"  # what serve.start raises after its 60 s


def start_serve(proxy_wait_s: float = SERVE_PROXY_WAIT_S, **options: Any) -> None:
    """``serve.start(**options)``; where Ray gives up on its proxies after its own 60 s, wait on
    until ``serve.status()`` shows every proxy healthy, ``proxy_wait_s`` in all."""
    from ray import serve
    from ray.serve.schema import ProxyStatus

    deadline = time.monotonic() + proxy_wait_s
    try:
        serve.start(**options)
        return
    except TimeoutError as exc:
        if SERVE_PROXY_TIMEOUT not in str(exc):
            raise
        logger.warning("Ray Serve's proxies are slow to start (busy host?); waiting on")
    while True:
        proxies = serve.status().proxies
        if proxies and all(state == ProxyStatus.HEALTHY for state in proxies.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"Ray Serve's proxies were not healthy after {proxy_wait_s:g}s: "
                + (", ".join(f"{node[:8]} {state.value}" for node, state in proxies.items())
                   or "none started")
            )  # fmt: skip
        time.sleep(0.5)


def descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (Linux /proc; elsewhere none are known)."""
    parents: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError):
                    stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
                    parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _flag(flag: str, help_text: str, **cli: Any) -> dict[str, Any]:
    """A ClusterConfig field's ``kvserve cluster serve`` flag (``cluster.cli`` builds the
    parser from these); ``cli`` overrides what the flag takes (``default``, ``choices``)."""
    return {"flag": flag, "help": help_text, **cli}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """How many replicas, how requests find them, and each replica's engine settings. Fields
    with a ``flag`` are ``kvserve cluster serve``'s cluster flags, defaults from here."""

    engine: dict[str, Any] = field(default_factory=dict)  # ServerConfig keys
    num_replicas: int = field(default=2, metadata=_flag("--replicas", "replicas"))
    router: str = field(
        default="cost",
        metadata=_flag(
            "--router",
            "how requests pick a replica: cost = the lowest estimated time to first token over "
            "each replica's RAM, the shared KV tier and recomputation; prefix = the longest "
            "prefix held in RAM",
            choices=ROUTERS,
        ),
    )
    # The load guard (cluster.routing.LoadGuard): busiest - idlest > imbalance_abs and
    # busiest > imbalance_rel x idlest -> power of two choices.
    imbalance_abs: int = field(
        default=DEFAULT_GUARD.imbalance_abs,
        metadata=_flag("--imbalance-abs", "load guard: busiest - idlest replica, in requests"),
    )
    imbalance_rel: float = field(
        default=DEFAULT_GUARD.imbalance_rel,
        metadata=_flag(
            "--imbalance-rel", "... and busiest / idlest above this -> power of two choices"
        ),
    )
    router_metrics_port: int | None = None  # /metrics + /targets of the router (proxy)
    metrics_host: str = "127.0.0.1"  # where replicas and the router serve /metrics
    # Ray CPUs each replica reserves; the CLI reserves one, so Ray spreads replicas by cores.
    replica_num_cpus: float = field(
        default=0.0,
        metadata=_flag("--replica-cpus", "Ray CPUs each replica reserves", default=1.0),
    )
    max_ongoing_requests: int = 1024  # per replica; the engine queues and admits itself
    routing_stats_period_s: float = 1.0  # how often Ray polls each replica's report
    health_check_period_s: float = 2.0
    graceful_shutdown_timeout_s: float = 30.0  # a stopping replica drains this long
    num_http_ingress: int = field(
        default=1,
        metadata=_flag(
            "--http-ingress-replicas",
            "OpenAI ingress replicas (cluster.openai_ingress); with more than one, a killed "
            "ingress's new requests go to another",
        ),
    )
    # Prefill / decode split (cluster.pd): this many prefill replicas beside num_replicas
    # decode replicas; 0: every replica does both.
    num_prefill_replicas: int = field(
        default=0,
        metadata=_flag(
            "--prefill-replicas",
            "prefill / decode split: this many prefill replicas, and --replicas decode "
            "replicas that read their KV from the shared tier (needs --kv-disk-dir); 0: every "
            "replica does both",
        ),
    )
    # Engine settings of the prefill replicas that differ from ``engine`` (their pool, their
    # threads); the shared tier's settings must stay the same.
    prefill_engine: dict[str, Any] = field(default_factory=dict)
    transfer_timeout_s: float = field(
        default=60.0,
        metadata=_flag(
            "--pd-transfer-timeout-s",
            "a decode replica's wait for a prefill replica; past it, it computes the prompt itself",
        ),
    )
    startup_timeout_s: float = field(
        default=600.0,
        metadata=_flag(
            "--startup-timeout-s",
            "how long the replicas may take to start (placed, model loaded); past it the CLI "
            "says why (Ray's message) and exits 1",
        ),
    )
    transfer_min_tokens: int = field(
        default=DEFAULT_MIN_TRANSFER_TOKENS,
        metadata=_flag(
            "--pd-min-transfer-tokens",
            "prompts with fewer new tokens are computed on the decode replica",
        ),
    )

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.num_replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {self.router!r}")
        LoadGuard(self.imbalance_abs, self.imbalance_rel)  # raises naming the bad one
        if self.replica_num_cpus < 0:
            raise ValueError(f"replica_num_cpus must be >= 0, got {self.replica_num_cpus}")
        if self.num_http_ingress < 1:
            raise ValueError(f"num_http_ingress must be >= 1, got {self.num_http_ingress}")
        engine = build_config(self.engine, environ={})  # engine settings fail here, by name
        if self.num_prefill_replicas < 0:
            raise ValueError(f"prefill replicas must be >= 0, got {self.num_prefill_replicas}")
        prefill = build_config({**self.engine, **self.prefill_engine}, environ={})
        if (prefill.kv_disk_dir, prefill.kv_disk_store) != (
            engine.kv_disk_dir,
            engine.kv_disk_store,
        ):
            raise ValueError(
                "prefill_engine must keep the shared tier (kv_disk_dir, kv_disk_store)"
            )
        if self.num_prefill_replicas and engine.kv_disk_dir is None:
            raise ValueError(
                "prefill replicas hand their KV to decode replicas through the shared KV "
                "tier: set --kv-disk-dir (one directory all replicas reach)"
            )
        if self.transfer_timeout_s <= 0 or self.transfer_min_tokens < 1:
            raise ValueError(
                f"transfer_timeout_s must be > 0 and transfer_min_tokens >= 1, got "
                f"{self.transfer_timeout_s} and {self.transfer_min_tokens}"
            )


def replica_logging(log_level: str) -> dict[str, Any]:
    """Ray Serve's logging of a replica: ``--log-level``, and no line per request (a single
    server logs none; the metrics count every request)."""
    return {"log_level": log_level.upper(), "enable_access_log": False}


def grpc_options(port: int = 50051) -> Any:
    """Ray Serve's gRPC proxy options that serve ``kvserve.v1.Generation`` on ``port``."""
    from ray.serve.config import gRPCOptions

    if not 1 <= port <= 65535:
        raise ValueError(f"the gRPC proxy needs a fixed port in [1, 65535], got {port}")
    return gRPCOptions(port=port, grpc_servicer_functions=[GENERATION_SERVICER])


def build_app(cfg: ClusterConfig) -> Any:
    """The Ray Serve application (``serve.run`` it): ``num_replicas`` replicas that do both
    prefill and decode, or, with ``num_prefill_replicas``, that many prefill replicas behind
    ``num_replicas`` decode replicas (the ingress; ``cluster.pd``)."""
    from cluster.openai_ingress import REPLICA_DEPLOYMENT

    split = cfg.num_prefill_replicas > 0
    options = {
        "metrics_host": cfg.metrics_host,
        "metrics_port": 0,
        "report_prices": cfg.router == "cost",
    }
    prefill = None
    if split:
        prefill = _replicas(cfg, PREFILL_DEPLOYMENT, cfg.num_prefill_replicas, None).bind(
            {**cfg.engine, **cfg.prefill_engine}, role="prefill", **options
        )
    ingress = _replicas(cfg, REPLICA_DEPLOYMENT, cfg.num_replicas, cfg.router_metrics_port)
    return ingress.bind(
        dict(cfg.engine),
        role="decode" if split else "both",
        prefill=prefill,
        transfer_timeout_s=cfg.transfer_timeout_s,
        transfer_min_tokens=cfg.transfer_min_tokens,
        **options,
    )


def _replicas(cfg: ClusterConfig, name: str, num_replicas: int, metrics_port: int | None) -> Any:
    """A deployment of ``KVServeReplica`` routed by ``KVServeRequestRouter`` (whose metrics
    the ingress's router serves on ``metrics_port``; None: not served)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cluster.replica import KVServeReplica

    engine = build_config(cfg.engine, environ={})
    security = engine.security()
    gate = security.owner_gate()
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
            "metrics_port": metrics_port,
            "shared_tier_blocks": shared_tier_blocks,
            "chunk_tokens": engine.long_prefill_token_threshold or engine.max_num_batched_tokens,
            "auth": security.auth_enabled,
            "share_prefix_cache": security.share_prefix_cache,
            # Key digests, never the keys: Ray keeps these settings in the deployment config.
            "metrics_gate": {
                "api_owners": sorted(gate.api_owners),
                "admin_owners": sorted(gate.admin_owners),
                "metrics_require_key": gate.metrics_require_key,
            }
            if gate.auth_enabled
            else None,
            "metrics_limits": dataclasses.asdict(engine.edge_limits().metrics),
        },
        request_routing_stats_period_s=cfg.routing_stats_period_s,
        request_routing_stats_timeout_s=max(cfg.routing_stats_period_s, 1.0),
    )
    return serve.deployment(
        KVServeReplica,
        name=name,
        logging_config=replica_logging(engine.log_level),
        num_replicas=num_replicas,
        max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.replica_num_cpus},
        health_check_period_s=cfg.health_check_period_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
        request_router_config=router_config,
    )


def build_openai_app(cfg: ClusterConfig, replicas_app: str = DEFAULT_APP_NAME) -> Any:
    """The OpenAI-compatible API of the replicas of application ``replicas_app``: one ingress
    (``cluster.openai_ingress``) to ``serve.run`` as an application of its own, with
    ``route_prefix="/"``."""
    from ray import serve

    from cluster.openai_ingress import OpenAIIngress

    deployment = serve.deployment(
        serve.ingress()(OpenAIIngress),
        name="OpenAIIngress",
        logging_config=replica_logging(build_config(cfg.engine, environ={}).log_level),
        num_replicas=cfg.num_http_ingress,
        max_ongoing_requests=cfg.max_ongoing_requests * cfg.num_replicas,
        ray_actor_options={"num_cpus": 0},
        health_check_period_s=cfg.health_check_period_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_LOOP_S,
    )
    return deployment.bind(dict(cfg.engine), replicas_app)


def _cluster_config(args: dict[str, Any], *extra: str) -> ClusterConfig:
    known = set(ClusterConfig.__dataclass_fields__)
    unknown = sorted(set(args) - known - set(extra))
    if unknown:
        raise ValueError(
            f"unknown kvserve cluster setting(s) {', '.join(unknown)}; known: "
            f"{', '.join(sorted(known | set(extra)))}"
        )
    return ClusterConfig(**{k: v for k, v in args.items() if k in known})


def app_builder(args: dict[str, Any]) -> Any:
    """``import_path: cluster.app:app_builder`` for ``serve run`` / ``serve deploy``."""
    return build_app(_cluster_config(args))


def openai_app_builder(args: dict[str, Any]) -> Any:
    """``import_path: cluster.app:openai_app_builder``: the OpenAI API of the replicas of the
    application named ``replicas_app`` (default ``kvserve``), with the same ``engine``."""
    replicas_app = str(args.get("replicas_app", DEFAULT_APP_NAME))
    return build_openai_app(_cluster_config(args, "replicas_app"), replicas_app)
