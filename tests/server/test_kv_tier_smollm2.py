"""Tier 2 on the embedded model's defaults (SmolLM2-135M as `kvserve serve` loads it)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from server.build import build_engine
from server.config import ServerConfig
from tests.server.tier_helpers import InvariantSink, make_conversations, run_turns

pytestmark = pytest.mark.slow

VOCAB = 49152


def run(disk_dir: Path | None) -> tuple[dict[tuple[str, int], list[int]], int]:
    cfg = ServerConfig(
        num_blocks=8, block_size=16, threads=2, metrics=False,
        kv_disk_dir=None if disk_dir is None else str(disk_dir),
    )  # fmt: skip
    built = build_engine(cfg)
    convs = make_conversations(3, 3, vocab=VOCAB, first_len=48, turn_len=16)
    built.engine.sink = InvariantSink(built.scheduler.kv)  # invariants after every step
    built.engine.start()
    try:
        result = asyncio.run(run_turns(built.engine, convs, range(3), max_tokens=5))
    finally:
        built.engine.stop(60)
    built.scheduler.kv.check_invariants()
    assert built.scheduler.kv.make_stats().num_blocks_used == 0
    return result.answers, result.kv.tier2_hit_blocks_total


def test_greedy_tokens_identical_with_tier_on_embedded_defaults(tmp_path: Path) -> None:
    """The default weights and KV dtype, a pool of a third of the working set: tier on gives
    the tokens of tier off, with restores from tier 2."""
    off, _ = run(None)
    on, num_restored = run(tmp_path)
    assert on == off
    assert num_restored > 0
