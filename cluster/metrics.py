"""Cluster metrics: every replica's ``kvserve_*`` series with a ``replica`` label, the router's
decisions, and one address that lists every scrape target.

- Each replica serves its own registry on its own port, through ``LabelledCollector``, so
  the series of replica 0 and replica 1 differ by ``replica="0"`` / ``replica="1"``.
- The router (in Ray Serve's proxy) serves ``kvserve_router_*`` on ``--router-metrics-port``
  and, on the same port, ``/targets``: Prometheus HTTP service discovery (``http_sd_configs``)
  listing itself and every live replica's metrics address.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cluster.routing import REASONS, TIERS, Decision
from metrics.histogram import TOKEN_COUNT_BUCKETS
from server.asgi import (
    ThreadedAsgiServer,
    admin_gate,
    metrics_app,
    metrics_limits,
    start_asgi_server_thread,
)
from server.auth import OwnerGate, Security
from server.http_guard import HttpLimits


class LabelledCollector:
    """Everything ``inner`` collects, with ``labels`` added to every sample."""

    def __init__(self, inner: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self.inner = inner
        self.labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield out


def advertised_host(bind_host: str) -> str:
    """The address others reach a server bound to ``bind_host`` at (this node's IP for a
    wildcard), for the ``/targets`` listing."""
    if bind_host in ("", "0.0.0.0", "::"):
        from ray.util import get_node_ip_address

        return str(get_node_ip_address())
    return bind_host


def labelled_registry(inner: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """A registry to serve: ``inner``'s metrics with ``labels`` on every series."""
    outer = CollectorRegistry(auto_describe=False)
    outer.register(LabelledCollector(inner, labels))
    return outer


class RouterMetrics:
    """``kvserve_router_decisions_total{router,reason}`` and the prefix hit at routing time."""

    def __init__(self, registry: CollectorRegistry, router: str) -> None:
        self.router = router
        self.decisions = Counter(
            "kvserve_router_decisions",
            "Routing decisions by reason (prefix_hit, prefix_miss, load_guard, ...)",
            ["router", "reason"],
            registry=registry,
        )
        self.prefix_hit_tokens = Histogram(
            "kvserve_router_prefix_hit_tokens",
            "Prompt tokens the chosen replica held as a cached prefix, at routing time",
            ["router"],
            buckets=TOKEN_COUNT_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "kvserve_router_prompt_tokens",
            "Prompt tokens routed (the denominator of the routing-time prefix hit rate)",
            ["router"],
            registry=registry,
        )
        self.prefix_blocks = Counter(
            "kvserve_router_prefix_blocks",
            "Full prompt blocks routed, by where the chosen replica finds them: ram (its "
            "prefix cache), shared (the KV tier 2 the replicas share), none (recomputed)",
            ["router", "tier"],
            registry=registry,
        )
        for reason in REASONS:  # the series exist from the first scrape on
            self.decisions.labels(router, reason)
        for tier in TIERS:
            self.prefix_blocks.labels(router, tier)

    def record(self, decision: Decision, block_size: int, num_prompt_tokens: int) -> None:
        self.decisions.labels(self.router, decision.reason).inc()
        self.prefix_hit_tokens.labels(self.router).observe(decision.num_prefix_blocks * block_size)
        self.prompt_tokens.labels(self.router).inc(num_prompt_tokens)
        ram, shared = decision.num_prefix_blocks, decision.num_shared_blocks
        num_blocks = max(num_prompt_tokens - 1, 0) // block_size  # a hit never covers the last
        self.prefix_blocks.labels(self.router, "ram").inc(ram)
        self.prefix_blocks.labels(self.router, "shared").inc(shared)
        self.prefix_blocks.labels(self.router, "none").inc(max(num_blocks - ram - shared, 0))


def start_router_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    targets: Callable[[], list[str]],
    gate: OwnerGate | None = None,
    limits: HttpLimits | None = None,
) -> ThreadedAsgiServer:
    """Serve ``/metrics`` and ``/targets`` (http_sd JSON: this address + ``targets()``), both
    behind ``gate`` (the admin key, when keys are on: /targets names every replica)."""
    metrics = metrics_app(registry)
    bound: dict[str, int] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/targets":
            listed = [f"{advertised_host(host)}:{bound['port']}", *targets()]
            response = JSONResponse([{"targets": listed, "labels": {"job": "kvserve"}}])
            await response(scope, receive, send)
            return
        await metrics(scope, receive, send)

    server = _serve(admin_gate(app, gate), host, port, "kvserve-router-metrics", None, limits)
    bound["port"] = server.port
    return server


def start_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    security: Security | None = None,
    limits: HttpLimits | None = None,
) -> ThreadedAsgiServer:
    """Serve a replica's ``registry`` on ``/metrics`` (a Ray actor runs no event loop of ours
    for it: the server's own /metrics app on a thread), with the single server's admin key
    and TLS (``security``) and limits."""
    app = metrics_app(registry, security)
    return _serve(app, host, port, "kvserve-replica-metrics", security, limits)


def _serve(
    app: ASGIApp,
    host: str,
    port: int,
    name: str,
    security: Security | None,
    limits: HttpLimits | None,
) -> ThreadedAsgiServer:
    # Bounded: timeouts, and idle connections closed at the cap (server.http_guard).
    limits = limits if limits is not None else metrics_limits()
    if not limits.max_connections:  # 0: a metrics port's small cap, as kvserve serve's
        limits = dataclasses.replace(limits, max_connections=metrics_limits().max_connections)
    return start_asgi_server_thread(app, host, port, security, limits=limits, name=name)
