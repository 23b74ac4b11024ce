"""Ray Serve's gRPC proxy as kvserve's front door.

``gRPCOptions(grpc_servicer_functions=["cluster.ingress.add_generation_service"])`` makes the
proxy serve ``kvserve.v1.Generation`` and hand each call to a replica's method of the same
name. The proxy calls this function once, in its own process, with its server.

It registers kvserve's service (with the lenient request decoding of ``server.grpc_service``,
so a malformed message is INVALID_ARGUMENT, as on a single server); Ray's proxy replaces each
method with its own handler, which sends the call to a replica. The patches of Ray's proxy
that kvserve needs (``cluster.ray_patches``) go in here too: a replica that died mid-call is
``UNAVAILABLE`` with a message that says so (gRPC's code for "retry, it may work now", where
Ray says ``INTERNAL``), and a client's cancel reaches the replica (Ray drops a cancel that
lands while its proxy writes a message to the client).

The OpenAI-compatible API (``cluster.openai_ingress``) is a second application beside the
replicas' one. Ray's gRPC proxy routes a call by its ``application`` metadata once there are
two; a call without it goes to the replicas' application (``KVServeReplica``), so a plain
gRPC client needs no change.
"""

from __future__ import annotations

from typing import Any

import grpc

from cluster import ray_patches
from server.grpc_service import generation_handler


class NoServicer:
    """The servicer behind the proxy's kvserve service. Ray's proxy replaces each method's
    handler with its own (it sends the call to a replica), so none of these is called; one
    that were would answer UNIMPLEMENTED."""

    def __getattr__(self, name: str) -> Any:
        async def unreachable(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is served by a replica")

        return unreachable


def add_generation_service(servicer: Any, server: grpc.aio.Server) -> None:
    """The ``grpc_servicer_functions`` entry for ``kvserve.v1.Generation`` (``servicer``: Ray's
    placeholder, unused)."""
    from cluster.openai_ingress import REPLICA_DEPLOYMENT

    ray_patches.check_ray_names()
    ray_patches.add_streaming_handlers(server, generation_handler(NoServicer()))
    ray_patches.unavailable_on_replica_death()
    ray_patches.default_application(REPLICA_DEPLOYMENT)
