"""Tier 2 from the command line's config to GetKVCacheStats (fake runner, real gRPC)."""

from __future__ import annotations

from pathlib import Path

from server.build import build_engine
from server.client import KVServeClient
from server.config import ServerConfig
from server.kv_tier import KVTier, NoTier
from server.lifecycle import KVServeServer
from tests.server.helpers import collect


async def test_kv_disk_dir_turns_tier_2_on_and_get_kv_cache_stats_shows_it(
    tmp_path: Path,
) -> None:
    """--kv-disk-dir builds the tier; a prompt evicted from a tiny pool comes back from
    tier 2, and GetKVCacheStats reports hits and the store's figures."""
    cfg = ServerConfig(
        runner="fake", num_blocks=8, block_size=4, kv_disk_dir=str(tmp_path), metrics=False
    )
    built = build_engine(cfg)
    assert isinstance(built.engine.tier, KVTier) and built.scheduler.kv.has_tier
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    port = await server.start("127.0.0.1", 0)
    client = KVServeClient(f"127.0.0.1:{port}")
    try:
        await client.wait_ready()
        prompt = "abcdefghijklmnopq"  # 17 bytes: 4 full blocks before the last token
        await collect(client.generate(prompt, request_id="a", max_tokens=2))
        await collect(client.generate("zyxwvutsrqponmlkjihgf", request_id="b", max_tokens=2))
        msgs = await collect(client.generate(prompt, request_id="c", max_tokens=2))
        stats = await client.kv_cache_stats()
    finally:
        await client.close()
        await server.shutdown(grace_s=0.5)
    assert msgs[-1].usage.cached_prompt_tokens == 16
    # "b" evicted a's two tail blocks (tails go first): those come back from tier 2, the
    # two head blocks are still tier-1 hits.
    assert stats.tier2_hit_blocks_total == 2 and stats.tier2_hit_tokens_total == 8
    assert stats.tier2.backend == "lmdb" and stats.tier2.num_blocks == 4 + 5
    assert stats.tier2.restore_blocks_total == 2 and dict(stats.tier2.errors_total) == {}


def test_tier_2_is_off_by_default() -> None:
    """Without --kv-disk-dir the engine's tier is the null one: nothing spills, the stats
    carry no store."""
    built = build_engine(ServerConfig(runner="fake", num_blocks=8, metrics=False))
    assert isinstance(built.engine.tier, NoTier) and not built.scheduler.kv.has_tier
    assert built.engine.latest_stats.kv.tier2 is None


def test_prefetch_is_skipped_over_the_staged_bytes_bound(tmp_path: Path) -> None:
    """With the staged bytes at their bound a new request is not held for a prefetch (it
    recomputes), and the skip is counted as a backlog."""
    from cache_manager import KVCacheConfig, KVCacheManager
    from kv_store import model_fingerprint, open_store
    from model_runner.base import NullBlockIO
    from scheduler import Request, SamplingParams
    from server.kv_tier import KVTier

    kv = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=4, kv_tier=True))
    store = open_store("lmdb", str(tmp_path), capacity_bytes=1 << 20)
    fp = model_fingerprint("w", "float", "float32", 4, "t")
    request = Request("r", list(range(10, 30)), SamplingParams(max_tokens=1))
    open_tier = KVTier(kv, store, NullBlockIO(), fp, capacity_bytes=1 << 20)
    assert open_tier.prefetch(request)  # tier 1 is empty: held for the read
    open_tier.close()
    full = KVTier(
        kv, open_store("lmdb", str(tmp_path), 1 << 20), NullBlockIO(), fp,
        capacity_bytes=1 << 20, max_pending_bytes=0,
    )  # fmt: skip
    assert not full.prefetch(request)
    assert full.stats().errors_total == {"backlog": 1}
    full.close()


def test_a_held_request_is_released_once_read_or_aborted(tmp_path: Path) -> None:
    """``hold`` keeps a request whose prefix tier 1 lacks (and wakes the engine when its read
    is done): ``released`` then returns its item once; an aborted one is ``release``d at
    once; ``release_all`` empties the rest."""
    import threading

    from cache_manager import KVCacheConfig, KVCacheManager
    from kv_store import model_fingerprint, open_store
    from model_runner.base import NullBlockIO
    from scheduler import Request, SamplingParams

    kv = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=4, kv_tier=True))
    store = open_store("lmdb", str(tmp_path), capacity_bytes=1 << 20)
    fp = model_fingerprint("w", "float", "float32", 4, "t")
    tier: KVTier[str] = KVTier(kv, store, NullBlockIO(), fp, capacity_bytes=1 << 20)
    woken = threading.Event()
    tier.attach(woken.set, lambda _: True)
    try:
        sampling = SamplingParams(max_tokens=1)
        assert tier.hold(Request("a", list(range(10, 30)), sampling), "item-a")
        assert woken.wait(10) and tier.released() == ["item-a"]
        assert tier.released() == []
        assert tier.hold(Request("b", list(range(40, 60)), sampling), "item-b")
        assert tier.hold(Request("c", list(range(70, 90)), sampling), "item-c")
        assert tier.release("b") == "item-b" and tier.release("b") is None
        assert tier.release_all() == ["item-c"]
        assert not tier.hold(Request("d", [1, 2], sampling), "item-d")  # no full block
    finally:
        tier.shutdown()
