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
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
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
        from cluster.edge import ProxyEdge

        options = grpc_options(engine.port)
        edge = ProxyEdge(engine.host, engine.edge_limits(), engine.max_request_bytes)
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
    from cluster.app import (
        GRPC_ROUTE_PREFIX,
        OPENAI_APP_NAME,
        RAY_ENV_FOR_BUSY_HOSTS,
        build_openai_app,
        init_ray,
        replica_logging,
        start_serve,
    )
    from cluster.drain import start_drain_signal
    from cluster.ray_patches import check_ray_names, started_ray_here
    from server.cli import write_port_file

    try:
        check_ray_names()
    except RuntimeError as exc:
        print(f"kvserve cluster serve: {exc}", file=sys.stderr)
        return 2
    # Ray's proxy reads the edge's settings from its environment (cluster.edge): a local
    # cluster's processes inherit ours, a running cluster's controller gets them too.
    os.environ.update(edge.environ())
    init_ray(address=args.ray_address, include_dashboard=False)
    stop = threading.Event()  # after ray.init, whose driver sets handlers of its own
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    unplaceable = cpu_shortfall(cfg)
    if unplaceable:
        print(f"kvserve cluster serve: {unplaceable}", file=sys.stderr)
        return 1
    http_port = engine.http_port if engine.http_port or not engine.http else _free_port()
    start_serve(
        grpc_options=options,
        http_options=http_options(engine, http_port),
        logging_config=replica_logging(engine.log_level),  # the proxy's too
        controller_options={"runtime_env": {"env_vars": RAY_ENV_FOR_BUSY_HOSTS | edge.environ()}},
    )
    drain_signal = start_drain_signal(APP_NAME)
    apps = [
        (APP_NAME, lambda: serve.run(build_app(cfg), name=APP_NAME, route_prefix=GRPC_ROUTE_PREFIX))
    ]
    if engine.http:
        apps.append(
            (
                OPENAI_APP_NAME,
                lambda: serve.run(
                    build_openai_app(cfg, APP_NAME), name=OPENAI_APP_NAME, route_prefix="/"
                ),
            )
        )
    failed = start_apps(apps, cfg.startup_timeout_s)
    if failed:
        print(f"kvserve cluster serve: {failed}", file=sys.stderr)
        serve.shutdown()
        return 1
    scheme = "https" if engine.tls_cert else "http"
    roles = (
        f"{cfg.num_prefill_replicas} prefill + {cfg.num_replicas} decode replicas"
        if cfg.num_prefill_replicas
        else f"{cfg.num_replicas} replicas"
    )
    print(
        f"kvserve cluster: {roles} ({engine.runner}), router {cfg.router}, "
        f"gRPC on {engine.host}:{engine.port}"
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
    stop.wait()
    grace_s = cfg.graceful_shutdown_timeout_s
    print(f"kvserve cluster: draining in-flight requests (grace {grace_s:g}s)", flush=True)
    expected = cfg.num_replicas + cfg.num_prefill_replicas
    expected += cfg.num_http_ingress if engine.http else 0
    t0 = time.monotonic()
    wait_drained(drain_signal, grace_s, expected)
    print(f"kvserve cluster: drained in {time.monotonic() - t0:.1f}s; stopping", flush=True)
    if started_ray_here():  # nothing is in flight any more: the local Ray goes whole
        import ray

        ray.shutdown()
    else:  # a Ray cluster others may use: only what this command started goes
        for name, _ in apps:
            serve.delete(name, _blocking=False)
        serve.shutdown()
    print(f"kvserve cluster: stopped {time.monotonic() - t0:.1f}s after the signal", flush=True)
    return 0


def cpu_shortfall(cfg: Any) -> str | None:
    """Why the Ray cluster cannot place every replica for want of CPUs (None: it can)."""
    import ray

    num_replicas = cfg.num_replicas + cfg.num_prefill_replicas
    needed = cfg.replica_num_cpus * num_replicas
    available = float(ray.cluster_resources().get("CPU", 0.0))
    if needed <= available:
        return None
    return (
        f"{num_replicas} replicas x --replica-cpus {cfg.replica_num_cpus:g} = {needed:g} CPUs, "
        f"but the Ray cluster has {available:g}: lower --replica-cpus (0: the replicas share "
        "the cores) or add nodes to the Ray cluster"
    )


def start_apps(apps: list[tuple[str, Any]], timeout_s: float) -> str | None:
    """Deploy ``apps`` (name, ``serve.run`` call) one after the other; why they did not
    start within ``timeout_s`` (Ray's own message: a replica it cannot place, a constructor
    that failed), or None once all run."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    for name, run in apps:
        errors: list[BaseException] = []

        def deploy(run: Any = run, errors: list[BaseException] = errors) -> None:
            try:
                run()
            except BaseException as exc:  # reported below, with Ray's status
                errors.append(exc)

        thread = threading.Thread(target=deploy, name=f"kvserve-deploy-{name}", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        if errors or thread.is_alive():
            status = serve.status().applications.get(name)
            detail = [str(errors[0])] if errors else []
            if status is not None:
                detail += [status.message] if status.message else []
                detail += [d.message for d in status.deployments.values() if d.message]
            waited = "failed" if errors else f"did not start within {timeout_s:g}s"
            return f"application {name} {waited}: " + "; ".join(detail or ["no reason given"])
    return None


def wait_drained(drain_signal: Any, grace_s: float, expected: int) -> None:
    """Start the cluster's drain (``cluster.drain``) and wait until ``expected`` replicas
    and ingresses report idle, or the grace period and 10 s have passed."""
    import ray

    ray.get(drain_signal.start.remote(grace_s))
    deadline = time.monotonic() + grace_s + 10.0
    while time.monotonic() < deadline:
        if ray.get(drain_signal.num_idle.remote()) >= expected:
            return
        time.sleep(0.1)
    print("kvserve cluster: not every replica reported drained; stopping anyway", flush=True)


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


SUPERVISED_ENV = "KVSERVE_CLUSTER_SUPERVISED"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if os.environ.get(SUPERVISED_ENV) != "1" and sys.platform.startswith("linux"):
        try:
            cluster_config(args)  # bad settings are said here, before a child starts
        except (ValueError, OSError) as exc:
            print(f"kvserve cluster serve: {exc}", file=sys.stderr)
            return 2
        return supervise(argv)
    return cmd_serve(args)


def supervise(argv: list[str]) -> int:
    """Run the cluster in a child process leading a session of its own, and pass it this
    process's SIGTERM and SIGINT. A signal to this process's group (``timeout``, systemd
    with ``KillMode=mixed``, a terminal's Ctrl-C) then reaches this process alone, and the
    child drains the cluster, instead of Ray's own processes dying first. The child ends
    with this process (``PR_SET_PDEATHSIG``)."""
    env = {**os.environ, SUPERVISED_ENV: "1"}
    child = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", *argv],
        env=env,
        start_new_session=True,
        preexec_fn=_terminate_with_parent,
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: child.send_signal(signum))
    return child.wait()


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (Linux)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    raise SystemExit(main())
