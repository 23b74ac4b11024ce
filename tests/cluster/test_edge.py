"""cluster.edge without Ray: the settings that travel to Ray's proxy process, and the
middleware on its HTTP app (the internal route, Ray's plain-text refusals, a cut stream)."""

from __future__ import annotations

import json
from typing import Any

from cluster.edge import INTERNAL_ROUTE, EdgeMiddleware, ProxyEdge
from server.http_guard import EdgeLimits, HttpLimits


def test_the_edge_settings_reach_the_proxy_through_its_environment() -> None:
    """ProxyEdge -> environment variables -> the same ProxyEdge; they name Ray's callback."""
    edge = ProxyEdge(
        host="10.0.0.7",
        limits=EdgeLimits(http=HttpLimits(max_connections=9, header_timeout_s=2.5)),
        max_request_bytes=1234,
    )
    environ = edge.environ()
    assert environ["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "cluster.edge.install"
    assert ProxyEdge.from_environ(environ) == edge
    assert ProxyEdge.from_environ({}) == ProxyEdge()


async def _call(app: Any, path: str) -> list[dict[str, Any]]:
    """The ASGI messages ``EdgeMiddleware(app)`` sends for a GET of ``path``."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": []}
    await EdgeMiddleware(app)(scope, receive, send)
    return sent


def _response(status: int, kind: bytes, *bodies: bytes, end: bool = True) -> Any:
    """An inner app that answers ``bodies`` (the last one ending the response when ``end``)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}
        )
        for i, body in enumerate(bodies):
            last = end and i == len(bodies) - 1
            await send({"type": "http.response.body", "body": body, "more_body": not last})

    return app


def _json(messages: list[dict[str, Any]]) -> tuple[int, dict[str, Any]]:
    body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    return messages[0]["status"], json.loads(body)


async def test_the_internal_route_is_a_404_before_ray_sees_it() -> None:
    """/_kvserve_grpc and below answer a 404 in OpenAI's error shape; the app is not called."""

    async def never(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("the internal route reached Ray's proxy")

    for path in (INTERNAL_ROUTE, INTERNAL_ROUTE + "/kvserve.v1.Generation/Generate"):
        status, body = _json(await _call(never, path))
        assert status == 404 and body["error"]["type"] == "not_found_error"


async def test_rays_plain_text_404_becomes_the_503_that_says_retry() -> None:
    """Ray's "Path not found" (no application serves it: starting or draining) is a 503 JSON
    answer; its other plain-text errors keep their status in JSON; answers of ours pass."""
    status, body = _json(await _call(_response(404, b"text/plain", b"Path '/v1' not found"), "/v1"))
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    assert "retry" in body["error"]["message"]
    status, body = _json(await _call(_response(500, b"text/plain; charset=utf-8", b"x"), "/v1"))
    assert status == 500 and body["error"]["type"] == "server_error"
    ours = await _call(_response(404, b"application/json", b'{"error": {}}'), "/v1/nope")
    assert _json(ours) == (404, {"error": {}})
    assert (await _call(_response(200, b"text/plain", b"ok"), "/-/healthz"))[0]["status"] == 200


async def test_an_app_that_answers_nothing_is_a_503() -> None:
    """No response at all (the ingress died before answering) is the 503 JSON answer."""

    async def silent(scope: Any, receive: Any, send: Any) -> None:
        return None

    status, body = _json(await _call(silent, "/v1/completions"))
    assert status == 503 and body["error"]["type"] == "service_unavailable"


async def test_a_cut_stream_ends_with_the_retry_event_and_done() -> None:
    """An SSE stream whose app stopped mid-way ends with a service_unavailable event and
    [DONE]; a stream that ended on its own is left as it was."""
    cut = await _call(_response(200, b"text/event-stream", b"data: 1\n\n", end=False), "/v1")
    tail = cut[-1]
    assert tail["type"] == "http.response.body" and not tail["more_body"]
    events = tail["body"].decode().split("\n\n")
    error = json.loads(events[0].removeprefix("data: "))
    assert error["error"]["type"] == "service_unavailable"
    assert events[1] == "data: [DONE]"
    whole = await _call(_response(200, b"text/event-stream", b"data: [DONE]\n\n"), "/v1")
    assert len(whole) == 2 and whole[-1]["body"] == b"data: [DONE]\n\n"
