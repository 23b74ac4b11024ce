"""``--kv-dtype``: the flag reaches the runner's pool, the KV cache sizing and its stats."""

from __future__ import annotations

import argparse

import pytest

from server.build import build_engine
from server.config import ServerConfig, add_serve_arguments, build_config
from server.fake_tokenizer import ByteTokenizer


def test_flag_parses_and_defaults_to_auto() -> None:
    """--kv-dtype takes auto/float32/float16/bfloat16/int8 (default auto); others are refused."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert build_config(parser.parse_args([]), environ={}).kv_dtype == "auto"
    args = parser.parse_args(["--kv-dtype", "int8"])
    assert build_config(args, environ={}).kv_dtype == "int8"
    assert build_config(parser.parse_args([]), {"KVSERVE_KV_DTYPE": "float32"}).kv_dtype == (
        "float32"
    )
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        ServerConfig(kv_dtype="int4")


@pytest.mark.parametrize(
    ("kv_dtype", "reported", "block_bytes"),
    # tiny llama-gqa: 2 layers, 2 KV heads, head_dim 16, 4-token blocks:
    # 2 * 2 * 2 * 4 * (16 * dtype bytes + scale bytes)
    [("auto", "float16", 1024), ("float32", "float32", 2048), ("int8", "int8", 640)],
)
def test_kv_dtype_sizes_the_served_cache(
    monkeypatch: pytest.MonkeyPatch, kv_dtype: str, reported: str, block_bytes: int
) -> None:
    """build_engine passes --kv-dtype to the torch runner: a 64 KiB budget holds
    65536 // block bytes blocks, and ServedModel and KVCacheStats report that many bytes."""
    import torch

    from model_runner import loader
    from tests.model_runner.oracle import our_config, tiny_hf

    hf = tiny_hf("llama-gqa")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}

    def load_tiny(path: object, dtype: object, **_: object) -> loader.LoadedModel:
        tokenizer: loader.Tokenizer = ByteTokenizer()  # type: ignore[assignment]
        return loader.LoadedModel(our_config(hf), dict(state), tokenizer, "tiny", "tiny")

    monkeypatch.setattr(loader, "load_model", load_tiny)
    cfg = ServerConfig(
        runner="torch", device="cpu", block_size=4, kv_memory="64KiB", kv_dtype=kv_dtype
    )
    built = build_engine(cfg)
    num_blocks = 65536 // block_bytes
    assert (built.model.kv_dtype, built.model.dtype) == (reported, "float32")
    assert built.model.num_blocks == num_blocks
    assert built.model.kv_memory_bytes == num_blocks * block_bytes
    stats = built.engine.latest_stats.kv
    assert (stats.block_bytes, stats.total_memory_bytes) == (block_bytes, num_blocks * block_bytes)
    pool = built.runner.pool  # type: ignore[attr-defined]
    assert pool.num_bytes == num_blocks * block_bytes
    assert pool.dtype == getattr(torch, reported)
