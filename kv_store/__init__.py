"""Tier 2 of the KV cache: a bounded on-disk store of evicted prefix blocks.

``open_store(kind, path, capacity_bytes)`` gives a ``BlockStore`` (LMDB by default, one file
per block as the measured alternative); ``entry`` encodes a block with its identity and a
checksum; ``fingerprint`` names the model a block belongs to. No torch here: the engine
(``server.kv_tier``) moves bytes between the pool and the store.
"""

from kv_store.base import STORE_KINDS, BlockStore, StoreError, open_store
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
