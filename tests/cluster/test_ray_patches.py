"""cluster.ray_patches: the names it patches exist in the pinned Ray (a clear error when one
moved), and a client's cancel reaches the proxy's calls to replicas through Ray's real gRPC
proxy server class."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster import ray_patches
from cluster.ingress import NoServicer
from server.grpc_service import generation_handler

ROOT = Path(__file__).resolve().parents[2]


def test_the_pinned_ray_has_every_patched_name() -> None:
    """pyproject pins Ray to the version the patches were written for, and it has them all."""
    pinned = re.search(r'"ray\[serve\]==([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned is not None and pinned.group(1) == ray_patches.RAY_VERSION
    assert ray_patches.missing_ray_names() == []
    ray_patches.check_ray_names()


def test_a_moved_name_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name Ray no longer has (a module attribute or a parameter) is named, with the Ray
    version the patches need."""
    moved = (
        ("ray.serve._private.proxy", "NoSuchThing"),
        ("ray.serve._private.proxy", "ProxyResponseGenerator.(no_such_parameter)"),
        ("ray.serve._private.no_such_module", "x"),
    )
    monkeypatch.setattr(ray_patches, "PATCHED_NAMES", ray_patches.PATCHED_NAMES + moved)
    with pytest.raises(RuntimeError) as error:
        ray_patches.check_ray_names()
    message = str(error.value)
    assert "ray.serve._private.proxy.NoSuchThing" in message
    assert "ProxyResponseGenerator.(no_such_parameter)" in message
    assert "no_such_module.x" in message
    assert f"ray[serve]=={ray_patches.RAY_VERSION}" in message


class _Response:
    """What the proxy's ``ProxyResponseGenerator`` wraps: a replica call."""

    def __init__(self) -> None:
        self.was_cancelled = False

    def cancelled(self) -> bool:
        return self.was_cancelled

    def cancel(self) -> None:
        self.was_cancelled = True


class _Context:
    """The grpc.aio servicer context's done callbacks."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def add_done_callback(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def end(self) -> None:
        for callback in self.callbacks:
            callback(self)


async def test_a_cancelled_generate_cancels_the_proxys_calls_to_replicas() -> None:
    """Registered on Ray's own gRPC proxy server, Generate's handler (Ray's, which sends the
    call to a replica) records the replica calls it makes and cancels them when the client's
    call ends before the replica's stream (grpc's cancelled() is not trusted: it can say
    False for a cancel), not after it; unary methods keep Ray's handler."""
    from ray.serve._private import proxy
    from ray.serve._private.grpc_util import gRPCGenericServer

    responses: list[_Response] = []

    def factory(*, service_method: str, streaming_type: Any) -> Any:
        async def ray_handler(request: Any, context: Any) -> Any:
            response = _Response()
            responses.append(response)
            proxy.ProxyResponseGenerator(response)  # what Ray's proxy builds per replica call
            yield "message"

        ray_handler.__qualname__ = f"ray:{service_method}"
        return ray_handler

    server = gRPCGenericServer(factory)
    ray_patches.add_streaming_handlers(server, generation_handler(NoServicer()))
    assert server.service_handler_factory is factory  # put back
    (handler,) = server.generic_rpc_handlers[-1]
    methods = handler._method_handlers  # type: ignore[attr-defined]
    assert methods["/kvserve.v1.Generation/GetModelInfo"].unary_unary.__qualname__ == (
        "ray:/kvserve.v1.Generation/GetModelInfo"
    )
    generate = methods["/kvserve.v1.Generation/Generate"].unary_stream
    for client_left_early in (True, False):
        context = _Context()
        stream = generate("request", context)
        assert await anext(stream) == "message"
        if not client_left_early:
            assert [m async for m in stream] == []  # the replica's stream ended
        context.end()
        assert responses[-1].was_cancelled is client_left_early
    await server.stop(None)


async def test_the_null_servicer_answers_unimplemented() -> None:
    """NoServicer's methods are never called (Ray replaces them); one that were says so."""

    class Context:
        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise RuntimeError(f"{code.name}: {details}")

    with pytest.raises(RuntimeError, match="UNIMPLEMENTED: Generate is served by a replica"):
        await NoServicer().Generate(None, Context())


