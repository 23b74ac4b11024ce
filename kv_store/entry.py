"""One stored block: its identity (fingerprint, chain key, parent, salt, tokens), its KV
bytes, and a checksum over both. A bad entry is a miss, never wrong tokens::

    | magic "KVT2" | u32 CRC-32 of the rest | u32 meta_len | meta | payload |

CRC-32 (zlib, 7 GB/s here against BLAKE2b's 1.5) guards against corruption, not forgery: the
identity is compared field by field on every restore, and the store is the host's own.
    meta = fingerprint (32) | key (16) | parent flag + parent | salt flag + len + utf-8
           | u32 num_tokens | int64 tokens... | u64 payload_len
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

_MAGIC = b"KVT2"
_DIGEST = 4
_HEAD = len(_MAGIC) + _DIGEST + 4


class EntryError(ValueError):
    """A stored entry that must not be used; ``kind`` is "truncated" or "checksum"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Entry:
    fingerprint: bytes
    key: bytes
    parent_hash: bytes | None
    cache_salt: str | None
    token_ids: tuple[int, ...]
    payload: memoryview  # a view of the decoded buffer (no copy)


def store_key(fingerprint: bytes, key: bytes, cache_salt: str | None) -> bytes:
    """The store's key of a block: its chained prefix key, its salt and the model
    fingerprint, so no other model, format or tenant can ever read it."""
    h = hashlib.blake2b(digest_size=24)
    h.update(fingerprint)
    if cache_salt is None:
        h.update(b"\x00")
    else:
        salt = cache_salt.encode("utf-8")
        h.update(b"\x01" + len(salt).to_bytes(8, "little") + salt)
    h.update(key)
    return h.digest()


def encode_entry(
    fingerprint: bytes,
    key: bytes,
    parent_hash: bytes | None,
    cache_salt: str | None,
    token_ids: Sequence[int],
    payload: bytes,
) -> bytes:
    parts = [fingerprint, key]
    parts.append(b"\x00" if parent_hash is None else b"\x01" + parent_hash)
    if cache_salt is None:
        parts.append(b"\x00")
    else:
        salt = cache_salt.encode("utf-8")
        parts.append(b"\x01" + struct.pack("<I", len(salt)) + salt)
    parts.append(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    parts.append(struct.pack("<Q", len(payload)))
    meta = b"".join(parts)
    crc = zlib.crc32(payload, zlib.crc32(meta))
    return b"".join((_MAGIC, struct.pack("<II", crc, len(meta)), meta, payload))


def decode_entry(raw: bytes | memoryview) -> Entry:
    """Parse and verify ``raw``; EntryError("truncated" | "checksum") when it is unusable."""
    view = memoryview(raw)
    if len(view) < _HEAD or bytes(view[:4]) != _MAGIC:
        raise EntryError("truncated", f"entry of {len(view)} bytes has no header")
    (meta_len,) = struct.unpack_from("<I", view, 4 + _DIGEST)
    if len(view) < _HEAD + meta_len:
        raise EntryError("truncated", f"entry of {len(view)} bytes, meta of {meta_len}")
    meta = view[_HEAD : _HEAD + meta_len]
    payload = view[_HEAD + meta_len :]
    try:
        (payload_len,) = struct.unpack_from("<Q", meta, meta_len - 8)
    except struct.error as exc:
        raise EntryError("truncated", f"meta of {meta_len} bytes: {exc}") from None
    if len(payload) != payload_len:
        raise EntryError("truncated", f"payload of {len(payload)} bytes, expected {payload_len}")
    (crc,) = struct.unpack_from("<I", view, 4)
    if zlib.crc32(payload, zlib.crc32(meta)) != crc:
        raise EntryError("checksum", "entry checksum mismatch")
    m = bytes(meta)
    fingerprint, key, pos = m[:32], m[32:48], 48
    parent: bytes | None = None
    if m[pos] == 1:
        parent = m[pos + 1 : pos + 17]
        pos += 17
    else:
        pos += 1
    salt: str | None = None
    if m[pos] == 1:
        (n,) = struct.unpack_from("<I", m, pos + 1)
        salt = m[pos + 5 : pos + 5 + n].decode("utf-8")
        pos += 5 + n
    else:
        pos += 1
    (num_tokens,) = struct.unpack_from("<I", m, pos)
    tokens = struct.unpack_from(f"<{num_tokens}q", m, pos + 4)
    return Entry(fingerprint, key, parent, salt, tuple(tokens), payload)
