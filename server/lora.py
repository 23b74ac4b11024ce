"""The fronts' view of the LoRA adapters (``model_runner.lora``): which adapter a request
runs with, the names to list, the admin operations, llama.cpp's server-wide scales.

    GenerateRequest.adapter (gRPC) / OpenAI "model" / llama.cpp "lora": [{"id", "scale"}]
        -> Adapters.for_request -> LoraRef (name, the key of its weights, scale)
        -> the request's cache salt: adapter_salt(salt, ref), so KV made with an adapter is
           only ever a prefix hit for requests of the same adapter and scale

A request that names no adapter runs the base model, unless llama.cpp's ``POST
/lora-adapters`` set a server-wide adapter (the only one with a non-zero scale), as
llama-server applies its loaded adapters to requests without their own ``lora``.

Single server and replicas: a live ``LoraRegistry`` behind it (``LiveAdapters``). The
cluster's OpenAI ingress holds no weights: it lists and resolves from the adapters a replica
reported at start (``ListedAdapters``), and its replicas check the names again when they
admit the request; the Ray router resolves by the keys the replicas report.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from cache_manager.hashing import adapter_salt
from model_runner.lora.info import AdapterError, AdapterInfo, AdapterNotFoundError
from scheduler.request import LoraRef
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError

if TYPE_CHECKING:
    from model_runner.base import AdapterSource


class _Catalog(Protocol):
    """Where a front's adapter names resolve: a live registry or a list."""

    can_load: bool

    def infos(self) -> list[AdapterInfo]: ...

    def resolve(self, name: str, scale: float) -> LoraRef | None:
        """``name``'s reference; None when it is not served."""
        ...

    def load(self, name: str, path: str) -> AdapterInfo: ...

    def unload(self, name: str) -> AdapterInfo: ...


class LiveAdapters:
    """The adapters of a runner's registry (a single server, a replica): loaded at run time."""

    can_load = True

    def __init__(self, registry: AdapterSource) -> None:
        self.registry = registry

    def infos(self) -> list[AdapterInfo]:
        return self.registry.infos()

    def resolve(self, name: str, scale: float) -> LoraRef | None:
        try:
            return self.registry.resolve(name, scale)
        except AdapterNotFoundError:
            return None

    def load(self, name: str, path: str) -> AdapterInfo:
        return self.registry.load(name, path)

    def unload(self, name: str) -> AdapterInfo:
        return self.registry.unload(name)


class ListedAdapters:
    """Adapters a front holds no weights of (the cluster's OpenAI ingress: ``infos``, listed;
    the Ray router: ``keys``, name -> the key of its weights, resolved only)."""

    can_load = False

    def __init__(self, infos: Sequence[AdapterInfo], keys: Mapping[str, str]) -> None:
        self._infos = list(infos)
        self._keys = {i.name: i.key for i in infos} | dict(keys)

    def infos(self) -> list[AdapterInfo]:
        return list(self._infos)

    def resolve(self, name: str, scale: float) -> LoraRef | None:
        key = self._keys.get(name)
        return None if key is None else LoraRef(name, key, scale)

    def load(self, name: str, path: str) -> AdapterInfo:
        raise AdapterError(_NO_WEIGHTS)

    def unload(self, name: str) -> AdapterInfo:
        raise AdapterError(_NO_WEIGHTS)


_NO_WEIGHTS = "this front holds no adapters: load them with --lora on the replicas"


