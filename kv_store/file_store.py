"""One file per block: the alternative LMDB was measured against (see README, KV tiers).

``path/ab/<hex key>.kv``, written to a temporary name and renamed (atomic), last use = the
file's mtime (``os.utime`` on touch). The byte total is this process's view; over the bound
it rescans the directory (every process's files) and deletes the oldest.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

from kv_store.base import StoreError, os_error_kind


class FileStore:
    kind = "file"

    def __init__(self, path: str, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.path = path
        self.num_stale_locks = 0
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, f".probe.{os.getpid()}")
            with open(probe, "wb"):
                pass
            os.unlink(probe)
            self._count, self._bytes = self._scan(clean_tmp=True)[:2]
        except OSError as exc:
            raise StoreError("open", f"cannot use the file store at {path}: {exc}") from exc

    def _file(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.path, name[:2], name + ".kv")

    def get(self, key: bytes) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError("read", f"file store read failed: {exc}") from exc

    def contains(self, key: bytes) -> bool:
        return os.path.exists(self._file(key))

    def usage(self) -> tuple[int, int]:
        return self._count, self._bytes

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        num_new = 0
        try:
            for key, value in items:
                target = self._file(key)
                if os.path.exists(target):
                    os.utime(target)
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                tmp = f"{target}.{os.getpid()}.tmp"
                with open(tmp, "wb") as f:
                    f.write(value)
                os.replace(tmp, target)
                self._count += 1
                self._bytes += len(value)
                num_new += 1
            if self._bytes > self.capacity_bytes:
                self._evict()
        except OSError as exc:
            raise StoreError(
                os_error_kind(exc, "write"), f"file store write failed: {exc}"
            ) from exc
        return num_new

    def touch_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            with contextlib.suppress(OSError):
                os.utime(self._file(key))

    def discard(self, key: bytes) -> None:
        with contextlib.suppress(OSError):
            size = os.path.getsize(self._file(key))
            os.unlink(self._file(key))
            self._count -= 1
            self._bytes -= size

    def close(self) -> None:
        pass

    def _scan(self, clean_tmp: bool = False) -> tuple[int, int, list[tuple[int, int, str]]]:
        files: list[tuple[int, int, str]] = []
        for sub in os.scandir(self.path):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(".tmp"):
                    if clean_tmp:  # a killed writer's leftover
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                with contextlib.suppress(OSError):
                    st = entry.stat()
                    files.append((st.st_mtime_ns, st.st_size, entry.path))
        return len(files), sum(f[1] for f in files), files

    def _evict(self) -> None:
        count, total, files = self._scan()
        files.sort()
        for _mtime, size, path in files:
            if total <= self.capacity_bytes:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                total -= size
                count -= 1
        self._count, self._bytes = count, total
