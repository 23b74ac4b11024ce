"""Every reach into Ray Serve's private modules, in one place, each written for ``RAY_VERSION``.

Ray Serve's proxy is kvserve's front door (``cluster.ingress``, ``cluster.edge``), and some
of its behaviours do not suit kvserve, so the proxy process patches them (idempotently):

- ``unavailable_on_replica_death``: a call whose replica died ends with UNAVAILABLE ("retry,
  it may work now"), where Ray says INTERNAL; and a status a replica set on purpose (a
  refusal: UNAUTHENTICATED, RESOURCE_EXHAUSTED, ...) passes without Ray's traceback in the
  log (``proxy.get_grpc_response_status``).
- ``default_application``: a call without ``application`` metadata goes to the replicas'
  application, however many applications run (``ProxyRouter.get_handle_for_endpoint``).
- ``recorded_replica_calls``: each call the proxy makes to a replica is recorded for the
  gRPC call it serves (``proxy.ProxyResponseGenerator``), so ``cancel_on_client_cancel``
  can cancel it when the client cancels. Ray cancels the replica's call only when the cancel
  lands while the proxy waits for the replica's next message; one that lands while it writes
  a message to the client is swallowed, and the replica generates on until the proxy's
  objects are garbage-collected.
- ``guard_http_proxy``: the HTTP proxy's uvicorn server, configured as it starts
  (uvicorn's ``Server.startup``): the single server's timeouts and connection cap.
- ``grpc_proxy_server``: the gRPC proxy's server options and bind address
  (``grpc_util.DEFAULT_GRPC_SERVER_OPTIONS``, ``default_impl.add_grpc_address``).

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
    ("ray.serve._private.grpc_util", "DEFAULT_GRPC_SERVER_OPTIONS"),
    ("ray.serve._private.default_impl", "add_grpc_address"),
    ("uvicorn", "Server.startup.(sockets)"),
    ("ray.serve.exceptions", "RequestCancelledError"),
    ("ray._private.node", "Node.(head)"),
    ("ray.serve.exceptions", "gRPCStatusError.grpc_code"),
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
    """``openai_ingress.replica_died`` of the exception the proxy's status wraps."""
    from ray.serve.exceptions import gRPCStatusError

    from cluster.openai_ingress import replica_died

    if isinstance(exc, gRPCStatusError):
        exc = exc.original_exception
    return replica_died(exc)


def unavailable_on_replica_death() -> None:
    """In this (proxy) process: a call whose replica died ends with UNAVAILABLE, and a
    status the replica set on purpose is passed on without a traceback in the log.
    Written for Ray 2.60.0's ``proxy.get_grpc_response_status(exc, timeout_s, request_id)``
    and ``gRPCStatusError(original_exception, grpc_code, grpc_details)``."""
    from ray.serve._private import proxy
    from ray.serve._private.proxy_request_response import ResponseStatus
    from ray.serve.exceptions import gRPCStatusError

    from cluster.openai_ingress import EXPECTED_CODES

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
        if isinstance(exc, gRPCStatusError) and exc.grpc_code in EXPECTED_CODES:
            return ResponseStatus(code=exc.grpc_code, is_error=True, message=exc.grpc_details)
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


def guard_http_proxy(configure: Callable[[Any], Callable[[Any], None]]) -> None:
    """In this (proxy) process: every uvicorn server that kvserve did not guard itself (Ray's
    HTTP proxy) is passed to ``configure(server)`` as it starts, and the function that
    returns to ``after(server)`` once it listens. Ray 2.60.0 builds that server in
    ``ProxyActor.__init__``, whose globals Ray ships by value (``ProxyActor`` is an actor
    class), so ``proxy.start_asgi_http_server`` cannot be patched: uvicorn's
    ``Server.startup(sockets)`` (uvicorn 0.54) is."""
    import uvicorn

    from server.asgi import is_guarded

    original = uvicorn.Server.startup
    if getattr(original, _PATCHED, False):
        return

    async def startup(self: Any, sockets: Any = None) -> None:
        after = None if is_guarded(self.config) else configure(self)
        await original(self, sockets=sockets)
        if after is not None:
            after(self)

    setattr(startup, _PATCHED, True)
    uvicorn.Server.startup = startup  # type: ignore[method-assign]


def grpc_proxy_server(options: list[tuple[str, int]], host: str) -> None:
    """In this (proxy) process: the gRPC proxy's server built with ``options`` (over Ray's
    own of the same names) and bound to ``host`` instead of every interface. Written for
    Ray 2.60.0: ``gRPCGenericServer`` reads ``grpc_util.DEFAULT_GRPC_SERVER_OPTIONS`` when
    built, and ``start_grpc_server`` binds ``default_impl.add_grpc_address(server,
    "[::]:PORT")``."""
    from ray.serve._private import default_impl, grpc_util

    original = default_impl.add_grpc_address
    if getattr(original, _PATCHED, False):
        return
    ours = {name for name, _ in options}
    grpc_util.DEFAULT_GRPC_SERVER_OPTIONS = [
        *(o for o in grpc_util.DEFAULT_GRPC_SERVER_OPTIONS if o[0] not in ours),
        *options,
    ]
    bind = f"[{host}]" if ":" in host else host

    def add_grpc_address(server: Any, address: str) -> Any:
        return original(server, f"{bind}:{address.rpartition(':')[2]}")

    setattr(add_grpc_address, _PATCHED, True)
    default_impl.add_grpc_address = add_grpc_address


def quiet_cancelled_replica_calls(loop: Any) -> None:
    """On the proxy's event loop: a replica call cancelled because its client left is not
    logged as "Task exception was never retrieved" with a traceback. Ray 2.60.0's
    ``ProxyResponseGenerator`` awaits each next message in a task of its own, and leaves
    that task unread when the call is cancelled while it waits."""
    from ray.exceptions import TaskCancelledError
    from ray.serve.exceptions import RequestCancelledError

    previous = loop.get_exception_handler()
    if getattr(previous, _PATCHED, False):
        return

    def handler(loop: Any, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, RequestCancelledError | TaskCancelledError):
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    setattr(handler, _PATCHED, True)
    loop.set_exception_handler(handler)


def started_ray_here() -> bool:
    """Whether this process started the Ray it is connected to (a local node, which goes
    when this process ends) rather than joining a running one. Ray 2.60.0 keeps the driver's
    node in ``ray._private.worker._global_node``, ``head`` when it started it."""
    import ray._private.worker as worker

    return bool(getattr(worker._global_node, "head", False))
