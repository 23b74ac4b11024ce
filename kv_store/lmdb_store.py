"""LMDB store: memory-mapped, crash-safe, many reader processes and one writer per host.

Four named databases in one environment::

    entries   key -> entry bytes
    last_use  key -> u64 last use (ns, big-endian) | u64 entry bytes
    lru       u64 last use | key -> b""        (a cursor walks it oldest first)
    meta      b"bytes" / b"count" -> u64       (the whole store, shared by every process)

Writes run in one transaction per batch (the engine's background writer), so the byte
bound and the LRU index stay exact across processes. ``sync=False``: a killed process loses
nothing (the page cache has it), a host crash may lose the last batches but never the
database's integrity (LMDB without WRITEMAP).
"""

from __future__ import annotations

import errno
import os
import struct
import time
from collections.abc import Sequence

import lmdb

from kv_store.base import StoreError

_U64 = struct.Struct(">Q")
_USE = struct.Struct(">QQ")
# The map is the file's upper bound, not its size: room for the bound plus LMDB's pages.
_MAP_SLACK_BYTES = 256 << 20


class LmdbStore:
    kind = "lmdb"

    def __init__(self, path: str, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        try:
            os.makedirs(path, exist_ok=True)
            self.env = lmdb.open(
                path,
                map_size=2 * capacity_bytes + _MAP_SLACK_BYTES,
                max_dbs=4,
                sync=False,
                metasync=False,
                readahead=True,
                max_readers=512,
            )
            self._entries = self.env.open_db(b"entries")
            self._last_use = self.env.open_db(b"last_use")
            self._lru = self.env.open_db(b"lru")
            self._meta = self.env.open_db(b"meta")
            # Reader slots of killed processes (their write lock is a robust mutex).
            self.num_stale_locks = self.env.reader_check()
        except (lmdb.Error, OSError) as exc:
            raise StoreError("open", f"cannot open the LMDB store at {path}: {exc}") from exc

    def get(self, key: bytes) -> bytes | None:
        try:
            with self.env.begin(db=self._entries) as txn:
                value = txn.get(key)
        except lmdb.Error as exc:
            raise StoreError("read", f"LMDB read failed: {exc}") from exc
        return None if value is None else bytes(value)

    def contains(self, key: bytes) -> bool:
        try:
            with self.env.begin(db=self._last_use) as txn:
                return txn.get(key) is not None
        except lmdb.Error as exc:
            raise StoreError("read", f"LMDB read failed: {exc}") from exc

    def usage(self) -> tuple[int, int]:
        try:
            with self.env.begin(db=self._meta) as txn:
                return self._counter(txn, b"count"), self._counter(txn, b"bytes")
        except lmdb.Error as exc:
            raise StoreError("read", f"LMDB read failed: {exc}") from exc

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        return self._write(items, ())

    def touch_many(self, keys: Sequence[bytes]) -> None:
        self._write((), keys)

    def discard(self, key: bytes) -> None:
        try:
            with self.env.begin(write=True) as txn:
                count, total = self._counter(txn, b"count"), self._counter(txn, b"bytes")
                size = self._delete(txn, key)
                if size is not None:
                    self._set_counters(txn, count - 1, total - size)
        except lmdb.Error as exc:
            raise StoreError("write", f"LMDB write failed: {exc}") from exc

    def close(self) -> None:
        self.env.close()

    # ------------------------------------------------------------------ internals

    def _write(self, items: Sequence[tuple[bytes, bytes]], touches: Sequence[bytes]) -> int:
        try:
            with self.env.begin(write=True) as txn:
                return self._write_txn(txn, items, touches)
        except lmdb.MapFullError as exc:
            raise StoreError("disk_full", f"LMDB map full: {exc}") from exc
        except lmdb.DiskError as exc:
            raise StoreError("disk_full", f"LMDB disk error: {exc}") from exc
        except lmdb.Error as exc:
            kind = "disk_full" if getattr(exc, "errno", None) == errno.ENOSPC else "write"
            raise StoreError(kind, f"LMDB write failed: {exc}") from exc
        except OSError as exc:
            kind = "disk_full" if exc.errno == errno.ENOSPC else "write"
            raise StoreError(kind, f"LMDB write failed: {exc}") from exc

    def _write_txn(
        self,
        txn: lmdb.Transaction,
        items: Sequence[tuple[bytes, bytes]],
        touches: Sequence[bytes],
    ) -> int:
        now = time.time_ns()
        count, total = self._counter(txn, b"count"), self._counter(txn, b"bytes")
        for key in touches:
            self._touch(txn, key, now)
        num_new = 0
        for key, value in items:
            if self._touch(txn, key, now):
                continue
            txn.put(key, value, db=self._entries)
            txn.put(key, _USE.pack(now, len(value)), db=self._last_use)
            txn.put(_U64.pack(now) + key, b"", db=self._lru)
            count += 1
            total += len(value)
            num_new += 1
        if total > self.capacity_bytes:
            cursor = txn.cursor(db=self._lru)
            cursor.first()
            while total > self.capacity_bytes and cursor.key():
                key = bytes(cursor.key()[8:])
                use = txn.get(key, db=self._last_use)
                cursor.delete()  # moves to the next entry
                if use is not None:
                    total -= _USE.unpack(use)[1]
                    count -= 1
                txn.delete(key, db=self._entries)
                txn.delete(key, db=self._last_use)
        self._set_counters(txn, count, total)
        return num_new

    def _touch(self, txn: lmdb.Transaction, key: bytes, now: int) -> bool:
        use = txn.get(key, db=self._last_use)
        if use is None:
            return False
        last, size = _USE.unpack(use)
        txn.delete(_U64.pack(last) + key, db=self._lru)
        txn.put(key, _USE.pack(now, size), db=self._last_use)
        txn.put(_U64.pack(now) + key, b"", db=self._lru)
        return True

    def _delete(self, txn: lmdb.Transaction, key: bytes) -> int | None:
        use = txn.get(key, db=self._last_use)
        if use is None:
            return None
        last, size = _USE.unpack(use)
        txn.delete(_U64.pack(last) + key, db=self._lru)
        txn.delete(key, db=self._last_use)
        txn.delete(key, db=self._entries)
        return int(size)

    def _counter(self, txn: lmdb.Transaction, name: bytes) -> int:
        raw = txn.get(name, db=self._meta)
        return 0 if raw is None else int(_U64.unpack(raw)[0])

    def _set_counters(self, txn: lmdb.Transaction, count: int, total: int) -> None:
        txn.put(b"count", _U64.pack(max(count, 0)), db=self._meta)
        txn.put(b"bytes", _U64.pack(max(total, 0)), db=self._meta)
