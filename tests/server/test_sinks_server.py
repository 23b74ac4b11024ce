"""A server started with --attention-sinks generates past the context over gRPC; without
sinks the same request is INVALID_ARGUMENT. The engine is built from flags (build_engine),
on the fake runner."""

from __future__ import annotations

import grpc
import pytest

from server.build import build_engine
from server.client import KVServeClient
from server.config import ServerConfig
from server.lifecycle import KVServeServer
from server.rpc import generation_pb2 as pb
from tests.server.helpers import RecordingSink


async def _generate(cfg: ServerConfig, max_tokens: int) -> tuple[int, int, int, pb.KVCacheStats]:
    """(output tokens, most KV blocks held after any step, blocks held at the end, and
    GetKVCacheStats then)."""
    sink = RecordingSink()
    built = build_engine(cfg, sink=sink)
    server = KVServeServer(built.engine, built.tokenizer, built.model, sink=sink)
    port = await server.start("127.0.0.1", 0)
    client = KVServeClient(f"127.0.0.1:{port}")
    try:
        await client.wait_ready()
        num_tokens = 0
        async for msg in client.generate("hello", max_tokens=max_tokens, ignore_eos=True):
            num_tokens += len(msg.token_ids)
        with sink.lock:
            used = [step.stats.kv.num_blocks_used for step in sink.steps]
        return num_tokens, max(used), used[-1], await client.kv_cache_stats()
    finally:
        await client.close()
        await server.shutdown(grace_s=0.5)


async def test_sinks_generate_past_the_context_over_grpc() -> None:
    """Context 64, sinks 4 + window 32, blocks of 4: a 6-token prompt generates 200 tokens
    (3x the context) holding at most 1 + 8 + 1 blocks; without sinks it is refused."""
    sinks = ServerConfig(
        runner="fake", max_model_len=64, block_size=4, sliding_window=32, attention_sinks=4
    )
    num_tokens, peak, left, _ = await _generate(sinks, 200)
    assert num_tokens == 200
    assert peak == 1 + 8 + 1 and left == 0  # S + W + one block, reached
    window_only = ServerConfig(runner="fake", max_model_len=64, block_size=4, sliding_window=32)
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await _generate(window_only, 200)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "beyond the model's context of 64 tokens" in (exc.value.details() or "")


async def test_kv_cache_stats_report_the_strategy_and_what_it_dropped() -> None:
    """--kv-strategy disabled: GetKVCacheStats names it and counts the KV it dropped: after
    each of the first 4 tokens the whole sequence (prompt "hello" + BOS = 6 tokens, then 7,
    8, 9) is dropped to be recomputed; the 5th token ends the request."""
    cfg = ServerConfig(runner="fake", max_model_len=64, block_size=4, kv_strategy="disabled")
    num_tokens, _, left, stats = await _generate(cfg, 5)
    assert (num_tokens, left) == (5, 0)
    assert stats.kv_strategy == "disabled"
    assert stats.strategy_dropped_tokens_total == 6 + 7 + 8 + 9
    assert stats.strategy_windowed_tokens_total == 0
