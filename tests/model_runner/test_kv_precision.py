"""KV cache precision: float16 and int8 pools against a float32 one (bytes, round trips,
attention within stated tolerances, greedy tokens of a tiny model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from cache_manager.sizing import block_bytes
from model_runner.attention_backends.base import AttentionSpec
from model_runner.attention_backends.torch_backend import TorchAttention
from model_runner.config import RunnerOptions
from model_runner.device import resolve_kv_dtype
from model_runner.kv_pool import KVPool, num_blocks_for_memory
from model_runner.runner import TorchRunner
from model_runner.step import StepRows
from scheduler.output import ScheduledSeq
from tests.model_runner.oracle import DEVICE, make_runner, plan, random_ids, seq, tiny_hf
from tests.model_runner.test_kv_pool import CONFIG

KV_DTYPES = {n: resolve_kv_dtype(n, torch.float32, DEVICE) for n in ("float32", "float16", "int8")}
# Attention output error, max |out - out_fp32| / max |out_fp32|, over every row of a step.
# fp16 rounds K and V to 11 significant bits (relative 2^-11 = 4.9e-4 per element); int8 to
# 1/254 of each (token, head) vector's absmax. Measured on the steps below: fp16 <= 1.0e-3,
# int8 <= 1.0e-2.
TOLERANCE = {"float16": 2e-3, "int8": 2e-2}


def make_pool(kv_dtype: str, num_blocks: int = 6, block_size: int = 4) -> KVPool:
    return KVPool.from_config(
        CONFIG, num_blocks, block_size, KV_DTYPES[kv_dtype], DEVICE, torch.float32
    )


# ---------------------------------------------------------------------------- bytes


@pytest.mark.parametrize(
    ("kv_dtype", "per_block"),
    # 2 (K, V) * 3 layers * 2 kv heads * 4 tokens * (8 dims * bytes + scale bytes)
    [("float32", 2 * 3 * 2 * 4 * 8 * 4), ("float16", 2 * 3 * 2 * 4 * 8 * 2),
     ("int8", 2 * 3 * 2 * 4 * (8 * 1 + 4))],
)  # fmt: skip
def test_pool_bytes_follow_the_kv_dtype(kv_dtype: str, per_block: int) -> None:
    """A pool's bytes (KV plus int8 scales) equal the cache manager's sizing for its dtype."""
    pool = make_pool(kv_dtype, num_blocks=6, block_size=4)
    assert pool.block_bytes == block_bytes(CONFIG.kv_shape(kv_dtype), 4) == per_block
    assert pool.num_bytes == 6 * per_block


def test_same_budget_holds_2x_blocks_at_fp16_and_3_76x_at_int8() -> None:
    """A budget of 100 fp32 blocks holds 200 fp16 blocks and 266 int8 blocks (head_dim 8:
    int8 + a 4-byte scale is 12 bytes per head per token against fp32's 32)."""
    budget = 100 * block_bytes(CONFIG.kv_shape("float32"), 16)
    blocks = {n: num_blocks_for_memory(CONFIG, 16, d, budget) for n, d in KV_DTYPES.items()}
    assert blocks == {"float32": 100, "float16": 200, "int8": 266}


def test_auto_kv_dtype() -> None:
    """auto: float16 for a float32 model on CPU; otherwise the model's dtype; names resolve."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kv_dtype(None, torch.float32, cpu) == torch.float16
    assert resolve_kv_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, cuda) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
    assert resolve_kv_dtype("int8", torch.float32, cpu) == torch.int8
    assert resolve_kv_dtype("float32", torch.float32, cpu) == torch.float32
    with pytest.raises(ValueError, match="unknown KV dtype 'int4'"):
        resolve_kv_dtype("int4", torch.float32, cpu)


def test_runner_reports_and_sizes_by_kv_dtype() -> None:
    """TorchRunner's default KV on CPU is float16: ModelInfo says so, its shape (which the
    engine sizes the cache manager and KVCacheStats bytes from) matches the pool, and a budget
    holds twice the float32 blocks; int8 likewise with its scales."""
    hf = tiny_hf("llama-gqa")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    config = make_runner(hf, num_blocks=1).config
    budget = 10 * block_bytes(config.kv_shape("float32"), 4)
    base: dict[str, Any] = {"block_size": 4, "dtype": torch.float32, "device": "cpu"}
    runners = {
        name: TorchRunner(
            config, state, RunnerOptions(**base, kv_budget_bytes=budget, kv_dtype=name)
        )
        for name in (None, "float32", "int8")
    }
    default = runners[None]
    assert (default.info.kv_dtype, default.info.dtype) == ("float16", "float32")
    # head_dim 16: 64 bytes per head per token in fp32, 32 in fp16, 16 + 4 in int8
    assert [r.num_blocks for r in runners.values()] == [20, 10, 32]
    for r in runners.values():
        assert r.info.shape == config.kv_shape(r.info.kv_dtype)
        assert r.pool.block_bytes == block_bytes(r.info.shape, 4)
        assert r.info.extra["kv_pool_bytes"] == str(r.num_blocks * r.pool.block_bytes)


# ---------------------------------------------------------------------------- pool


def test_fp16_pool_stores_half_and_gathers_fp32() -> None:
    """A float16 pool holds exactly kv.half() and gathers it back as float32."""
    pool = make_pool("float16")
    kv = torch.randn(3, 4, 8, device=DEVICE)
    pool.write(1, kv, torch.tensor([9, 2, 23], device=DEVICE))
    out = pool.gather(1, torch.tensor([2, 0, 5], device=DEVICE))
    assert pool.data.dtype == torch.float16 and out.dtype == torch.float32
    expected = kv.half().float().transpose(0, 1)  # [2*kvh, token, dim]
    assert torch.equal(out[:, [1, 6, 11]], expected)


def test_int8_pool_round_trip_is_within_half_a_step() -> None:
    """int8 stores each (token, head) vector as round(x / s) with s = absmax / 127 beside
    it; the gather dequantizes to within s / 2 of the input, and an all-zero vector stays 0."""
    pool = make_pool("int8")
    kv = torch.randn(3, 4, 8, device=DEVICE) * torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)
    kv[1, 2] = 0.0
    pool.write(2, kv, torch.tensor([9, 2, 23], device=DEVICE))
    assert pool.data.dtype == torch.int8 and pool.scales is not None
    scale = kv.abs().amax(-1) / 127  # [token, head]
    stored = pool.scales[2].reshape(4, -1)[:, [9, 2, 23]].t()
    assert torch.allclose(stored[scale > 0], scale[scale > 0], rtol=1e-6)
    out = pool.gather(2, torch.tensor([2, 0, 5], device=DEVICE))[:, [1, 6, 11]].transpose(0, 1)
    assert bool(((out - kv).abs() <= scale.unsqueeze(-1) * 0.5001).all())
    assert not out[1, 2].any()


def test_int8_copy_on_write_and_scrub_carry_the_scales() -> None:
    """copy_blocks copies int8 values and scales; a NaN key leaves a non-finite scale, which
    scrub_blocks finds and zeroes along with the block."""
    pool = make_pool("int8")
    assert pool.scales is not None
    pool.write(0, torch.randn(4, 4, 8, device=DEVICE), torch.arange(4, 8, device=DEVICE))
    pool.copy_blocks([(1, 3)])
    assert torch.equal(pool.data[:, :, 3], pool.data[:, :, 1])
    assert torch.equal(pool.scales[:, :, 3], pool.scales[:, :, 1]) and pool.scales[0, :, 3].all()
    bad = torch.randn(1, 4, 8, device=DEVICE)
    bad[0, 1, 3] = float("nan")
    pool.write(2, bad, torch.tensor([17], device=DEVICE))  # block 4
    assert pool.scrub_blocks([1, 4]) == [4]
    assert not pool.scales[:, :, 4].any() and not pool.data[:, :, 4].any()
    assert pool.scales[0, :, 1].all()


# ---------------------------------------------------------------------------- attention

H, KVH, D, BS = 4, 2, 8, 4


def _steps() -> list[tuple[list[ScheduledSeq], list[ScheduledSeq]]]:
    """a: fresh 12-token chunk, then a 14-token chunk over its cached prefix, then 4 decodes;
    b: fresh 7-token prompt, then 5 decodes alongside a; c: a 30-token prompt in one chunk
    (longer than the window, which then masks inside the chunk), then 4 decodes."""
    ids = {"a": list(range(30)), "b": list(range(12)), "c": list(range(34))}
    tables = {"a": list(range(0, 8)), "b": list(range(8, 11)), "c": list(range(11, 20))}

    def s(r: str, start: int, end: int) -> ScheduledSeq:
        return seq(r, ids[r], start, end, tables[r])

    steps = [([s("a", 0, 12), s("b", 0, 7), s("c", 0, 30)], [])]
    steps.append(([s("a", 12, 26)], [s("b", 7, 8), s("c", 30, 31)]))
    for k in range(3):
        steps.append(([], [s("a", 26 + k, 27 + k), s("b", 8 + k, 9 + k), s("c", 31 + k, 32 + k)]))
    return steps


def _run_attention(kv_dtype: str, window: int | None) -> list[torch.Tensor]:
    """Every step's attention output [T, H * D] over a pool in ``kv_dtype``; the inputs
    (seeded) are the same for every dtype."""
    pool = KVPool(1, KVH, D, 20, BS, KV_DTYPES[kv_dtype], DEVICE, torch.float32)
    g = torch.Generator().manual_seed(0)
    spec = AttentionSpec(H, KVH, D, BS, torch.float32, KV_DTYPES[kv_dtype], DEVICE, window)
    attention = TorchAttention(spec)
    outs = []
    for prefill, decode in _steps():
        batch = attention.build(StepRows.from_seqs(prefill, decode, BS))
        # Q as the model hands it over, pre-scaled by 1/sqrt(D); K, V ~ N(0, 1): scores
        # have std 2.
        qkv = torch.randn(batch.num_tokens, H + 2 * KVH, D, generator=g).to(DEVICE)
        qkv[:, :H] *= 2.0 / D**0.5
        out = torch.empty(batch.num_tokens, H * D, device=DEVICE)
        attention.forward(0, qkv, batch, pool, out)
        outs.append(out)
    return outs


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_attention_tracks_fp32_kv(kv_dtype: str, window: int | None) -> None:
    """With GQA (4 heads / 2 KV heads), with and without a sliding window: fresh prefill,
    chunked prefill over a cached prefix, and batched decode give attention outputs within
    TOLERANCE (fp16 2e-3, int8 2e-2 of max |output|) of a float32 pool's."""
    ref = _run_attention("float32", window)
    got = _run_attention(kv_dtype, window)
    for step, (o, r) in enumerate(zip(got, ref, strict=True)):
        err = ((o - r).abs().max() / r.abs().max()).item()
        assert err <= TOLERANCE[kv_dtype], f"step {step}: relative error {err:.2e}"