@pytest.mark.parametrize(
    "error",
    [
        "The current node timed out during startup.",
        "Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc",
    ],
)
def test_a_node_that_missed_its_start_window_is_started_again(
    error: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Either window Ray gives a new local node (registering with its GCS, the GCS writing
    its port file) missed on a busy host: the node is started again, the GCS given 120 s;
    any other error is raised at once."""
    import ray

    from cluster import app

    calls: list[dict[str, Any]] = []

    def init(**kwargs: Any) -> None:
        calls.append(kwargs)
        if len(calls) == 1:
            raise RuntimeError(error)

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    environ: dict[str, str] = {}
    monkeypatch.setattr(os, "environ", environ)  # what set_ray_env writes stays here
    app.init_ray(num_cpus=1)
    assert calls == [{"num_cpus": 1}] * 2
    assert environ["RAY_gcs_server_port_wait_time_s"] == "120"
    monkeypatch.setattr(ray, "init", lambda **_: (_ for _ in ()).throw(RuntimeError("no GPUs")))
    with pytest.raises(RuntimeError, match="no GPUs"):
        app.init_ray()


def test_proxies_slower_than_serves_60_s_are_waited_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """serve.start gives its proxies a fixed 60 s: past it (a busy host) start_serve waits on
    until serve.status() shows every proxy healthy; proxies never healthy within its own
    bound, or any other error, are raised with what they were."""
    from ray import serve
    from ray.serve.schema import ProxyStatus

    from cluster import app

    started: list[dict[str, Any]] = []

    def start(**options: Any) -> None:
        started.append(options)
        raise TimeoutError("HTTP proxies not available after 60s.")

    states = iter([{}, {"n1": ProxyStatus.STARTING}] + [{"n1": ProxyStatus.HEALTHY}] * 9)
    looked: list[dict[str, ProxyStatus]] = []

    class Status:
        @property
        def proxies(self) -> dict[str, ProxyStatus]:
            looked.append(next(states))
            return looked[-1]

    monkeypatch.setattr(serve, "start", start)
    monkeypatch.setattr(serve, "status", Status)
    monkeypatch.setattr(app.time, "sleep", lambda _s: None)
    app.start_serve(grpc_options={"port": 1})
    assert started == [{"grpc_options": {"port": 1}}]
    assert looked == [{}, {"n1": ProxyStatus.STARTING}, {"n1": ProxyStatus.HEALTHY}]
    states = iter(lambda: {"node-abcdefgh-1": ProxyStatus.UNHEALTHY}, None)
    with pytest.raises(TimeoutError, match="not healthy after 0s: node-abc UNHEALTHY"):
        app.start_serve(proxy_wait_s=0)
    monkeypatch.setattr(serve, "start", lambda **_: (_ for _ in ()).throw(TimeoutError("other")))
    with pytest.raises(TimeoutError, match="other"):
        app.start_serve()


def test_one_test_says_a_replica_died() -> None:
    """Ray's actor errors mean the replica died, to the OpenAI ingress (a retryable
    ReplicaDiedError) and, inside the status a gRPC proxy builds, to the proxy; a replica's
    own exception, and a subclass of RayActorError Ray raises for other reasons, do not."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import gRPCStatusError

    from cluster.openai_ingress import ReplicaDiedError, replica_died, unwrap_ray_error
    from cluster.ray_patches import _replica_died

    class OtherActorError(RayActorError):
        pass

    for died in (ActorDiedError(), ActorUnavailableError("gone", b"a" * 16), RayActorError()):
        assert replica_died(died)
        assert isinstance(unwrap_ray_error(died), ReplicaDiedError)
        assert _replica_died(gRPCStatusError(died, grpc.StatusCode.UNKNOWN, "x"))
    own = ValueError("max_tokens must be >= 1")
    assert not replica_died(own) and unwrap_ray_error(own) is own
    assert not replica_died(OtherActorError())
    assert not _replica_died(gRPCStatusError(own, grpc.StatusCode.INVALID_ARGUMENT, "x"))
