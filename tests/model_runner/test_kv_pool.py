"""KVPool: layout, slot writes, block gathers, copy-on-write and sizing."""

from __future__ import annotations

import sys

import pytest
import torch

from cache_manager.sizing import block_bytes
from model_runner.config import ModelConfig
from model_runner.kv_pool import KVPool, kv_block_bytes, num_blocks_for_memory
from tests.model_runner.oracle import DEVICE

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


def make_pool(num_blocks: int = 6, block_size: int = 4) -> KVPool:
    return KVPool.from_config(CONFIG, num_blocks, block_size, torch.float32, DEVICE)


def test_layout_and_size_match_the_cache_manager_sizing() -> None:
    """One zeroed tensor [layers, 2*kv_heads, blocks, block_size, head_dim] whose bytes are
    num_blocks x sizing.block_bytes."""
    pool = make_pool(num_blocks=6, block_size=4)
    assert tuple(pool.data.shape) == (3, 4, 6, 4, 8)
    assert not pool.data.any()
    assert pool.block_bytes == block_bytes(CONFIG.kv_shape("float32"), 4) == 2 * 3 * 2 * 8 * 4 * 4
    assert pool.num_bytes == 6 * pool.block_bytes
    assert kv_block_bytes(CONFIG, 4, torch.float16) == pool.block_bytes // 2


def test_write_puts_each_token_at_its_slot() -> None:
    """Token t of a write lands in block slot // block_size at offset slot % block_size, K heads
    then V heads, in the given layer only."""
    pool = make_pool()
    kv = torch.arange(3 * 4 * 8, dtype=torch.float32, device=DEVICE).view(3, 4, 8)
    slots = torch.tensor([9, 2, 23], device=DEVICE)  # block 2 off 1, block 0 off 2, block 5 off 3
    pool.write(1, kv, slots)
    expected = torch.zeros_like(pool.data)
    for t, (block, offset) in enumerate([(2, 1), (0, 2), (5, 3)]):
        expected[1, :, block, offset] = kv[t]
    assert torch.equal(pool.data, expected)


def test_gather_returns_blocks_in_table_order() -> None:
    """gather(layer, [4, 1]) is block 4 then block 1, per head: [2*kvh, 2*block_size, dim]."""
    pool = make_pool()
    pool.data.copy_(torch.randn(pool.data.shape, device=DEVICE))
    out = pool.gather(2, torch.tensor([4, 1], device=DEVICE))
    assert tuple(out.shape) == (4, 8, 8)
    assert torch.equal(out[:, :4], pool.data[2, :, 4])
    assert torch.equal(out[:, 4:], pool.data[2, :, 1])


def test_copy_blocks_copies_every_layer_and_nothing_else() -> None:
    """Copy-on-write (src, dst) pairs copy whole blocks across all layers, K and V."""
    pool = make_pool()
    pool.data.copy_(torch.randn(pool.data.shape, device=DEVICE))
    before = pool.data.clone()
    pool.copy_blocks([(1, 4), (3, 0)])
    assert torch.equal(pool.data[:, :, 4], before[:, :, 1])
    assert torch.equal(pool.data[:, :, 0], before[:, :, 3])
    for b in (1, 2, 3, 5):
        assert torch.equal(pool.data[:, :, b], before[:, :, b])


def test_num_blocks_for_memory() -> None:
    """A budget holds floor(budget / block bytes) blocks; less than one block raises."""
    per_block = kv_block_bytes(CONFIG, 16, torch.float32)
    assert num_blocks_for_memory(CONFIG, 16, torch.float32, 10 * per_block + per_block - 1) == 10
    assert num_blocks_for_memory(CONFIG, 16, torch.bfloat16, 10 * per_block) == 20
    with pytest.raises(ValueError, match=f"needs {per_block} bytes"):
        num_blocks_for_memory(CONFIG, 16, torch.float32, per_block - 1)


def test_invalid_sizes_raise() -> None:
    """Zero blocks or a zero block size is refused with the offending number."""
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        make_pool(num_blocks=0)
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        make_pool(block_size=0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_cpu_pool_becomes_resident_only_where_written() -> None:
    """A 240 MiB fp16 pool adds almost nothing to the process's resident memory until written;
    writing one token into every layer and head of one block makes a few pages resident, not
    the budget and not a 2 MiB huge page per (layer, K/V head) slab (all 240 MiB)."""

    def rss_mib() -> float:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024

    config = ModelConfig(
        architecture="llama",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=64,
        num_layers=30,
        num_heads=2,
        num_kv_heads=2,
        head_dim=64,
    )
    before = rss_mib()
    pool = KVPool.from_config(config, 1024, 16, torch.float16, "cpu")
    assert pool.num_bytes == 240 * 2**20
    assert rss_mib() - before < 8
    for layer in range(config.num_layers):
        pool.write(layer, torch.ones(1, 4, 64, dtype=torch.float16), torch.tensor([5 * 16]))
    assert rss_mib() - before < 16
    assert pool.data[:, :, 5, 0].eq(1).all() and pool.data.sum().item() == 30 * 4 * 64


def test_sliding_layers_in_a_pool_of_their_own() -> None:
    """Layers 0 and 2 of 3 in a pool of 3 blocks whose ids follow the 4 of the others: a
    write, a gather, a copy and a scrub by the step's ids each land in the layer's pool."""
    pool = KVPool(3, 1, 2, 4, 2, torch.float32, window_layers=(0, 2), num_window_blocks=3)
    assert pool.data.shape[:3] == (1, 2, 4) and pool.window_data is not None
    assert pool.window_data.shape[:3] == (2, 2, 3)
    kv = torch.arange(8.0).view(2, 2, 2)  # 2 tokens, K and V of one head, head_dim 2
    slots = torch.tensor([5 * 2, 5 * 2 + 1])  # block 5 = the sliding pool's block 1
    pool.write(0, kv, slots)
    assert torch.equal(pool.window_data[0, :, 1], kv.transpose(0, 1))
    assert torch.equal(pool.gather(0, torch.tensor([5])), kv.transpose(0, 1))
    pool.write(1, kv, torch.tensor([2, 3]))  # the global layer: its own block 1
    assert torch.equal(pool.data[0, :, 1], kv.transpose(0, 1))
    pool.copy_blocks([(5, 6), (1, 3)])
    assert torch.equal(pool.window_data[0, :, 2], kv.transpose(0, 1))
    assert torch.equal(pool.data[0, :, 3], kv.transpose(0, 1))
    pool.window_data[1, 0, 2, 0, 0] = float("nan")
    assert pool.scrub_blocks([1, 5, 6]) == [6]
    assert not pool.window_data[:, :, 2].any() and pool.window_data[0, :, 1].any()
    assert pool.num_bytes == (4 * 1 + 3 * 2) * 2 * 2 * 2 * 4
