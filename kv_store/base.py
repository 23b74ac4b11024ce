"""The store interface of tier 2, its kinds and its errors (``open_store`` is in the package:
the stores import this module, so it imports none of them)."""

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
