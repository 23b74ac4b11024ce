"""Tier 2 through a real engine: greedy outputs unchanged, restores, restarts, sharing, faults.

A tiny random-weight fp32 LLaMA (fp32 KV), 4-token blocks, a pool of about a third of the
multi-turn working set; every engine step checks the cache manager's invariants.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch

from kv_store import StoreError
from model_runner.kv_pool import KVPool
from model_runner.kv_transfer import PoolBlockIO
from server.kv_tier import KVTier
from tests.model_runner.oracle import make_runner, tiny_hf
from tests.server.tier_helpers import make_conversations, run_workload

NUM_CONVERSATIONS = 4
NUM_TURNS = 4
SMALL_POOL = 24  # blocks; the workload's working set is about 70
TURNS = range(NUM_TURNS)


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return tiny_hf("llama")


@pytest.fixture(scope="module")
def baseline(hf: torch.nn.Module) -> dict[tuple[str, int], list[int]]:
    """Greedy answers with tier 2 off, on the same small pool."""
    convs = make_conversations(NUM_CONVERSATIONS, NUM_TURNS)
    return run_workload(make_runner(hf, SMALL_POOL), convs, TURNS, SMALL_POOL, None).answers


def run_on(hf: torch.nn.Module, disk_dir: Path | str, turns: range = TURNS, **kw: Any) -> Any:
    convs = make_conversations(NUM_CONVERSATIONS, NUM_TURNS)
    if turns.start:  # later turns need the earlier answers: take them from a tier-off run
        run_workload(make_runner(hf, SMALL_POOL), convs, range(turns.start), SMALL_POOL, None)
    return run_workload(make_runner(hf, SMALL_POOL), convs, turns, SMALL_POOL, str(disk_dir), **kw)


def test_pool_blocks_spill_and_restore_bytes_exactly() -> None:
    """Block bytes read out of a pool and written into other blocks are the same KV, for
    every pool dtype (int8 with its scales)."""
    for dtype in (torch.float32, torch.float16, torch.int8):
        pool = KVPool(2, 2, 8, 8, 4, dtype)
        for layer in range(2):
            pool.write(layer, torch.randn(32, 4, 8), torch.arange(32))
        io = PoolBlockIO(pool)
        payloads = io.read_blocks([2, 5])
        assert [len(p) for p in payloads] == [io.block_bytes] * 2
        before = pool.data.clone()
        io.write_blocks([7, 0], payloads)
        assert torch.equal(pool.data[:, :, 7], before[:, :, 2])
        assert torch.equal(pool.data[:, :, 0], before[:, :, 5])
        assert torch.equal(pool.data[:, :, 1:7], before[:, :, 1:7])
        assert io.read_blocks([7, 0]) == payloads


def test_multiturn_greedy_outputs_identical_with_tier(
    hf: torch.nn.Module, baseline: dict[tuple[str, int], list[int]], tmp_path: Path
) -> None:
    """Tier on: the same greedy tokens as tier off, with restores from tier 2 that moved
    exactly one block of bytes each."""
    result = run_on(hf, tmp_path)
    assert result.answers == baseline
    kv = result.kv
    assert kv.tier2 is not None and kv.tier2.backend == "lmdb"
    assert kv.tier2_hit_blocks_total > 0 and kv.tier2_spill_blocks_total > 0
    block_bytes = 2 * 2 * 4 * 16 * 4 * 4  # K+V, 2 layers, 4 heads, 16 dims, 4 slots, fp32
    assert kv.tier2.restore_blocks_total == kv.tier2_hit_blocks_total
    assert kv.tier2.restore_bytes_total == kv.tier2_hit_blocks_total * block_bytes
    assert kv.tier2.errors_total == {}
    assert kv.tier2.num_blocks == kv.tier2.spill_blocks_total > 0


def test_restart_restores_instead_of_recomputing(
    hf: torch.nn.Module, baseline: dict[tuple[str, int], list[int]], tmp_path: Path
) -> None:
    """Half the turns, a new engine (empty pool) on the same store, the rest: the first
    returning turns are tier-2 hits and the tokens are those of an uninterrupted run."""
    convs = make_conversations(NUM_CONVERSATIONS, NUM_TURNS)
    first = run_workload(make_runner(hf, SMALL_POOL), convs, range(2), SMALL_POOL, str(tmp_path))
    second = run_workload(
        make_runner(hf, SMALL_POOL), convs, range(2, NUM_TURNS), SMALL_POOL, str(tmp_path)
    )
    assert {**first.answers, **second.answers} == baseline
    assert second.kv.tier2_hit_blocks_total > 0
    # Turn 2 of every conversation found more than its first block in tier 2.
    assert all(second.num_cached_tokens[(c.name, 2)] > 4 for c in convs)


_REPLICA = textwrap.dedent(
    """
    import json, sys
    from tests.model_runner.oracle import make_runner, tiny_hf
    from tests.server.tier_helpers import make_conversations, run_workload
    convs = make_conversations(2, 1)
    result = run_workload(make_runner(tiny_hf("llama"), 24), convs, range(1), 24, sys.argv[1])
    print(json.dumps({f"{c}-{t}": a for (c, t), a in result.answers.items()}))
    """
)


def test_two_processes_share_one_store(hf: torch.nn.Module, tmp_path: Path) -> None:
    """A prefix prefilled by another process (a replica on the same host) is restored from
    the shared store, not recomputed, with the same greedy tokens."""
    out = subprocess.run(
        [sys.executable, "-c", _REPLICA, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    import json

    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    convs = make_conversations(2, 1)
    ours = run_workload(make_runner(hf, SMALL_POOL), convs, range(1), SMALL_POOL, str(tmp_path))
    assert {f"{c}-{t}": a for (c, t), a in ours.answers.items()} == theirs
    prompt_blocks = (len(convs[0].prompt(0)) - 1) // 4
    assert ours.kv.tier2_hit_blocks_total == 2 * prompt_blocks
    assert ours.kv.tier2 is not None and ours.kv.tier2.spill_blocks_total == 0  # all known


class _FullDisk:
    """A store whose writes fail as on a full disk (ENOSPC); reads go through."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.kind = store.kind

    def put_many(self, items: Any) -> int:
        raise StoreError("disk_full", "[Errno 28] No space left on device")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_fault_disk_full(
    hf: torch.nn.Module,
    baseline: dict[tuple[str, int], list[int]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every write failing for a full disk: same tokens, no block leaked, nothing stored,
    one log line, the failures counted. (Spills still queued in memory may serve hits.)"""
    original = KVTier.__init__

    def full_disk_init(self: KVTier, kv: Any, store: Any, *args: Any, **kw: Any) -> None:
        original(self, kv, _FullDisk(store), *args, **kw)

    monkeypatch.setattr(KVTier, "__init__", full_disk_init)
    with caplog.at_level(logging.WARNING, logger="server.kv_tier"):
        result = run_on(hf, tmp_path)
    assert result.answers == baseline
    assert result.kv.tier2.errors_total["disk_full"] > 1
    assert result.kv.tier2.num_blocks == 0 and result.kv.tier2.spill_blocks_total == 0
    assert len([r for r in caplog.records if "disk_full" in r.getMessage()]) == 1


def test_fault_read_only_directory(
    hf: torch.nn.Module,
    baseline: dict[tuple[str, int], list[int]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store directory that cannot be written (a read-only file system): the tier is off,
    counted and logged once, and the server serves the same tokens."""
    with caplog.at_level(logging.WARNING, logger="server.kv_tier"):
        result = run_on(hf, "/proc/kvserve-tier-test")
    assert result.answers == baseline
    assert result.kv.tier2.backend == "off"
    assert result.kv.tier2.errors_total == {"open": 1}
    assert len(caplog.records) == 1


def test_fault_corrupted_entries(
    hf: torch.nn.Module, baseline: dict[tuple[str, int], list[int]], tmp_path: Path
) -> None:
    """Every stored entry with a flipped byte: each is a miss counted as a checksum error
    (and dropped from the store), and the tokens are those of tier off."""
    run_on(hf, tmp_path)
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=4)
    entries = env.open_db(b"entries")
    with env.begin(write=True, db=entries) as txn:
        items = list(txn.cursor())
        for key, value in items:
            bad = bytearray(value)
            bad[len(bad) // 2] ^= 0x01
            txn.put(key, bytes(bad))
    env.close()
    assert items
    result = run_on(hf, tmp_path, turns=range(NUM_TURNS - 1, NUM_TURNS))
    last = {k: v for k, v in baseline.items() if k[1] == NUM_TURNS - 1}
    assert result.answers == last
    assert result.kv.tier2.errors_total["checksum"] >= NUM_CONVERSATIONS
    assert result.kv.tier2_hit_blocks_total == 0


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from kv_store import open_store
    store = open_store("lmdb", sys.argv[1], capacity_bytes=1 << 30)
    txn = store.env.begin(write=True)
    txn.put(b"x", b"y", db=store._entries)
    print("holding", flush=True)
    time.sleep(60)
    """
)


def test_fault_store_held_by_a_killed_process(
    hf: torch.nn.Module, baseline: dict[tuple[str, int], list[int]], tmp_path: Path
) -> None:
    """A replica killed while holding the store's write lock: the next server spills and
    restores as usual, with the same tokens."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / "lmdb")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    result = run_on(hf, tmp_path)
    assert result.answers == baseline
    assert result.kv.tier2_hit_blocks_total > 0
    assert result.kv.tier2.errors_total == {}


def test_salted_blocks_are_never_restored_for_another_salt(
    hf: torch.nn.Module, tmp_path: Path
) -> None:
    """The same prompt under another salt finds nothing in tier 2; under its own, it does."""
    convs = make_conversations(1, 1)
    convs[0].salt = "tenant-a"
    run_workload(make_runner(hf, SMALL_POOL), convs, range(1), SMALL_POOL, str(tmp_path))
    other = make_conversations(1, 1)
    other[0].salt = "tenant-b"
    miss = run_workload(make_runner(hf, SMALL_POOL), other, range(1), SMALL_POOL, str(tmp_path))
    assert miss.kv.tier2_hit_blocks_total == 0
    same = make_conversations(1, 1)
    same[0].salt = "tenant-a"
    hit = run_workload(make_runner(hf, SMALL_POOL), same, range(1), SMALL_POOL, str(tmp_path))
    assert hit.kv.tier2_hit_blocks_total == (len(same[0].prompt(0)) - 1) // 4
    assert hit.answers == miss.answers  # the same tokens (one model), from restored KV
