"""Every reach into Ray Serve's private modules, in one place, each written for ``RAY_VERSION``.

Ray Serve's gRPC proxy is kvserve's front door (``cluster.ingress``), and three of its
behaviours do not suit kvserve, so the proxy process patches them (idempotently):

- ``unavailable_on_replica_death``: a call whose replica died ends with UNAVAILABLE ("retry,
  it may work now"), where Ray says INTERNAL (``proxy.get_grpc_response_status``).
- ``default_application``: a call without ``application`` metadata goes to the replicas'
  application, however many applications run (``ProxyRouter.get_handle_for_endpoint``).
- ``recorded_replica_calls``: each call the proxy makes to a replica is recorded for the
  gRPC call it serves (``proxy.ProxyResponseGenerator``), so ``cancel_on_client_cancel``
  can cancel it when the client cancels. Ray cancels the replica's call only when the cancel
  lands while the proxy waits for the replica's next message; one that lands while it writes
  a message to the client is swallowed, and the replica generates on until the proxy's
  objects are garbage-collected.

``pyproject.toml`` pins Ray to ``RAY_VERSION``. ``check_ray_names`` (called at start-up, by
``kvserve cluster serve`` and in the proxy) says plainly which name moved if another Ray
version lacks one, instead of a patch failing somewhere in the proxy.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

RAY_VERSION = "2.60.0"  # the Ray these patches were written for (pyproject.toml pins it)

# (module, attribute path) of every private name patched or read here; a last part in
# parentheses is a parameter of the callable before it.
PATCHED_NAMES = (
    ("ray.serve._private.proxy", "get_grpc_response_status"),
    ("ray.serve._private.proxy", "ProxyResponseGenerator.(response)"),
    ("ray.serve._private.proxy_request_response", "ResponseStatus"),
    ("ray.serve._private.proxy_request_response", "gRPCStreamingType.UNARY_STREAM"),
    ("ray.serve._private.proxy_router", "ProxyRouter.get_handle_for_endpoint"),
    ("ray.serve._private.grpc_util", "gRPCGenericServer.(service_handler_factory)"),
)

_PATCHED = "_kvserve_patched"
# The proxy's calls to replicas made for the gRPC call this task serves.
_CALLS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "kvserve_proxy_replica_calls", default=None
)


def missing_ray_names() -> list[str]:
    """The patched names this Ray lacks (none on ``RAY_VERSION``)."""
    return [f"{module}.{path}" for module, path in PATCHED_NAMES if not _exists(module, path)]


def _exists(module_name: str, path: str) -> bool:
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError:
        return False
    for part in path.split("."):
        if part.startswith("("):
            return part.strip("()") in inspect.signature(target).parameters
        target = getattr(target, part, None)
        if target is None:
            return False
    return True


def check_ray_names() -> None:
    """Raise RuntimeError naming what moved, when this Ray lacks a name patched here."""
    missing = missing_ray_names()
    if missing:
        import ray

        raise RuntimeError(
            f"kvserve's cluster patches Ray Serve {RAY_VERSION} (cluster/ray_patches.py), but "
            f"Ray {ray.__version__} has no {', '.join(missing)}: install "
            f"ray[serve]=={RAY_VERSION} (pip install 'kvserve[ray]')"
        )


def _replica_died(exc: BaseException) -> bool:
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import gRPCStatusError

    if isinstance(exc, gRPCStatusError):
        exc = exc.original_exception
    return isinstance(exc, ActorDiedError | ActorUnavailableError) or (type(exc) is RayActorError)


def unavailable_on_replica_death() -> None:
    """In this (proxy) process: a call whose replica died ends with UNAVAILABLE.
    Written for Ray 2.60.0's ``proxy.get_grpc_response_status(exc, timeout_s, request_id)``."""
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


def default_application(deployment_name: str) -> None:
    """In this (proxy) process: a gRPC call without ``application`` metadata goes to the
    application whose ingress is ``deployment_name``, whatever other applications run.
    Written for Ray 2.60.0's ``ProxyRouter`` (``handles``, ``endpoints``)."""
    from ray.serve._private.proxy_router import ProxyRouter

    original = ProxyRouter.get_handle_for_endpoint
    if getattr(original, _PATCHED, False):
        return

    def get_handle_for_endpoint(self: Any, target_app_name: str) -> Any:
        if not target_app_name:
            for endpoint, handle in self.handles.items():
                if endpoint.name == deployment_name:
                    info = self.endpoints[endpoint]
                    return info.route, handle, info.app_is_cross_language
        return original(self, target_app_name)

    setattr(get_handle_for_endpoint, _PATCHED, True)
    ProxyRouter.get_handle_for_endpoint = get_handle_for_endpoint  # type: ignore[method-assign]


def recorded_replica_calls() -> None:
    """In this (proxy) process: each call the proxy makes to a replica is recorded for the
    gRPC call being served (``cancel_on_client_cancel``). Written for Ray 2.60.0's
    ``proxy.ProxyResponseGenerator(response, ...)``."""
    from ray.serve._private import proxy

    base = proxy.ProxyResponseGenerator
    if getattr(base, _PATCHED, False):
        return

    class RecordedResponseGenerator(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            calls = _CALLS.get()
            if calls is not None:
                calls.append(self)

    setattr(RecordedResponseGenerator, _PATCHED, True)
    proxy.ProxyResponseGenerator = RecordedResponseGenerator  # type: ignore[misc]


def cancel_replica_call(call: Any) -> None:
    """Cancel the replica call behind one of Ray's ``ProxyResponseGenerator`` (its
    ``_response``: the ``DeploymentResponse(Generator)``; Ray 2.60.0)."""
    response = call._response
    if not response.cancelled():
        response.cancel()


def cancel_on_client_cancel(
    method: Callable[[Any, Any], AsyncIterator[Any]],
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """``method`` (the proxy's server-streaming handler), whose calls to a replica are
    cancelled as soon as the client's call ends before the replica's stream did (the module
    docstring). grpc's ``cancelled()`` is not asked: a cancel that lands while the proxy
    writes a message ends the call with it False."""

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        calls: list[Any] = []
        replica_done = False

        def on_done(_: Any) -> None:
            if not replica_done:
                for call in calls:
                    cancel_replica_call(call)

        context.add_done_callback(on_done)
        _CALLS.set(calls)  # this task's context: the call's own, ended with it
        async for message in method(request, context):
            yield message
        replica_done = True

    return stream


def add_streaming_handlers(server: Any, handler: grpc.GenericRpcHandler) -> None:
    """Add ``handler``'s service to Ray's gRPC proxy ``server`` (a ``gRPCGenericServer``),
    which replaces every method with its own handler that sends the call to a replica: its
    server-streaming ones are wrapped by ``cancel_on_client_cancel``. Written for Ray
    2.60.0's ``service_handler_factory(service_method, streaming_type)``."""
    from ray.serve._private.proxy_request_response import gRPCStreamingType

    recorded_replica_calls()
    factory = server.service_handler_factory

    def factory_with_cancel(*, service_method: str, streaming_type: Any) -> Any:
        made = factory(service_method=service_method, streaming_type=streaming_type)
        if streaming_type == gRPCStreamingType.UNARY_STREAM:
            return cancel_on_client_cancel(made)
        return made

    server.service_handler_factory = factory_with_cancel
    try:
        server.add_generic_rpc_handlers((handler,))
    finally:
        server.service_handler_factory = factory
