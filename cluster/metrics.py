"""Cluster metrics: every replica's ``kvserve_*`` series with a ``replica`` label, the router's
decisions, and one address that lists every scrape target.

- Each replica serves its own registry on its own port, through ``LabelledCollector``, so
  the series of replica 0 and replica 1 differ by ``replica="0"`` / ``replica="1"``.
- The router (in Ray Serve's proxy) serves ``kvserve_router_*`` on ``--router-metrics-port``
  and, on the same port, ``/targets``: Prometheus HTTP service discovery (``http_sd_configs``)
  listing itself and every live replica's metrics address.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.metrics_core import Metric

from cluster.routing import REASONS, Decision
from metrics.histogram import TOKEN_COUNT_BUCKETS


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
        for reason in REASONS:  # the series exist from the first scrape on
            self.decisions.labels(router, reason)

    def record(self, decision: Decision, block_size: int, num_prompt_tokens: int) -> None:
        self.decisions.labels(self.router, decision.reason).inc()
        self.prefix_hit_tokens.labels(self.router).observe(decision.num_prefix_blocks * block_size)
        self.prompt_tokens.labels(self.router).inc(num_prompt_tokens)


def start_router_metrics_server(
    host: str,
    port: int,
    registry: CollectorRegistry,
    targets: Callable[[], list[str]],
) -> tuple[WSGIServer, int]:
    """Serve ``/metrics`` and ``/targets`` (http_sd JSON: this address + ``targets()``)."""
    metrics_app = make_wsgi_app(registry)
    bound: dict[str, int] = {}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO") == "/targets":
            listed = [f"{advertised_host(host)}:{bound['port']}", *targets()]
            body = json.dumps([{"targets": listed, "labels": {"job": "kvserve"}}]).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        return metrics_app(environ, start_response)

    httpd, bound["port"] = serve_wsgi(host, port, app, "kvserve-router-metrics")
    return httpd, bound["port"]


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry
) -> tuple[WSGIServer, int]:
    """Serve a replica's ``registry`` on ``/metrics`` (Ray actors have no event loop of ours
    for the server's uvicorn front, so a small WSGI server on its own thread)."""
    return serve_wsgi(host, port, make_wsgi_app(registry), "kvserve-replica-metrics")


def stop_metrics_server(httpd: WSGIServer) -> None:
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(WSGIRequestHandler):
    timeout = 10  # seconds: a client that stops mid-request is dropped, not waited on

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not news


def serve_wsgi(host: str, port: int, app: Callable[..., Any], name: str) -> tuple[WSGIServer, int]:
    """Serve ``app`` on a daemon thread, one request at a time (bounded: a slow or idle
    client holds no more than one connection's worth of the server)."""
    httpd = make_server(host, port, app, handler_class=_QuietHandler)
    threading.Thread(target=httpd.serve_forever, name=name, daemon=True).start()
    return httpd, int(httpd.server_port)
