"""Prefix-cache keys: deterministic across processes, unambiguous, and collisions never hit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import cache_manager.prefix
from cache_manager import hash_block_tokens
from tests.cache_manager.helpers import hit_view, make_kv, make_seq, prefill

_KEY_PROGRAM = (
    "from cache_manager import hash_block_tokens as h\n"
    "k = h(None, [1, 2, 3, 4], 'salt')\n"
    "print(h(k, [5, 6, 7, 8], 'salt').hex())\n"
)


def test_key_is_the_same_in_other_processes() -> None:
    """Two interpreters with different PYTHONHASHSEED compute the same key as this one."""
    here = hash_block_tokens(hash_block_tokens(None, [1, 2, 3, 4], "salt"), [5, 6, 7, 8], "salt")
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _KEY_PROGRAM],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout.strip() == here.hex()


def test_key_depends_on_every_input() -> None:
    """Parent, salt (None vs empty vs other) and each token change the key."""
    parent = hash_block_tokens(None, [9], None)
    keys = {
        hash_block_tokens(None, [1, 2], None),
        hash_block_tokens(parent, [1, 2], None),
        hash_block_tokens(None, [1, 2], ""),
        hash_block_tokens(None, [1, 2], "a"),
        hash_block_tokens(None, [2, 1], None),
        hash_block_tokens(None, [1, 3], None),
    }
    assert len(keys) == 6
    assert len(hash_block_tokens(None, [1, 2], None)) == 16


def test_hash_collision_never_returns_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every key colliding, lookups still verify tokens, parent and salt: no false hit."""
    monkeypatch.setattr(cache_manager.prefix, "hash_block_tokens", lambda *args: b"\x00" * 16)
    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", [1, 2, 3, 4, 5]))  # block 0 keyed under the constant key
    assert hit_view(kv.get_computed_blocks(make_seq("b", [9, 9, 9, 9, 9]))) == ([], 0)
    assert hit_view(kv.get_computed_blocks(make_seq("c", [1, 2, 3, 4, 5], salt="x"))) == ([], 0)
    assert hit_view(kv.get_computed_blocks(make_seq("d", [1, 2, 3, 4, 9]))) == ([0], 4)
    # Block 1 of e collides with block 0's key too: registering it is refused, so it stays
    # keyless and e's second block can never be served from block 0.
    e = make_seq("e", [1, 2, 3, 4, 1, 2, 3, 4, 0])
    assert prefill(kv, e) == [0]
    assert hit_view(kv.get_computed_blocks(make_seq("f", [1, 2, 3, 4, 1, 2, 3, 4, 7]))) == ([0], 4)
    kv.check_invariants()


def test_prefix_block_keys_are_the_keys_the_cache_manager_hits() -> None:
    """prefix_block_keys(tokens) equals the keys a later lookup of the same prompt hits."""
    from cache_manager import prefix_block_keys

    kv = make_kv(num_blocks=8, block_size=4)
    prefill(kv, make_seq("a", range(13), salt="t1"))
    hit = kv.get_computed_blocks(make_seq("b", range(13), salt="t1"))
    assert list(hit.keys) == prefix_block_keys(list(range(12)), 4, "t1")
    assert len(prefix_block_keys(list(range(13)), 4, "t1")) == 3  # the partial block: no key
    assert prefix_block_keys(list(range(12)), 4, "t2") != prefix_block_keys(
        list(range(12)), 4, "t1"
    )
