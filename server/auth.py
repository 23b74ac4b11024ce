"""Who a caller is: API keys, TLS files, and the owner that scopes a caller's request ids.

One home for the rules both front ends (gRPC, HTTP) and the metrics endpoint apply::

    Authorization: Bearer <key>   ->  owner "key:<digest of the key>"   (keys configured)
    no keys configured            ->  owner "peer:<client host>"
    a request id the client sends ->  engine id "<owner>/<request id>"

Request ids are scoped by owner: ``Abort`` and the duplicate-id check only ever see the
caller's own requests. The key itself is never kept in an id, a log line or a metric: only a
short BLAKE2b digest of it. Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

_BEARER = "bearer "
_OWNER_SEP = "/"


class AuthError(PermissionError):
    """The caller gave no API key or a wrong one (gRPC UNAUTHENTICATED, HTTP 401)."""


class NotAdminError(PermissionError):
    """A valid key that is not an admin key asked for a global view (gRPC
    PERMISSION_DENIED, HTTP 403)."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key, and optionally a CA that client
    certificates must chain to (then a client without a valid certificate is refused)."""

    cert: str
    key: str
    client_ca: str | None = None

    def read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = None if self.client_ca is None else Path(self.client_ca).read_bytes()
        return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), ca


@dataclass(frozen=True, slots=True)
class CacheScope:
    """Whose prefix cache a request's prompt lands in: what a replica (``Security``) and the
    Ray router (which holds no keys, only whether they are on) both derive a salt from."""

    keys_on: bool = False
    share_prefix_cache: bool = False

    def cache_salt(self, owner: str, client_salt: str | None) -> str | None:
        """The prefix-cache salt of a request: with keys on, the owner's (the client's own
        salt, a digest, narrows it); None: the shared cache."""
        if not self.keys_on or self.share_prefix_cache:
            return client_salt
        return f"{owner}|{client_salt or ''}"


@dataclass(frozen=True, slots=True)
class Security:
    """API keys (empty: authentication off), TLS (None: plaintext), and how tenants (keys)
    are kept apart::

        prefix cache     each key's prompts are salted by its owner (a client's cache_salt
                         narrows that further), unless ``share_prefix_cache``
        global views     /metrics and GetKVCacheStats (every tenant's figures) need one of
                         ``admin_keys`` when keys are on; other keys get 403 /
                         PERMISSION_DENIED (``metrics_require_key=False`` opens /metrics)
    """

    api_keys: frozenset[str] = field(default=frozenset(), repr=False)  # never logged
    tls: TlsFiles | None = None
    metrics_require_key: bool = True
    admin_keys: frozenset[str] = field(default=frozenset(), repr=False)  # also in api_keys
    share_prefix_cache: bool = False
    # The admin keys' owners, hashed once (every /metrics scrape checks them).
    _admin_owners: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_admin_owners", frozenset(map(key_owner, self.admin_keys)))

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_keys)

    def authenticate(self, authorization: str | None) -> str | None:
        """The owner for an ``Authorization`` header value; None when auth is off.
        Raises ``AuthError`` when keys are configured and this one is missing or wrong."""
        if not self.api_keys:
            return None
        given = bearer_key(authorization).encode()
        # Every key is compared, so the time taken does not say which prefix matched.
        ok = False
        for key in self.api_keys:
            ok |= hmac.compare_digest(given, key.encode())
        if not ok:
            raise AuthError(_INVALID)
        return key_owner(given.decode())

    def authenticate_admin(self, authorization: str | None) -> None:
        """Raises ``AuthError`` without a valid key and ``NotAdminError`` for a key that is
        not an admin key (keys on); without keys everyone may read the global views."""
        owner = self.authenticate(authorization)
        if owner is not None and owner not in self._admin_owners:
            raise NotAdminError(_NOT_ADMIN)

    def owner_gate(self) -> OwnerGate:
        """The admin check of /metrics, from the keys' owners (digests) instead of the keys."""
        return OwnerGate(
            frozenset(map(key_owner, self.api_keys)),
            self._admin_owners,
            self.metrics_require_key,
        )

    @property
    def cache_scope(self) -> CacheScope:
        """How these keys keep tenants apart in the prefix cache (the keys themselves stay)."""
        return CacheScope(self.auth_enabled, self.share_prefix_cache)

    def cache_salt(self, owner: str, client_salt: str | None) -> str | None:
        """``CacheScope.cache_salt`` under these keys."""
        return self.cache_scope.cache_salt(owner, client_salt)

    def owner(self, authorization: str | None, peer_host: str) -> str:
        """Who owns a request: the key's owner, or the peer's host when auth is off."""
        owner = self.authenticate(authorization)
        return owner if owner is not None else f"peer:{peer_host}"


_INVALID = "invalid API key"
_NOT_ADMIN = (
    "this API key may not read the server's global figures (every tenant's): use an admin "
    "key (--admin-api-key)"
)


def bearer_key(authorization: str | None) -> str:
    """The key of an ``Authorization`` value; ``AuthError`` when it is missing or malformed."""
    if not authorization:
        raise AuthError(
            "missing API key: send the header 'Authorization: Bearer <key>' (gRPC: "
            "'authorization' metadata)"
        )
    if not authorization.lower().startswith(_BEARER):
        raise AuthError("malformed Authorization header: expected 'Bearer <key>'")
    return authorization[len(_BEARER) :].strip()


@dataclass(frozen=True, slots=True)
class OwnerGate:
    """``Security``'s admin check for /metrics from the owners of the keys (``key_owner``
    digests), for a process that should not hold the keys themselves (the cluster's router,
    whose settings Ray keeps in its deployment config)."""

    api_owners: frozenset[str]
    admin_owners: frozenset[str]
    metrics_require_key: bool = True

    @property
    def auth_enabled(self) -> bool:
        return bool(self.api_owners)

    def authenticate_admin(self, authorization: str | None) -> None:
        if not self.api_owners:
            return
        owner = key_owner(bearer_key(authorization))
        if owner not in self.api_owners:
            raise AuthError(_INVALID)
        if owner not in self.admin_owners:
            raise NotAdminError(_NOT_ADMIN)


def request_owner(authorization: str | None, peer_host: str, auth_enabled: bool) -> str:
    """The owner a request would have (``Security.owner``) without checking its key: for
    routing a request to where its id lives; the replica checks the key."""
    if not auth_enabled:
        return f"peer:{peer_host}"
    try:
        return key_owner(bearer_key(authorization))
    except AuthError:
        return "unauthenticated"


def key_owner(key: str) -> str:
    return "key:" + hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def scoped_id(owner: str, request_id: str) -> str:
    """The engine's id of a client's request: unique across owners."""
    return f"{owner}{_OWNER_SEP}{request_id}"


def client_id(engine_id: str) -> str:
    """The id the client sent, from an engine id (``scoped_id``'s inverse)."""
    return engine_id.split(_OWNER_SEP, 1)[-1]


def grpc_peer_host(peer: str) -> str:
    """The host part of a grpc peer string (``ipv4:127.0.0.1:5555``, ``ipv6:[::1]:5555``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer  # unix sockets and others: the whole string


def read_api_keys(keys: Iterable[str], key_file: str | None) -> frozenset[str]:
    """Keys from flags and from a file (one per line; blank lines and ``#`` comments skipped)."""
    found = {k.strip() for k in keys if k.strip()}
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.add(line)
    return frozenset(found)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(host: str, security: Security, what: str) -> None:
    """A non-loopback bind with neither TLS nor keys is open to anyone who can reach it."""
    if not is_loopback(host) and security.tls is None and not security.api_keys:
        logger.warning(
            "%s listens on %s without TLS or an API key: anyone who can reach it can use it "
            "(pass --tls-cert/--tls-key and --api-key)",
            what,
            host,
        )
