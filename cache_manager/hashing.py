"""Deterministic prefix-cache keys: the same tokens give the same key in every process."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

KEY_BYTES = 16  # 128-bit BLAKE2b; hits are verified against stored tokens anyway

_NO_PARENT = b"\x00"
_NO_SALT = b"\x00"


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None
) -> bytes:
    """Key of one full block: BLAKE2b over (parent key, cache_salt, token ids).

    Chaining the parent's key makes a key stand for the whole prefix up to and including this
    block. The salt is length-prefixed and the tokens are fixed-width little-endian int64, so
    no two different inputs share an encoding. Python's ``hash()`` is salted per process and
    is never used here.
    """
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(_NO_PARENT if parent_hash is None else b"\x01" + parent_hash)
    if cache_salt is None:
        h.update(_NO_SALT)
    else:
        salt = cache_salt.encode("utf-8")
        h.update(b"\x01" + len(salt).to_bytes(8, "little") + salt)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def prefix_block_keys(
    token_ids: Sequence[int], block_size: int, cache_salt: str | None
) -> list[bytes]:
    """Chained keys of every full block of ``token_ids``, as the prefix cache computes them.

    Key i stands for tokens ``[0, (i + 1) * block_size)``. The cluster router scores replicas
    with these, so a prefix means the same thing in the router and in every replica's cache.
    """
    keys: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], cache_salt)
        keys.append(parent)
    return keys


def adapter_salt(cache_salt: str | None, adapter: str) -> str:
    """The salt of a request run with a LoRA adapter: ``adapter`` (what names its weights
    and scale) joins the tenant's ``cache_salt``. KV computed under an adapter differs from
    the base model's and from any other adapter's, so their prefixes never hit each other's
    blocks (in tier 1, tier 2, the prefill hand-off and the cluster's routing alike, which
    all key by the salt); two requests of one adapter and one salt still share theirs. A
    client's own salt reaches the cache as a digest, so it cannot spell this prefix."""
    return f"lora={adapter};{cache_salt or ''}"
