"""Ray Serve's gRPC proxy as kvserve's front door.

``gRPCOptions(grpc_servicer_functions=["cluster.ingress.add_generation_service"])`` makes the
proxy serve ``kvserve.v1.Generation`` and hand each call to a replica's method of the same
name. The proxy calls this function once, in its own process, with its server.

It registers kvserve's handlers (with the lenient request decoding of ``server.grpc_service``, so
a malformed message is INVALID_ARGUMENT, as on a single server), and maps a replica that
died mid-call to ``UNAVAILABLE`` with a message that says so: gRPC's code for "retry, it
may work now", where Ray Serve's proxy says ``INTERNAL``. Other statuses pass unchanged.

A client's cancel reaches the replica: Ray's proxy cancels the replica's call only when the
cancel lands while it waits for the replica's next message; one that lands while it writes a
message to the client is swallowed, and the replica generates on (until the proxy's objects
are garbage-collected: seconds on a busy host). ``Generate`` here records the proxy's calls to
the replica and cancels them when the client's call ends cancelled.

The OpenAI-compatible API (``cluster.openai_ingress``) is a second application beside the
replicas' one. Ray's gRPC proxy routes a call by its ``application`` metadata once there are
two; a call without it goes to the replicas' application (``KVServeReplica``), so a plain
gRPC client needs no change.
"""

from __future__ import annotations

import contextvars
from collections.abc import AsyncIterator, Callable
from typing import Any
from unittest.mock import Mock

import grpc

from server.grpc_service import generation_handler

_PATCHED = "_kvserve_unavailable_on_replica_death"
_PATCHED_ROUTE = "_kvserve_grpc_default_application"
_PATCHED_CALLS = "_kvserve_records_replica_calls"
# The proxy's calls to replicas made for the gRPC call this task serves (``Generate`` below).
_CALLS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "kvserve_proxy_replica_calls", default=None
)


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import gRPCStatusError

    if isinstance(exc, gRPCStatusError):
        exc = exc.original_exception
    return isinstance(exc, ActorDiedError | ActorUnavailableError) or (type(exc) is RayActorError)


def install_unavailable_on_replica_death() -> None:
    """In this (proxy) process: a call whose replica died ends with UNAVAILABLE."""
    from ray.serve._private import proxy
    from ray.serve._private.proxy_request_response import ResponseStatus

    original = proxy.get_grpc_response_status
    if getattr(original, _PATCHED, False):
        return

    def get_grpc_response_status(exc: BaseException, *args: Any, **kwargs: Any) -> Any:
        if _replica_died(exc):
            return ResponseStatus(
                code=grpc.StatusCode.UNAVAILABLE,
                is_error=True,
                message=f"the replica serving this request died; retry: {type(exc).__name__}",
            )
        return original(exc, *args, **kwargs)

    setattr(get_grpc_response_status, _PATCHED, True)
    proxy.get_grpc_response_status = get_grpc_response_status


def install_default_application(deployment_name: str) -> None:
    """In this (proxy) process: a gRPC call without ``application`` metadata goes to the
    application whose ingress is ``deployment_name``, whatever other applications run."""
    from ray.serve._private.proxy_router import ProxyRouter

    original = ProxyRouter.get_handle_for_endpoint
    if getattr(original, _PATCHED_ROUTE, False):
        return

    def get_handle_for_endpoint(self: Any, target_app_name: str) -> Any:
        if not target_app_name:
            for endpoint, handle in self.handles.items():
                if endpoint.name == deployment_name:
                    info = self.endpoints[endpoint]
                    return info.route, handle, info.app_is_cross_language
        return original(self, target_app_name)

    setattr(get_handle_for_endpoint, _PATCHED_ROUTE, True)
    ProxyRouter.get_handle_for_endpoint = get_handle_for_endpoint  # type: ignore[method-assign]


def install_recorded_replica_calls() -> None:
    """In this (proxy) process: each call the proxy makes to a replica is recorded for the
    gRPC call being served (``cancel_reaches_the_replica``)."""
    from ray.serve._private import proxy

    base = proxy.ProxyResponseGenerator
    if getattr(base, _PATCHED_CALLS, False):
        return

    class RecordedResponseGenerator(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            calls = _CALLS.get()
            if calls is not None:
                calls.append(self)

    setattr(RecordedResponseGenerator, _PATCHED_CALLS, True)
    proxy.ProxyResponseGenerator = RecordedResponseGenerator  # type: ignore[misc]


def cancel_reaches_the_replica(
    method: Callable[[Any, Any], AsyncIterator[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """``method`` (the proxy's server-streaming handler), whose calls to a replica are
    cancelled as soon as the client's call ends cancelled (see the module docstring)."""

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        calls: list[Any] = []

        def on_done(ended: Any) -> None:
            if ended.cancelled():
                for call in calls:
                    response = call._response  # Ray's DeploymentResponseGenerator
                    if not response.cancelled():
                        response.cancel()

        context.add_done_callback(on_done)
        _CALLS.set(calls)  # this task's context: the call's own, ended with it
        async for message in method(request, context):
            yield message

    return stream


class _WithGenerate:
    """``servicer``'s methods, ``Generate`` replaced."""

    def __init__(self, servicer: Any, generate: Any) -> None:
        self._servicer = servicer
        self.Generate = generate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._servicer, name)


def add_generation_service(servicer: Any, server: grpc.aio.Server) -> None:
    """The ``grpc_servicer_functions`` entry for ``kvserve.v1.Generation``."""
    from cluster.openai_ingress import REPLICA_DEPLOYMENT

    servicer = servicer or Mock()
    install_recorded_replica_calls()
    handlers = _WithGenerate(servicer, cancel_reaches_the_replica(servicer.Generate))
    server.add_generic_rpc_handlers((generation_handler(handlers),))
    install_unavailable_on_replica_death()
    install_default_application(REPLICA_DEPLOYMENT)
