"""KV sizing against values worked out by hand for four real model shapes, fp32 and fp16."""

from __future__ import annotations

import pytest

from cache_manager import (
    ModelShape,
    block_bytes,
    kv_memory_bytes,
    kv_memory_bytes_paged,
    num_blocks_for_budget,
)

GIB = 1024**3  # 1,073,741,824

# KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * dtype_bytes.
# fp32 is always twice fp16.
SHAPES = [
    # LLaMA-7B (MHA): 2 * 32 * 32 * 128 = 262,144 elements -> fp16 524,288 B, fp32 1,048,576 B
    ("llama-7b", 32, 32, 128, 2, 524_288),
    ("llama-7b", 32, 32, 128, 4, 1_048_576),
    # LLaMA-3-8B (GQA, 8 KV heads): 2 * 32 * 8 * 128 = 65,536 -> fp16 131,072, fp32 262,144
    ("llama-3-8b", 32, 8, 128, 2, 131_072),
    ("llama-3-8b", 32, 8, 128, 4, 262_144),
    # Mistral-7B (GQA, 8 KV heads): same cache shape as LLaMA-3-8B
    ("mistral-7b", 32, 8, 128, 2, 131_072),
    ("mistral-7b", 32, 8, 128, 4, 262_144),
    # Qwen2.5-7B (GQA, 4 KV heads, 28 layers): 2 * 28 * 4 * 128 = 28,672 -> 57,344 / 114,688
    ("qwen2.5-7b", 28, 4, 128, 2, 57_344),
    ("qwen2.5-7b", 28, 4, 128, 4, 114_688),
]


@pytest.mark.parametrize(("name", "layers", "kv_heads", "head_dim", "dtype", "per_token"), SHAPES)
def test_bytes_per_token(
    name: str, layers: int, kv_heads: int, head_dim: int, dtype: int, per_token: int
) -> None:
    """kv_bytes_per_token and kv_memory_bytes of one token equal the hand-computed value."""
    shape = ModelShape(layers, kv_heads, head_dim, dtype, name)
    assert shape.kv_bytes_per_token == per_token
    assert kv_memory_bytes(shape, 1) == per_token


# block_bytes at block_size 16 = 16 * per-token bytes; blocks in 16 GiB = floor(16 GiB / that).
BLOCKS_16GIB = [
    # LLaMA-7B fp16: 16 * 524,288 = 8,388,608 (8 MiB); 16 GiB / 8 MiB = 2,048
    ("llama-7b", 32, 32, 2, 8_388_608, 2_048),
    # LLaMA-7B fp32: 16 MiB per block -> 1,024
    ("llama-7b", 32, 32, 4, 16_777_216, 1_024),
    # LLaMA-3-8B fp16: 16 * 131,072 = 2,097,152 (2 MiB) -> 8,192
    ("llama-3-8b", 32, 8, 2, 2_097_152, 8_192),
    # LLaMA-3-8B fp32: 4 MiB -> 4,096
    ("llama-3-8b", 32, 8, 4, 4_194_304, 4_096),
    # Mistral-7B: as LLaMA-3-8B
    ("mistral-7b", 32, 8, 2, 2_097_152, 8_192),
    ("mistral-7b", 32, 8, 4, 4_194_304, 4_096),
    # Qwen2.5-7B fp16: 16 * 57,344 = 917,504; 917,504 * 18,724 = 17,179,344,896 <= 16 GiB
    # (remainder 524,288 < 917,504) -> 18,724
    ("qwen2.5-7b", 28, 4, 2, 917_504, 18_724),
    # Qwen2.5-7B fp32: 1,835,008 * 9,362 = 17,179,344,896 (remainder 524,288) -> 9,362
    ("qwen2.5-7b", 28, 4, 4, 1_835_008, 9_362),
]


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "dtype", "per_block", "blocks"), BLOCKS_16GIB
)
def test_blocks_in_a_16_gib_budget(
    name: str, layers: int, kv_heads: int, dtype: int, per_block: int, blocks: int
) -> None:
    """block_bytes(16 tokens) and num_blocks_for_budget(16 GiB) equal the hand-computed values."""
    shape = ModelShape(layers, kv_heads, 128, dtype, name)
    assert block_bytes(shape, 16) == per_block
    assert num_blocks_for_budget(shape, 16, 16 * GIB) == blocks


