"""Tier 2 of the KV cache: a bounded on-disk store of evicted prefix blocks.

``open_store(kind, path, capacity_bytes)`` gives a ``BlockStore`` (LMDB by default, one file
per block as the measured alternative); ``entry`` encodes a block with its identity and a
checksum; ``fingerprint`` names the model a block belongs to. No torch here: the engine
(``server.kv_tier``) moves bytes between the pool and the store.
"""

from kv_store.base import STORE_KINDS, BlockStore, StoreError
from kv_store.entry import EntryError, decode_entry, encode_entry, store_key
from kv_store.fingerprint import model_fingerprint

__all__ = [
    "STORE_KINDS",
    "BlockStore",
    "EntryError",
    "StoreError",
    "decode_entry",
    "encode_entry",
    "model_fingerprint",
    "open_store",
    "store_key",
]


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
