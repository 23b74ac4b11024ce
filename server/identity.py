"""A request's identity in the prefix cache: the adapter it runs with and its cache salt.

    GenerateRequest (adapter, adapter_scale, cache_salt) + owner
        -> Adapters.for_request                 the LoRA adapter (None: the base model)
        -> CacheScope.cache_salt(owner, digest) tenants apart (keys on), the client's salt
        -> cache_salt_with(salt, adapter)       an adapter's KV apart from the base model's

``Frontend.engine_request`` (every replica and single server) and the Ray router (which keys
a gRPC prompt before a replica sees it) both call ``request_identity``, so the block keys the
router credits a replica with are the keys that replica's cache reports.
"""

from __future__ import annotations

from typing import Protocol

from scheduler.request import LoraRef
from server import validation
from server.lora import cache_salt_with
from server.rpc import generation_pb2 as pb


class SaltScope(Protocol):
    """How tenants are kept apart (``server.auth.Security`` and ``CacheScope`` have it)."""

    def cache_salt(self, owner: str, client_salt: str | None) -> str | None: ...


class AdapterLookup(Protocol):
    """Which adapter a request runs with (``server.lora.Adapters`` has it)."""

    def for_request(self, request: pb.GenerateRequest) -> LoraRef | None: ...


def request_identity(
    request: pb.GenerateRequest, owner: str, scope: SaltScope, adapters: AdapterLookup
) -> tuple[LoraRef | None, str | None]:
    """``request``'s adapter and prefix-cache salt, for ``owner`` (``server.auth``).
    Raises ``InvalidRequestError`` (a salt too long, a bad scale) and
    ``AdapterNotFoundError`` (an adapter not served)."""
    lora = adapters.for_request(request)
    client_salt = validation.cache_salt_digest(request.cache_salt)
    return lora, cache_salt_with(scope.cache_salt(owner, client_salt), lora)