# ---------------------------------------------------------------------------- greedy tokens

NUM_NEW = 64


def greedy(
    runner: TorchRunner, prompts: Sequence[list[int]], forced: list[list[int]] | None = None
) -> list[list[int]]:
    """Greedy tokens of every prompt: one batched prefill, then NUM_NEW - 1 batched decode
    steps. With ``forced`` (teacher forcing) each step feeds ``forced``'s tokens instead of
    its own, so one early flip does not change every later input; the argmax at each position
    is still this runner's own."""
    tables = [list(range(22 * i, 22 * (i + 1))) for i in range(len(prompts))]
    ids = [list(p) for p in prompts]
    rids = [f"r{i}" for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    for k in range(NUM_NEW):
        rows = zip(rids, ids, tables, strict=True)
        if k == 0:
            step = plan(0, prefill=[seq(r, x, 0, len(x), t) for r, x, t in rows])
        else:
            step = plan(k, decode=[seq(r, x, len(x) - 1, len(x), t) for r, x, t in rows])
        logits = runner.step_logits(step)
        for i, r in enumerate(rids):
            token = int(logits[r][-1].argmax())
            out[i].append(token)
            ids[i].append(token if forced is None else forced[i][k])
    return out


@pytest.fixture(scope="module", params=["llama-gqa", "mistral"])
def fp32_run(
    request: pytest.FixtureRequest,
) -> tuple[torch.nn.Module, list[list[int]], list[list[int]]]:
    """A tiny model (GQA; Mistral: sliding window 8), 8 prompts of 5..19 tokens, and the
    greedy tokens of a float32 KV cache."""
    hf = tiny_hf(str(request.param))
    prompts = [random_ids(5 + 2 * i, seed=100 + i) for i in range(8)]
    return hf, prompts, greedy(make_runner(hf, num_blocks=8 * 22), prompts)


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_greedy_tokens_agree_with_fp32_kv(
    fp32_run: tuple[torch.nn.Module, list[list[int]], list[list[int]]], kv_dtype: str
) -> None:
    """Teacher-forced on the float32 run's tokens, 8 prompts x 64 greedy positions pick the
    float32 run's token at >= 95 % of positions, compared position by position (measured:
    fp16 100 %, int8 98.6-99.2 %)."""
    hf, prompts, want = fp32_run
    got = greedy(make_runner(hf, num_blocks=8 * 22, kv_dtype=kv_dtype), prompts, forced=want)
    same = sum(a == b for w, g in zip(want, got, strict=True) for a, b in zip(w, g, strict=True))
    assert same / (8 * NUM_NEW) >= 0.95, f"{same} of {8 * NUM_NEW} positions agree"
