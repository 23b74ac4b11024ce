"""The adapters a runner serves, by name: loaded, resident within a budget, and in use.

    load(name, path)      read, check against the base, lay out: the adapter is served
    unload(name)          new requests for it are refused at once; its weights stay until the
                          last request using it ends (in-flight requests finish)
    resolve(name, scale)  the front end's lookup: a ``LoraRef`` (AdapterNotFoundError else)
    acquire / release     a request in flight pins its adapter: never evicted under it; an
                          adapter evicted earlier is read back from disk first
    weights(ref)          the engine thread's lookup at each step (None: not resident)

Residency: at most ``max_loaded`` adapters stay laid out in memory while unused (vLLM's
``--max-cpu-loras``); past it the least recently used unpinned one is dropped, and read back
(its digest checked) when a request needs it again. Adapters in use are never dropped, so
the budget may be passed while more adapters are in flight than it allows.

Thread-safe: the front ends call ``load``/``unload``/``resolve``/``acquire``/``release`` from
their threads, the engine thread calls ``weights``. Disk reads happen outside the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from model_runner.config import ModelConfig
from model_runner.lora.files import AdapterFile, read_adapter
from model_runner.lora.info import (
    AdapterConflictError,
    AdapterCounts,
    AdapterError,
    AdapterInfo,
    AdapterNotFoundError,
    check_name,
)
from model_runner.lora.layout import LoraWeights, check_fits
from scheduler.request import LoraRef


@dataclass(slots=True)
class _Entry:
    info: AdapterInfo
    weights: LoraWeights | None
    last_used: int
    pins: int = 0
    removed: bool = False  # unloaded: refused to new requests, dropped at pins == 0


class LoraRegistry:
    """See the module docstring. ``lay_out`` turns a checked adapter into the runner's
    ``LoraWeights`` (its dtype and device)."""

    def __init__(
        self,
        config: ModelConfig,
        lay_out: Callable[[AdapterFile], LoraWeights],
        *,
        max_rank: int = 64,
        max_loaded: int = 8,
        base_name: str = "",
    ) -> None:
        if max_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {max_rank}")
        if max_loaded < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {max_loaded}")
        self.config = config
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.base_name = base_name
        self._lay_out = lay_out
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()  # one disk read at a time
        self._clock = 0
        self.num_loads_total = 0  # adapters laid out (first loads and reads after eviction)
        self.num_evictions_total = 0

    # ------------------------------------------------------------------ queries
    def names(self) -> list[str]:
        """The adapters a request may name, in load order."""
        with self._lock:
            return [n for n, e in self._entries.items() if not e.removed]

    def infos(self) -> list[AdapterInfo]:
        with self._lock:
            return [
                _with_residency(e)
                for e in self._entries.values()
                if not e.removed
            ]  # fmt: skip

    def counts(self) -> AdapterCounts:
        with self._lock:
            resident = sum(e.weights is not None for e in self._entries.values())
            return AdapterCounts(resident, self.num_loads_total, self.num_evictions_total)

    def __len__(self) -> int:
        return len(self.names())

    def resolve(self, name: str, scale: float = 1.0) -> LoraRef:
        """The reference a request to adapter ``name`` carries; ``AdapterNotFoundError``
        listing the served names when there is none."""
        with self._lock:
            entry = self._active(name)
            return LoraRef(name, entry.info.key, scale)

    def weights(self, ref: LoraRef) -> LoraWeights | None:
        """The resident weights of ``ref``'s adapter (None: not resident, unknown, or
        loaded again with other weights since ``ref`` was made)."""
        with self._lock:
            entry = self._entries.get(ref.name)
            if entry is None or entry.info.key != ref.key or entry.weights is None:
                return None
            self._clock += 1
            entry.last_used = self._clock
            return entry.weights

    # ------------------------------------------------------------------ loading
    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read, check and lay out the adapter at ``path`` as ``name`` (``AdapterError``:
        unreadable or not for this base; ``AdapterConflictError``: the name is taken)."""
        check_name(name, self.base_name)
        with self._lock:
            self._check_free(name)
        with self._load_lock:
            adapter = read_adapter(path)
            check_fits(adapter, self.config, self.max_rank)
            weights = self._lay_out(adapter)
        info = AdapterInfo(
            name=name,
            path=str(path),
            kind=adapter.kind,
            rank=adapter.rank,
            alpha=adapter.alpha,
            target_modules=adapter.target_modules,
            digest=adapter.digest,
            num_parameters=adapter.num_parameters,
        )
        with self._lock:
            self._check_free(name)
            self._clock += 1
            self._entries[name] = _Entry(info, weights, self._clock)
            self.num_loads_total += 1
            self._evict_over_budget()
        return info

    def unload(self, name: str) -> AdapterInfo:
        """Stop serving ``name``: refused to new requests now, dropped once no request in
        flight uses it. Returns its info; ``AdapterNotFoundError`` if it is not served."""
        with self._lock:
            entry = self._active(name)
            entry.removed = True
            if entry.pins == 0:
                del self._entries[name]
            return entry.info

    def acquire(self, ref: LoraRef) -> None:
        """Pin ``ref``'s adapter for a request in flight, reading it back from disk if it
        was evicted (blocking: call from a worker thread). ``AdapterNotFoundError`` when it
        is no longer served or was loaded again with other weights."""
        with self._lock:
            entry = self._active(ref.name)
            if entry.info.key != ref.key:
                raise AdapterNotFoundError(
                    f"adapter {ref.name!r} was loaded again with other weights; resend the request"
                )
            entry.pins += 1
            if entry.weights is not None:
                self._clock += 1
                entry.last_used = self._clock
                return
        try:
            self._read_back(entry)
        except BaseException:
            self.release(ref)
            raise

    def needs_read(self, ref: LoraRef) -> bool:
        """Whether ``acquire(ref)`` would read from disk (the caller then runs it in a
        thread)."""
        with self._lock:
            entry = self._entries.get(ref.name)
            return entry is not None and entry.weights is None

    def release(self, ref: LoraRef) -> None:
        """A request that pinned ``ref``'s adapter ended."""
        with self._lock:
            entry = self._entries.get(ref.name)
            if entry is None or entry.info.key != ref.key:
                return
            entry.pins = max(0, entry.pins - 1)
            if entry.pins == 0 and entry.removed:
                del self._entries[ref.name]
            else:
                self._evict_over_budget()

    def pins(self, name: str) -> int:
        with self._lock:
            entry = self._entries.get(name)
            return 0 if entry is None else entry.pins

    # ------------------------------------------------------------------ internals
    def _active(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None or entry.removed:
            served = [n for n, e in self._entries.items() if not e.removed]
            listed = ", ".join(repr(n) for n in served) if served else "none"
            raise AdapterNotFoundError(
                f"no adapter named {name!r} is loaded; loaded adapters: {listed}"
            )
        return entry

    def _check_free(self, name: str) -> None:
        entry = self._entries.get(name)
        if entry is None:
            return
        if entry.removed:
            raise AdapterConflictError(
                f"adapter {name!r} is still unloading: {entry.pins} request(s) in flight use "
                "it; load it again when they are done"
            )
        raise AdapterConflictError(
            f"an adapter named {name!r} is already loaded (from {entry.info.path!r}); "
            "unload it first or pick another name"
        )

    def _read_back(self, entry: _Entry) -> None:
        """Lay out an evicted adapter again from its file, which must be the same bytes."""
        with self._load_lock:
            with self._lock:
                if entry.weights is not None:  # another request read it meanwhile
                    return
            adapter = read_adapter(entry.info.path)
            if adapter.digest != entry.info.digest:
                raise AdapterError(
                    f"adapter {entry.info.path!r} changed on disk since it was loaded as "
                    f"{entry.info.name!r}: unload and load it again"
                )
            weights = self._lay_out(adapter)
        with self._lock:
            entry.weights = weights
            self._clock += 1
            entry.last_used = self._clock
            self.num_loads_total += 1
            self._evict_over_budget()

    def _evict_over_budget(self) -> None:
        """Drop the least recently used unpinned adapters' weights while more than
        ``max_loaded`` are resident (under the lock)."""
        resident = [e for e in self._entries.values() if e.weights is not None]
        excess = len(resident) - self.max_loaded
        if excess <= 0:
            return
        for entry in sorted((e for e in resident if e.pins == 0), key=lambda e: e.last_used):
            if excess == 0:
                break
            entry.weights = None
            self.num_evictions_total += 1
            excess -= 1


def _with_residency(entry: _Entry) -> AdapterInfo:
    info = entry.info
    resident = entry.weights is not None
    return info if info.resident == resident else replace(info, resident=resident)
