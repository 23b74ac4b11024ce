"""The store interface of tier 2, its errors, and ``open_store``."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from typing import Protocol

STORE_KINDS = ("lmdb", "file")


class StoreError(RuntimeError):
    """A store operation failed; ``kind`` is one of ``cache_manager.TIER_ERROR_KINDS``."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def os_error_kind(exc: OSError, default: str) -> str:
    return "disk_full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else default


class BlockStore(Protocol):
    """Entries (``kv_store.entry``) under 24-byte keys, within ``capacity_bytes`` of entry
    bytes, least recently used evicted first. Safe for several processes at once. Every
    method raises only ``StoreError``."""

    kind: str
    capacity_bytes: int
    num_stale_locks: int  # left behind by killed processes, cleared at open

    def get(self, key: bytes) -> bytes | None: ...

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store new entries (an existing key is only marked used); evict the least
        recently used past the bound. Returns how many were new."""
        ...

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Mark entries used now (LRU order)."""
        ...

    def discard(self, key: bytes) -> None: ...

    def contains(self, key: bytes) -> bool: ...

    def usage(self) -> tuple[int, int]:
        """(entries, entry bytes) in the whole store, every process's included."""
        ...

    def close(self) -> None: ...


def open_store(kind: str, path: str, capacity_bytes: int) -> BlockStore:
    """Open (creating) the store at ``path``; StoreError("open") when it cannot be used."""
    if capacity_bytes < 1:
        raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
    if kind == "lmdb":
        from kv_store.lmdb_store import LmdbStore

        return LmdbStore(path, capacity_bytes)
    if kind == "file":
        from kv_store.file_store import FileStore

        return FileStore(path, capacity_bytes)
    raise ValueError(f"unknown store kind {kind!r}; use one of {list(STORE_KINDS)}")
