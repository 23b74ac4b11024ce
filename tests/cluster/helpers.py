"""A local Ray cluster with Ray Serve's gRPC proxy serving kvserve, for the cluster tests."""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.metrics.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass(slots=True)
class LocalCluster:
    """Ray + Serve started in this process; ``deploy`` runs one kvserve app at a time
    (``deploy_openai``: with the OpenAI ingress app beside it)."""

    grpc_port: int
    address: str
    http_port: int = 0

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def deploy(self, name: str, *, openai: bool = False, **cluster: Any) -> int:
        """Replace the running apps with ``name`` (fresh replicas), and its OpenAI ingress
        app with ``openai``; the router metrics port."""
        from ray import serve

        from cluster.app import GRPC_ROUTE_PREFIX, ClusterConfig, build_app, build_openai_app

        for app in list(serve.status().applications):
            serve.delete(app)
        metrics_port = free_port()
        cfg = ClusterConfig(router_metrics_port=metrics_port, **cluster)
        serve.run(build_app(cfg), name=name, route_prefix=GRPC_ROUTE_PREFIX)
        if openai:
            serve.run(build_openai_app(cfg, name), name=f"{name}-openai", route_prefix="/")
            wait_http(self.http_url)
        wait_served(self.address)
        return metrics_port

    def deploy_openai(self, name: str, **cluster: Any) -> int:
        return self.deploy(name, openai=True, **cluster)


def wait_http(url: str, timeout_s: float = 120.0) -> None:
    """Until the HTTP proxy routes to the OpenAI app (its /health answers 200)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health did not answer 200 in {timeout_s:g}s")
        time.sleep(0.2)


def wait_served(address: str, timeout_s: float = 120.0) -> None:
    """Until the proxy routes to the (only) app: it learns of new apps asynchronously."""
    import grpc

    from server.rpc import generation_pb2 as pb
    from server.rpc import generation_pb2_grpc as pb_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while True:
            try:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


def start_local_cluster() -> Iterator[LocalCluster]:
    """Ray with 4 logical CPUs (replicas reserve none), the gRPC proxy on a free port, and
    the proxy's edge (``cluster.edge``: default limits) as ``kvserve cluster serve`` sets it.

    Ray's proxy needs a fixed port (0 turns gRPC off), so a free one is picked first.
    Workers import this checkout: PYTHONPATH is set before Ray starts its processes.
    """
    import ray
    from ray import serve

    from cluster.app import grpc_options, init_ray, start_serve
    from cluster.edge import ProxyEdge

    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local cluster
    os.environ.update(ProxyEdge().environ())  # the proxy's edge, as kvserve cluster serve's
    init_ray(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port, http_port = free_port(), free_port()
    try:
        start_serve(
            grpc_options=grpc_options(port),
            http_options={"host": "127.0.0.1", "port": http_port},
        )
        yield LocalCluster(port, f"127.0.0.1:{port}", http_port)
    finally:
        serve.shutdown()
        ray.shutdown()


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` at ``host:port`` -> {sample name: [(labels, value)]}."""
    text = urllib.request.urlopen(f"http://{url}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def targets(metrics_port: int) -> list[str]:
    """The router's http_sd listing: its own address first, then the replicas'."""
    import json

    body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/targets", timeout=5).read()
    return list(json.loads(body)[0]["targets"])


def replica_targets(metrics_port: int, num_replicas: int, timeout_s: float = 60.0) -> list[str]:
    """Wait until every replica has reported its metrics address to the router."""
    deadline = time.monotonic() + timeout_s
    while True:
        listed = targets(metrics_port)[1:]
        if len(listed) == num_replicas:
            return listed
        if time.monotonic() > deadline:
            raise TimeoutError(f"replicas listed: {listed}, expected {num_replicas}")
        time.sleep(0.2)


def total(url_samples: list[dict[str, list[tuple[dict[str, str], float]]]], name: str,
          **labels: str) -> float:  # fmt: skip
    """Sum of ``name`` over every replica's scrape, filtered by ``labels``."""
    return sum(
        value
        for samples in url_samples
        for got, value in samples.get(name, [])
        if all(got.get(k) == v for k, v in labels.items())
    )


def replica_id_of(samples: dict[str, list[tuple[dict[str, str], float]]]) -> str:
    """The Ray Serve replica id a replica's ``kvserve_model_info`` names."""
    (labels, _), *_ = samples["kvserve_model_info"]
    return labels["replica_id"]


def replica_actor(replica_id: str) -> Any:
    """The Ray actor of the Serve replica ``replica_id``."""
    import ray
    from ray.util import list_named_actors

    for entry in list_named_actors(all_namespaces=True):
        name = entry["name"]
        if re.search(rf"#{re.escape(replica_id)}$", name):
            return ray.get_actor(name, namespace=entry["namespace"])
    raise LookupError(f"no actor for replica {replica_id}")


async def wait_for(predicate: Any, timeout_s: float = 60.0, interval_s: float = 0.1) -> None:
    """Until ``predicate()`` holds; ``timeout_s`` is only the safety net against a hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval_s)


def running_by_replica(urls: list[str]) -> dict[str, float]:
    """Requests running on each replica (by Ray Serve replica id), from their metrics."""
    return {
        replica_id_of(samples): total([samples], "kvserve_requests_running")
        for samples in (scrape(u) for u in urls)
    }
