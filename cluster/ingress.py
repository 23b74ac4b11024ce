"""Ray Serve's gRPC proxy as kvserve's front door.

``gRPCOptions(grpc_servicer_functions=["cluster.ingress.add_generation_service"])`` makes the
proxy serve ``kvserve.v1.Generation`` and hand each call to a replica's method of the same
name. The proxy calls this function once, in its own process, with its server.

It registers kvserve's handlers (with the lenient request decoding of ``server.grpc_service``, so
a malformed message is INVALID_ARGUMENT, as on a single server), and maps a replica that
died mid-call to ``UNAVAILABLE`` with a message that says so: gRPC's code for "retry, it
may work now", where Ray Serve's proxy says ``INTERNAL``. Other statuses pass unchanged.

An HTTP front end (the OpenAI-compatible API) plugs in beside it: a Ray Serve ingress
deployment that calls the replicas' ``Generate`` through a ``DeploymentHandle``.
"""

from __future__ import annotations

from typing import Any
from unittest.mock import Mock

import grpc

from server.grpc_service import generation_handler

_PATCHED = "_kvserve_unavailable_on_replica_death"


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


def add_generation_service(servicer: Any, server: grpc.aio.Server) -> None:
    """The ``grpc_servicer_functions`` entry for ``kvserve.v1.Generation``."""
    server.add_generic_rpc_handlers((generation_handler(servicer or Mock()),))
    install_unavailable_on_replica_death()
