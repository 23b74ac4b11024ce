"""The model fingerprint in every tier-2 key: what must match for stored KV to be valid."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_CHUNK = 8 << 20


def _file_digest(path: Path, cache: dict[str, str]) -> str:
    st = path.stat()
    ident = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if ident in cache:
        return cache[ident]
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    cache[ident] = h.hexdigest()
    return cache[ident]


def weights_digest(source: str | Path, cache_file: str | Path | None = None) -> str:
    """BLAKE2b of the weights: a file (GGUF), or a directory's config, tokenizer and
    safetensors. ``cache_file`` remembers digests by (path, size, mtime), so a restart does
    not hash a large file again."""
    path = Path(source)
    cache: dict[str, str] = {}
    if cache_file is not None:
        try:
            cache = json.loads(Path(cache_file).read_text())
        except (OSError, ValueError):
            cache = {}
    if path.is_dir():
        files = sorted(
            p
            for p in path.iterdir()
            if p.suffix in (".safetensors", ".json", ".model", ".gguf") and p.is_file()
        )
    else:
        files = [path]
    h = hashlib.blake2b(digest_size=16)
    for p in files:
        h.update(p.name.encode() + b"\x00" + _file_digest(p, cache).encode())
    if cache_file is not None:
        try:
            tmp = f"{cache_file}.{os.getpid()}.tmp"
            Path(tmp).write_text(json.dumps(cache))
            os.replace(tmp, cache_file)
        except OSError:
            pass  # a read-only store directory: the tier reports it when it opens
    return h.hexdigest()


def model_fingerprint(
    weights: str, weight_format: str, kv_dtype: str, block_size: int, tokenizer: str
) -> bytes:
    """32 bytes naming everything a block's KV depends on: the weights digest, how they are
    held (float, int8, native GGUF), the KV dtype, the block size and the tokenizer."""
    text = "\x00".join((weights, weight_format, kv_dtype, str(block_size), tokenizer))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=32).digest()