# KV of a batch of 8 sequences of 4,096 tokens = per-token bytes * 32,768.
BATCH_8_CTX_4096 = [
    # LLaMA-7B fp16: 524,288 * 32,768 = 17,179,869,184 (16 GiB); fp32 32 GiB
    ("llama-7b", 32, 32, 2, 16 * GIB),
    ("llama-7b", 32, 32, 4, 32 * GIB),
    # LLaMA-3-8B fp16: 131,072 * 32,768 = 4 GiB; fp32 8 GiB
    ("llama-3-8b", 32, 8, 2, 4 * GIB),
    ("llama-3-8b", 32, 8, 4, 8 * GIB),
    ("mistral-7b", 32, 8, 2, 4 * GIB),
    ("mistral-7b", 32, 8, 4, 8 * GIB),
    # Qwen2.5-7B fp16: 57,344 * 32,768 = 1,879,048,192 (1.75 GiB); fp32 3,758,096,384
    ("qwen2.5-7b", 28, 4, 2, 1_879_048_192),
    ("qwen2.5-7b", 28, 4, 4, 3_758_096_384),
]


@pytest.mark.parametrize(("name", "layers", "kv_heads", "dtype", "expected"), BATCH_8_CTX_4096)
def test_kv_memory_of_a_batch(
    name: str, layers: int, kv_heads: int, dtype: int, expected: int
) -> None:
    """kv_memory_bytes(shape, 4096, 8) equals the hand-computed value."""
    shape = ModelShape(layers, kv_heads, 128, dtype, name)
    assert kv_memory_bytes(shape, 4096, 8) == expected


def test_paged_memory_rounds_each_sequence_up_to_whole_blocks() -> None:
    """1,000 tokens in blocks of 16 occupy 63 blocks = 1,008 slots per sequence."""
    llama = ModelShape(32, 32, 128, 2, "llama-7b")
    # 524,288 B/token * 1,008 slots * 2 sequences = 1,056,964,608
    assert kv_memory_bytes_paged(llama, 1000, 2, 16) == 1_056_964_608
    # 524,288 * 1,000 * 2 = 1,048,576,000 without rounding
    assert kv_memory_bytes(llama, 1000, 2) == 1_048_576_000


def test_sizing_errors_carry_the_numbers() -> None:
    """A budget below one block, and invalid shapes, raise ValueError with the numbers."""
    qwen = ModelShape(28, 4, 128, 2, "qwen2.5-7b")
    with pytest.raises(ValueError, match=r"917503 bytes holds no block.*needs 917504 bytes"):
        num_blocks_for_budget(qwen, 16, 917_503)
    assert num_blocks_for_budget(qwen, 16, 917_504) == 1
    with pytest.raises(ValueError, match="num_kv_heads must be >= 1, got 0"):
        ModelShape(28, 0, 128, 2)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        block_bytes(qwen, 0)
    with pytest.raises(ValueError, match="-1"):
        kv_memory_bytes(qwen, -1)


def test_int8_cache_counts_its_scales() -> None:
    """int8 KV with a 4-byte scale per token per KV head: LLaMA-3-8B stores
    2 * 32 * 8 * (128 * 1 + 4) = 67,584 B per token, so 16 GiB holds 15,887 blocks of 16
    (fp16: 8,192, fp32: 4,096)."""
    shape = ModelShape(32, 8, 128, 1, "llama-3-8b", scale_bytes=4)
    assert shape.kv_bytes_per_token == 67_584
    # 16 * 67,584 = 1,081,344 B per block; 1,081,344 * 15,887 = 17,179,312,128 <= 16 GiB
    # (remainder 557,056 < 1,081,344)
    assert block_bytes(shape, 16) == 1_081_344
    assert num_blocks_for_budget(shape, 16, 16 * GIB) == 15_887
    with pytest.raises(ValueError, match="scale_bytes must be >= 0, got -1"):
        ModelShape(32, 8, 128, 1, scale_bytes=-1)
