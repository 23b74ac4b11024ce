"""Gemma 3 as the server builds it: the sliding layers' KV in blocks of their own
(``--sliding-layer-blocks auto``), sized for ``max_num_seqs`` windows, the global layers'
blocks in the rest of the budget; off where it cannot run."""

from __future__ import annotations

from typing import Any

import pytest

from cache_manager import KVCacheManager
from cache_manager.hybrid import HybridKVCacheManager, window_blocks_for
from model_runner.config import ModelConfig
from server.build import build_engine
from server.client import KVServeClient
from server.config import ServerConfig
from server.fake_tokenizer import ByteTokenizer
from server.lifecycle import KVServeServer
from tests.model_runner.test_gemma3 import NUM_LAYERS, WINDOW, _normalized, tiny_gemma3


@pytest.fixture()
def gemma(monkeypatch: pytest.MonkeyPatch) -> ModelConfig:
    from model_runner import loader

    hf = tiny_gemma3(seed=22)
    config = ModelConfig.from_hf_config(_normalized(hf), name="tiny")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}

    def load_tiny(path: object, dtype: object, **_: object) -> loader.LoadedModel:
        tokenizer: loader.Tokenizer = ByteTokenizer()  # type: ignore[assignment]
        return loader.LoadedModel(config, dict(state), tokenizer, "tiny", "tiny")

    monkeypatch.setattr(loader, "load_model", load_tiny)
    return config


def _server(**kw: Any) -> ServerConfig:
    values: dict[str, Any] = {
        "runner": "torch", "device": "cpu", "block_size": 4, "kv_memory": "1MiB",
        "kv_dtype": "float32", "max_num_seqs": 4, "max_model_len": 128,
        "max_num_batched_tokens": 64, "long_prefill_token_threshold": 32,
    }  # fmt: skip
    return ServerConfig(**(values | kw))


def test_the_sliding_layers_get_their_own_pool(gemma: ModelConfig) -> None:
    built = build_engine(_server())
    kv = built.scheduler.kv
    assert isinstance(kv, HybridKVCacheManager)
    num_window = window_blocks_for(4, 128, WINDOW, 4, 32)
    pool = built.runner.pool  # type: ignore[attr-defined]
    assert (pool.num_window_blocks, kv.window.num_blocks) == (num_window, num_window)
    assert pool.window_layers == (0, 1, 2, 3, 4)
    # 1 MiB: the sliding layers' pool first, the global layer's blocks in the rest.
    per_layer_block = 2 * gemma.num_kv_heads * gemma.head_dim * 4 * 4
    rest = (1 << 20) - num_window * 5 * per_layer_block
    assert kv.num_blocks == pool.num_blocks == rest // per_layer_block
    assert pool.num_bytes <= 1 << 20
    stats = built.engine.latest_stats.kv
    assert (stats.sliding_blocks_total, stats.block_bytes) == (num_window - 1, per_layer_block)
    assert NUM_LAYERS == 6


@pytest.mark.parametrize(
    "kw", [{"sliding_layer_blocks": "off"}, {"kv_strategy": "adaptive"}, {"sliding_window": 64}]
)
def test_one_table_where_it_cannot_run(gemma: ModelConfig, kw: dict[str, Any]) -> None:
    built = build_engine(_server(**kw))
    assert type(built.scheduler.kv) is KVCacheManager
    assert built.runner.pool.window_data is None  # type: ignore[attr-defined]


def test_the_slo_policy_calibrates_on_both_pools(gemma: ModelConfig) -> None:
    """The cost model's scripted steps run on the server's own kind of cache manager, so
    each seq carries its sliding layers' table (a plain one would fail every step)."""
    built = build_engine(
        _server(policy="slo", cost_model_prior="calibrate", max_num_seqs=16, kv_memory="4MiB")
    )
    assert isinstance(built.scheduler.kv, HybridKVCacheManager)
    assert built.engine.cost_model is not None


async def test_get_kv_cache_stats_reports_the_sliding_pool_over_grpc(gemma: ModelConfig) -> None:
    """A request generating well past the window over gRPC: GetKVCacheStats carries the
    sliding pool's size and the blocks it released (the proto has the fields the stats have),
    and at the end nothing of either pool is held."""
    built = build_engine(_server())
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    port = await server.start("127.0.0.1", 0)
    client = KVServeClient(f"127.0.0.1:{port}")
    try:
        await client.wait_ready()
        num_tokens = 0
        async for msg in client.generate([5, 6, 7], max_tokens=3 * WINDOW, ignore_eos=True):
            num_tokens += len(msg.token_ids)
        stats = await client.kv_cache_stats()
    finally:
        await client.close()
        await server.shutdown(grace_s=0.5)
    assert num_tokens == 3 * WINDOW
    num_window = window_blocks_for(4, 128, WINDOW, 4, 32)
    assert stats.sliding_blocks_total == num_window - 1
    # A 3-token prompt, 3 * WINDOW = 24 generated: the last step attends from position 25
    # back to 18 (blocks 4-6), so blocks 0-3 (positions 0-15) were released.
    assert stats.sliding_blocks_released_total == 4
    assert (stats.sliding_blocks_used, stats.num_blocks_used) == (0, 0)