class Adapters:
    """See the module docstring; thread-safe (the fronts run loads in worker threads)."""

    def __init__(
        self,
        registry: AdapterSource | None = None,
        infos: Sequence[AdapterInfo] = (),
        base_name: str = "",
        keys: Mapping[str, str] | None = None,
    ) -> None:
        """``infos``: the adapters a front without weights lists and resolves; ``keys``:
        adapters known only by the key of their weights (name -> key: the Ray router's,
        from the replicas' reports), resolved and not listed."""
        self._catalog: _Catalog = (
            LiveAdapters(registry) if registry is not None else ListedAdapters(infos, keys or {})
        )
        self.base_name = base_name
        self._scales: dict[str, float] = {}  # llama.cpp's server-wide scales (non-zero only)
        self._lock = threading.Lock()

    @property
    def can_load(self) -> bool:
        return self._catalog.can_load

    def infos(self) -> list[AdapterInfo]:
        return self._catalog.infos()

    def names(self) -> list[str]:
        return [i.name for i in self.infos()]

    def resolve(self, name: str, scale: float = 1.0) -> LoraRef:
        """``name``'s reference; ``AdapterNotFoundError`` naming what is served."""
        ref = self._catalog.resolve(name, scale)
        if ref is None:
            raise AdapterNotFoundError(not_found_message(name, self.base_name, self.names()))
        return ref

    def for_request(self, request: pb.GenerateRequest) -> LoraRef | None:
        """The adapter ``request`` runs with: its ``adapter`` field, else the server-wide
        one (llama.cpp's scales); None: the base model (so is a scale of 0)."""
        scale = request.adapter_scale if request.HasField("adapter_scale") else 1.0
        if request.HasField("adapter_scale") and not -1e4 <= scale <= 1e4:
            raise InvalidRequestError(f"adapter_scale must be in [-1e4, 1e4], got {scale:g}")
        if request.adapter:
            return None if scale == 0 else self.resolve(request.adapter, scale)
        if request.HasField("adapter_scale"):
            if scale == 0:
                return None  # no adapter, whatever the server-wide one (llama.cpp's lora: 0)
            raise InvalidRequestError("adapter_scale needs an adapter")
        with self._lock:
            scales = dict(self._scales)
        for name, default_scale in scales.items():
            try:
                return self.resolve(name, default_scale)
            except AdapterNotFoundError:  # unloaded since: its scale goes with it
                with self._lock:
                    self._scales.pop(name, None)
        return None

    # ------------------------------------------------------------------ llama.cpp's scales
    def scales(self) -> dict[str, float]:
        with self._lock:
            return {name: self._scales.get(name, 0.0) for name in self.names()}

    def set_scales(self, scales: dict[str, float]) -> None:
        """Server-wide scales for requests that name no adapter: at most one non-zero
        (kvserve applies one adapter per request); adapters left out get 0."""
        nonzero = {n: s for n, s in scales.items() if s != 0}
        if len(nonzero) > 1:
            raise InvalidRequestError(
                f"kvserve applies one adapter per request: {len(nonzero)} adapters have a "
                "non-zero scale; give all but one scale 0"
            )
        for name in nonzero:
            self.resolve(name)
        with self._lock:
            self._scales = nonzero

    # ------------------------------------------------------------------ admin (blocking)
    def load(self, name: str, path: str) -> AdapterInfo:
        return self._catalog.load(name, path)

    def unload(self, name: str) -> AdapterInfo:
        try:
            info = self._catalog.unload(name)
        except AdapterNotFoundError:
            raise AdapterNotFoundError(
                not_found_message(name, self.base_name, self.names(), model=False)
            ) from None
        with self._lock:
            self._scales.pop(name, None)
        return info


def cache_salt_with(cache_salt: str | None, lora: LoraRef | None) -> str | None:
    """The request's prefix-cache salt with its adapter in it (``cache_manager.hashing``)."""
    if lora is None:
        return cache_salt
    scale = "" if lora.scale == 1.0 else f"*{lora.scale!r}"
    return adapter_salt(cache_salt, lora.key + scale)


def not_found_message(name: str, base: str, names: Sequence[str], model: bool = True) -> str:
    """What a request for an unknown adapter is told: the base model and the adapters."""
    adapters = ", ".join(repr(n) for n in names) if names else "none"
    what = "model" if model else "adapter"
    served = f"this server serves {base!r}" if base else "this server serves"
    return f"the {what} {name!r} does not exist: {served} and the adapters: {adapters}"
