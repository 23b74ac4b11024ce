"""The tier-2 stores: entries, keys, LRU within the byte bound, restarts, several processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kv_store import (
    EntryError,
    StoreError,
    decode_entry,
    encode_entry,
    model_fingerprint,
    open_store,
    store_key,
)

FP = model_fingerprint("digest", "float/float32", "float32", 4, "tiny/128")
KEY = bytes(range(16))


def entry(payload: bytes, tokens: tuple[int, ...] = (1, 2, 3, 4), salt: str | None = None) -> bytes:
    return encode_entry(FP, KEY, None, salt, tokens, payload)


def test_entry_round_trip_keeps_identity_and_bytes() -> None:
    """An entry decodes to the fingerprint, keys, salt, tokens and payload it was made of."""
    raw = encode_entry(FP, KEY, bytes(16), "tenant", (5, -1, 2**40), b"\x00\x01kv")
    e = decode_entry(raw)
    assert (e.fingerprint, e.key, e.parent_hash, e.cache_salt) == (FP, KEY, bytes(16), "tenant")
    assert (e.token_ids, e.payload) == ((5, -1, 2**40), b"\x00\x01kv")


@pytest.mark.parametrize("where", [30, -1])
def test_a_flipped_byte_fails_the_checksum(where: int) -> None:
    """One flipped byte in the identity or in the KV bytes is a checksum error."""
    raw = bytearray(entry(b"x" * 64))
    raw[where] ^= 0x40
    with pytest.raises(EntryError) as info:
        decode_entry(bytes(raw))
    assert info.value.kind == "checksum"


@pytest.mark.parametrize("length", [0, 10, 80, -1])
def test_a_truncated_entry_is_reported_truncated(length: int) -> None:
    """An entry cut anywhere is a truncated error, never a short payload."""
    raw = entry(b"x" * 64)
    with pytest.raises(EntryError) as info:
        decode_entry(raw[:length])
    assert info.value.kind == "truncated"


def test_store_keys_separate_fingerprints_and_salts() -> None:
    """The same chain key under another model fingerprint or salt is another store key."""
    other_fp = model_fingerprint("digest", "float/float32", "float16", 4, "tiny/128")
    keys = {
        store_key(FP, KEY, None),
        store_key(FP, KEY, "a"),
        store_key(FP, KEY, "b"),
        store_key(other_fp, KEY, None),
    }
    assert len(keys) == 4
    assert store_key(FP, KEY, "a") == store_key(FP, KEY, "a")


def test_fingerprint_covers_every_part() -> None:
    """Changing any one of weights, format, KV dtype, block size, tokenizer changes it."""
    base = ("w", "float", "float32", 16, "tok")
    fps = {model_fingerprint(*base)}
    for i, value in enumerate(("w2", "int8", "float16", 32, "tok2")):
        parts = list(base)
        parts[i] = value
        fps.add(model_fingerprint(*parts))  # type: ignore[arg-type]
    assert len(fps) == 6


@pytest.mark.parametrize("kind", ["lmdb", "file"])
def test_lru_eviction_by_last_use_within_the_byte_bound(kind: str, tmp_path: object) -> None:
    """Over the bound the least recently used entry goes: a touched old entry stays."""
    store = open_store(kind, str(tmp_path), capacity_bytes=3 * 1000)
    k = [bytes([i]) * 24 for i in range(4)]
    for key in k[:3]:
        assert store.put_many([(key, b"v" * 1000)]) == 1
    store.touch_many([k[0]])  # k0 is now more recent than k1 and k2
    assert store.put_many([(k[3], b"v" * 1000)]) == 1
    assert [store.get(key) is not None for key in k] == [True, False, True, True]
    assert store.usage() == (3, 3000)
    assert store.put_many([(k[0], b"v" * 1000)]) == 0  # present: only marked used
    store.close()


@pytest.mark.parametrize("kind", ["lmdb", "file"])
def test_entries_survive_a_restart(kind: str, tmp_path: object) -> None:
    """A store closed and opened again returns what was written, with its usage."""
    store = open_store(kind, str(tmp_path), capacity_bytes=1 << 20)
    store.put_many([(b"a" * 24, b"payload-a"), (b"b" * 24, b"payload-b")])
    store.close()
    again = open_store(kind, str(tmp_path), capacity_bytes=1 << 20)
    assert again.get(b"a" * 24) == b"payload-a"
    assert again.usage() == (2, 18)
    again.close()


def test_unusable_directory_fails_to_open_with_kind_open() -> None:
    """A directory that cannot be created (a read-only file system) is a StoreError("open")."""
    for kind in ("lmdb", "file"):
        with pytest.raises(StoreError) as info:
            open_store(kind, "/proc/kvserve-tier-test", capacity_bytes=1 << 20)
        assert info.value.kind == "open"


_WRITER = textwrap.dedent(
    """
    import sys
    from kv_store import open_store
    store = open_store("lmdb", sys.argv[1], capacity_bytes=1 << 30)
    tag = sys.argv[2].encode()
    for i in range(50):
        store.put_many([(tag + i.to_bytes(4, "big") + bytes(19), tag * 100)])
    store.close()
    """
)


def test_two_processes_share_one_store(tmp_path: object) -> None:
    """Two processes writing at once into one store: every entry and the shared byte count
    are exact, and a third process sees all of them."""
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), tag]) for tag in "ab"]
    assert [p.wait(60) for p in procs] == [0, 0]
    store = open_store("lmdb", str(tmp_path), capacity_bytes=1 << 30)
    assert store.usage() == (100, 100 * 100)
    assert store.get(b"b" + (7).to_bytes(4, "big") + bytes(19)) == b"b" * 100
    store.close()


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from kv_store import open_store
    store = open_store("lmdb", sys.argv[1], capacity_bytes=1 << 30)
    store.put_many([(b"k" * 24, b"before")])
    reader = store.env.begin()          # a reader slot
    writer = store.env.begin(write=True)  # and the write lock
    writer.put(b"x", b"y", db=store._entries)
    print("holding", flush=True)
    time.sleep(60)
    """
)


def test_store_held_by_a_killed_process_is_usable(tmp_path: object) -> None:
    """A process killed while holding the write lock and a reader slot leaves the store
    writable and its committed entries readable (LMDB's robust lock; its open transaction
    is gone)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    store = open_store("lmdb", str(tmp_path), capacity_bytes=1 << 30)
    assert store.put_many([(b"n" * 24, b"after")]) == 1
    assert (store.get(b"k" * 24), store.get(b"n" * 24)) == (b"before", b"after")
    assert store.usage() == (2, 11)
    store.close()


def test_kv_store_and_the_tier_mover_do_not_import_torch() -> None:
    """The store and server.kv_tier import no torch (the runner's block mover is lazy)."""
    code = (
        "import sys, kv_store, kv_store.lmdb_store, kv_store.file_store, server.kv_tier\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
