"""``kvserve cluster serve``: N kvserve replicas on Ray Serve behind one gRPC address and one
OpenAI-compatible HTTP address.

    kvserve cluster serve --replicas 2 --router cost [...the engine flags of kvserve serve]

Every ``kvserve serve`` flag configures each replica's engine; ``--port`` is the gRPC proxy's
port (default 50051), ``--http-port`` Ray Serve's HTTP proxy's (default 8000; ``--no-http``:
no OpenAI API; the API keys, limits and TLS files are the single server's flags), and
``--metrics-port`` the router's ``/metrics`` + ``/targets`` (Prometheus HTTP service discovery
of every replica's metrics). Joins the Ray cluster at ``--ray-address`` (default: a running
one if there is, else a local one), runs until SIGINT / SIGTERM, then shuts the applications
down (replicas drain for ``--grace-period-s``).
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from typing import Any

from cluster.app import ClusterConfig

APP_NAME = "kvserve"
CLUSTER_FLAGS = [f for f in dataclasses.fields(ClusterConfig) if "flag" in f.metadata]


def build_parser() -> argparse.ArgumentParser:
    from server.config import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="kvserve cluster", description="kvserve on Ray Serve: many replicas, one address."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve N replicas behind Ray Serve's gRPC and HTTP proxies",
        description="Serve N kvserve replicas on Ray Serve. The engine flags are kvserve "
        "serve's; --port is the gRPC proxy's, --http-port the HTTP proxy's (the OpenAI API), "
        "--metrics-port the router's /metrics and /targets.",
    )
    cluster = serve.add_argument_group("cluster")
    for f in CLUSTER_FLAGS:
        flag = dict(f.metadata)
        default = flag.pop("default", f.default)
        cluster.add_argument(
            flag.pop("flag"), dest=f.name, type=type(default), default=default,
            help=flag.pop("help") + " (default: %(default)s)", **flag,
        )  # fmt: skip
    cluster.add_argument(
        "--ray-address", default=None,
        help="Ray cluster to join, e.g. auto or ray://head:10001 (default: a running one, "
        "else a local one)",
    )  # fmt: skip
    add_serve_arguments(serve)
    return parser


def cluster_config(args: argparse.Namespace) -> tuple[Any, Any]:
    """(ClusterConfig, the resolved ServerConfig) from the parsed flags."""
    from server.config import build_config

    engine = build_config(args)  # flags > KVSERVE_* > --config > defaults, validated
    cfg = ClusterConfig(
        engine={f.name: getattr(engine, f.name) for f in dataclasses.fields(engine)},
        router_metrics_port=engine.metrics_port if engine.metrics else None,
        metrics_host=engine.metrics_host,
        graceful_shutdown_timeout_s=engine.grace_period_s,
        **{f.name: getattr(args, f.name) for f in CLUSTER_FLAGS},
    )
    return cfg, engine


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg, engine = cluster_config(args)
        from cluster.app import build_app, grpc_options

        options = grpc_options(engine.port)
    except (ValueError, OSError) as exc:
        print(f"kvserve cluster serve: {exc}", file=sys.stderr)
        return 2
    try:
        from ray import serve
    except ModuleNotFoundError:
        print(
            "kvserve cluster serve: Ray is not installed: pip install 'kvserve[ray]'",
            file=sys.stderr,
        )
        return 2
    from cluster.app import GRPC_ROUTE_PREFIX, OPENAI_APP_NAME, build_openai_app, init_ray
    from cluster.ray_patches import check_ray_names
    from server.cli import write_port_file

    try:
        check_ray_names()
    except RuntimeError as exc:
        print(f"kvserve cluster serve: {exc}", file=sys.stderr)
        return 2

    init_ray(address=args.ray_address, include_dashboard=False)
    http_port = engine.http_port if engine.http_port or not engine.http else _free_port()
    serve.start(grpc_options=options, http_options=http_options(engine, http_port))
    serve.run(build_app(cfg), name=APP_NAME, route_prefix=GRPC_ROUTE_PREFIX)
    if engine.http:
        serve.run(build_openai_app(cfg, APP_NAME), name=OPENAI_APP_NAME, route_prefix="/")
    scheme = "https" if engine.tls_cert else "http"
    roles = (
        f"{cfg.num_prefill_replicas} prefill + {cfg.num_replicas} decode replicas"
        if cfg.num_prefill_replicas
        else f"{cfg.num_replicas} replicas"
    )
    print(
        f"kvserve cluster: {roles} ({engine.runner}), router {cfg.router}, "
        f"gRPC on :{engine.port}"
        + (f", OpenAI-compatible API on {scheme}://{engine.host}:{http_port}/v1"
           if engine.http else "")
        + (
            f", metrics + targets on http://{cfg.metrics_host}:{cfg.router_metrics_port}"
            if cfg.router_metrics_port is not None
            else ""
        ),
        flush=True,
    )  # fmt: skip
    if engine.port_file:
        write_port_file(engine.port_file, engine.port)
    if engine.http and engine.http_port_file:
        write_port_file(engine.http_port_file, http_port)
    if engine.metrics_port_file and cfg.router_metrics_port is not None:
        write_port_file(engine.metrics_port_file, cfg.router_metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("kvserve cluster: stopping (replicas drain in-flight requests)", flush=True)
    if engine.http:
        serve.delete(OPENAI_APP_NAME)
    serve.delete(APP_NAME)
    serve.shutdown()
    return 0


def http_options(engine: Any, port: int) -> dict[str, Any]:
    """Ray Serve's HTTP proxy on ``engine.host``:``port``, with the TLS files of
    ``--tls-cert`` / ``--tls-key`` when given (as a single server's HTTP front)."""
    options: dict[str, Any] = {"host": engine.host, "port": port}
    if engine.tls_cert is not None and engine.tls_key is not None:
        options |= {"ssl_certfile": engine.tls_cert, "ssl_keyfile": engine.tls_key}
    return options


def _free_port() -> int:
    """A free port now (Ray's proxy binds a fixed one; port 0 asks for any)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cmd_serve(args)


if __name__ == "__main__":
    raise SystemExit(main())
