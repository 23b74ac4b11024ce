"""Our logits equal Hugging Face transformers' on the same weights (fp32, atol 1e-4), for every
way a request's KV can come to be in the paged pool."""

from __future__ import annotations

import pytest
import torch

from model_runner.config import RunnerOptions
from model_runner.model import rope_inv_freq
from tests.model_runner.oracle import (
    DEVICE,
    assert_close,
    hf_logits,
    make_runner,
    our_config,
    plan,
    random_ids,
    seq,
    tiny_hf,
)

KINDS = [
    "llama", "llama-gqa", "qwen2", "mistral", "qwen3", "phi4-mini", "qwen3moe", "mixtral", "gemma3",
]  # fmt: skip


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def hf(kind: str) -> torch.nn.Module:
    return tiny_hf(kind)


@pytest.mark.parametrize("use_onednn", [False, None])
def test_full_prefill(hf: torch.nn.Module, use_onednn: bool | None) -> None:
    """One 21-token prefill in non-contiguous blocks: logits of every position match."""
    runner = make_runner(hf, use_onednn=use_onednn)
    ids = random_ids(21, seed=1)
    blocks = [9, 3, 17, 0, 12, 5]
    out = runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 21, blocks)]))
    assert_close(out["a"], hf_logits(hf, ids))


def test_chunked_prefill_then_decode(hf: torch.nn.Module) -> None:
    """A prompt split into chunks of 5, 7 and 6 tokens, then 4 decode steps, matches the full
    forward position by position (chunks start mid-block and read the cached prefix)."""
    runner = make_runner(hf)
    ids = random_ids(22, seed=2)
    blocks = [6, 1, 30, 2, 11, 7]
    got = []
    for step, (start, end) in enumerate([(0, 5), (5, 12), (12, 18)]):
        out = runner.step_logits(plan(step, prefill=[seq("a", ids, start, end, blocks)]))
        got.append(out["a"])
    for pos in range(18, 22):
        out = runner.step_logits(plan(pos, decode=[seq("a", ids, pos, pos + 1, blocks)]))
        got.append(out["a"])
    assert_close(torch.cat(got), hf_logits(hf, ids))


def test_batched_decode_of_different_lengths(hf: torch.nn.Module) -> None:
    """Three requests of 3, 11 and 19 tokens decode together for 5 steps; each row matches
    its own reference (padding of shorter contexts is masked)."""
    runner = make_runner(hf)
    lengths = {"a": 3, "b": 11, "c": 19}
    total = {r: n + 5 for r, n in lengths.items()}
    ids = {r: random_ids(total[r], seed=10 + i) for i, r in enumerate(lengths)}
    tables = {"a": [40, 41], "b": [3, 8, 20, 21], "c": [13, 14, 15, 16, 17, 18]}
    runner.step_logits(
        plan(0, prefill=[seq(r, ids[r], 0, n, tables[r]) for r, n in lengths.items()])
    )
    got: dict[str, list[torch.Tensor]] = {r: [] for r in lengths}
    for k in range(5):
        decode = [seq(r, ids[r], n + k, n + k + 1, tables[r]) for r, n in lengths.items()]
        out = runner.step_logits(plan(k + 1, decode=decode))
        for r in lengths:
            got[r].append(out[r])
    for r, n in lengths.items():
        assert_close(torch.cat(got[r]), hf_logits(hf, ids[r])[n:])


def test_decode_groups_of_very_different_lengths(hf: torch.nn.Module) -> None:
    """Five requests of 3 to 90 tokens, listed in no particular order, decode together for 3
    steps (the runner splits them into length groups); each row matches its reference."""
    runner = make_runner(hf, num_blocks=80)
    lengths = {"e": 3, "c": 40, "a": 90, "d": 12, "b": 70}
    ids = {r: random_ids(n + 3, seed=90 + i) for i, (r, n) in enumerate(lengths.items())}
    tables: dict[str, list[int]] = {}
    next_block = 1
    for r, n in lengths.items():
        tables[r] = list(range(next_block, next_block + (n + 3 + 3) // 4))
        next_block += len(tables[r])
    runner.step_logits(
        plan(0, prefill=[seq(r, ids[r], 0, n, tables[r]) for r, n in lengths.items()])
    )
    got: dict[str, list[torch.Tensor]] = {r: [] for r in lengths}
    for k in range(3):
        decode = [seq(r, ids[r], n + k, n + k + 1, tables[r]) for r, n in lengths.items()]
        out = runner.step_logits(plan(k + 1, decode=decode))
        for r in lengths:
            got[r].append(out[r])
    for r, n in lengths.items():
        assert_close(torch.cat(got[r]), hf_logits(hf, ids[r])[n:])


@pytest.mark.parametrize("fuse", [True, False])
def test_mixed_step_prefill_and_decode(hf: torch.nn.Module, fuse: bool) -> None:
    """One step holding two prefill chunks (one fresh, one continuing) and two decodes gives
    every request its reference logits, fused into one pass or run as two."""
    runner = make_runner(hf, fuse_batches=fuse)
    ids = {r: random_ids(16, seed=20 + i) for i, r in enumerate("abcd")}
    tables = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12], "d": [13, 14, 15, 16]}
    runner.step_logits(
        plan(
            0,
            prefill=[
                seq("a", ids["a"], 0, 9, tables["a"]),
                seq("b", ids["b"], 0, 14, tables["b"]),
                seq("c", ids["c"], 0, 6, tables["c"], do_sample=False),
            ],
        )
    )
    out = runner.step_logits(
        plan(
            1,
            prefill=[
                seq("d", ids["d"], 0, 13, tables["d"]),
                seq("c", ids["c"], 6, 15, tables["c"]),
            ],
            decode=[
                seq("a", ids["a"], 9, 10, tables["a"]),
                seq("b", ids["b"], 14, 15, tables["b"]),
            ],
        )
    )
    assert_close(out["d"], hf_logits(hf, ids["d"][:13]))
    assert_close(out["c"], hf_logits(hf, ids["c"][:15])[6:])
    assert_close(out["a"], hf_logits(hf, ids["a"][:10])[9:])
    assert_close(out["b"], hf_logits(hf, ids["b"][:15])[14:])


def test_prefix_cache_hit_reuses_blocks(hf: torch.nn.Module) -> None:
    """Request b shares a's first two full blocks (8 tokens): b's table starts with a's
    block ids and b computes only from position 8, yet matches its full reference."""
    runner = make_runner(hf)
    a = random_ids(14, seed=30)
    b = a[:8] + random_ids(9, seed=31)
    runner.step_logits(plan(0, prefill=[seq("a", a, 0, 14, [21, 4, 9, 33])]))
    out = runner.step_logits(plan(1, prefill=[seq("b", b, 8, 17, [21, 4, 50, 51, 52])]))
    assert_close(out["b"], hf_logits(hf, b)[8:])
    # a's own continuation still reads its blocks, untouched by b.
    out = runner.step_logits(plan(2, decode=[seq("a", [*a, 5], 14, 15, [21, 4, 9, 33])]))
    assert_close(out["a"], hf_logits(hf, [*a, 5])[14:])


def test_copy_on_write_of_shared_partial_block(hf: torch.nn.Module) -> None:
    """A fork shares a's partial last block; before writing, the plan copies it (block 9 ->
    block 40) and the child continues in its copy while a continues in the original."""
    runner = make_runner(hf)
    a = random_ids(10, seed=40)
    runner.step_logits(plan(0, prefill=[seq("a", a, 0, 10, [3, 7, 9])]))
    child = [*a, 77]
    parent = [*a, 91]
    out = runner.step_logits(
        plan(
            1,
            decode=[seq("a", parent, 10, 11, [3, 7, 9]), seq("c", child, 10, 11, [3, 7, 40])],
            block_copies=[(9, 40)],
        )
    )
    assert_close(out["a"], hf_logits(hf, parent)[10:])
    assert_close(out["c"], hf_logits(hf, child)[10:])


def test_resume_after_recompute_preemption(hf: torch.nn.Module) -> None:
    """a decodes 3 tokens, is preempted (its blocks are overwritten by another request), then
    re-prefills prompt + generated tokens in chunks into other blocks and decodes on."""
    runner = make_runner(hf)
    ids = random_ids(19, seed=50)  # 13 prompt + 3 generated + 3 after resuming
    blocks = [2, 3, 4, 5]
    runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 13, blocks)]))
    for pos in range(13, 16):
        runner.step_logits(plan(pos, decode=[seq("a", ids, pos, pos + 1, blocks)]))
    other = random_ids(16, seed=51)
    runner.step_logits(plan(20, prefill=[seq("x", other, 0, 16, blocks)]))  # takes a's blocks
    new_blocks = [4, 60, 61, 62, 63]
    got = []
    for step, (start, end) in enumerate([(0, 9), (9, 16)]):
        out = runner.step_logits(plan(30 + step, prefill=[seq("a", ids, start, end, new_blocks)]))
        got.append(out["a"])
    for pos in range(16, 19):
        out = runner.step_logits(plan(pos + 40, decode=[seq("a", ids, pos, pos + 1, new_blocks)]))
        got.append(out["a"])
    assert_close(torch.cat(got), hf_logits(hf, ids))


def test_long_sequence_crosses_the_sliding_window() -> None:
    """Mistral, window 8: a 30-token sequence (prefill chunks of 11 and 9, then decodes)
    matches transformers where the window drops early keys; released out-of-window blocks
    (pointing at block 0, the null block) are never read."""
    hf = tiny_hf("mistral", seed=3)
    runner = make_runner(hf)
    ids = random_ids(30, seed=60)
    table = [1, 2, 3, 4, 5, 6, 7, 8]
    got = [runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 11, table)]))["a"]]
    got.append(runner.step_logits(plan(1, prefill=[seq("a", ids, 11, 20, table)]))["a"])
    released = list(table)
    for pos in range(20, 30):
        # Blocks wholly before the window of the next query are released to the null block.
        for b in range(max(0, pos - 8 + 1) // 4):
            runner.pool.data[:, :, released[b]].fill_(float("nan"))
            released[b] = 0
        out = runner.step_logits(plan(2 + pos, decode=[seq("a", ids, pos, pos + 1, released)]))
        got.append(out["a"])
    assert_close(torch.cat(got), hf_logits(hf, ids))


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=["linear", "llama3"],
)
def test_rope_scaling(rope_scaling: dict[str, object]) -> None:
    """Linear and llama3 RoPE scaling: same inverse frequencies and logits as transformers."""
    hf = tiny_hf("llama", seed=4, rope_scaling=rope_scaling, rope_theta=10000.0)
    config = our_config(hf)
    assert config.rope_scaling is not None
    hf_inv_freq = hf.model.rotary_emb.inv_freq.float().cpu()
    assert torch.allclose(rope_inv_freq(config), hf_inv_freq, rtol=1e-6, atol=0)
    runner = make_runner(hf)
    ids = random_ids(40, seed=70)
    out = runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 40, list(range(10)))]))
    assert_close(out["a"], hf_logits(hf, ids))


def test_gguf_rope_freqs_equal_llama3_scaling() -> None:
    """llama.cpp stores llama3 RoPE scaling as per-frequency divisors (rope_freqs): dividing
    the plain frequencies by them gives exactly transformers' llama3 frequencies."""
    from dataclasses import replace

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    hf = tiny_hf("llama", seed=4, rope_scaling=scaling, rope_theta=10000.0)
    config = our_config(hf)
    hf_inv_freq = hf.model.rotary_emb.inv_freq.float().cpu()
    plain = rope_inv_freq(replace(config, rope_scaling=None))
    factors = (plain / hf_inv_freq).tolist()
    gguf_like = replace(config, rope_scaling=None, extra={"rope_freqs": factors})
    assert torch.allclose(rope_inv_freq(gguf_like), hf_inv_freq, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="rope_freqs has 3 factors"):
        rope_inv_freq(replace(gguf_like, extra={"rope_freqs": factors[:3]}))


def test_unsupported_rope_scaling_raises() -> None:
    """A rope type we do not implement is refused at load time, not silently run."""
    hf = tiny_hf("llama", seed=5)
    config = our_config(hf)
    from dataclasses import replace

    bad = replace(config, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(bad)


@pytest.mark.parametrize(
    ("dtype", "atol"),
    # Tolerances from the formats' precision (bf16: 8 mantissa bits, fp16: 11) on logits of
    # std ~1.3 through 2 layers; the fp32 runs above are held to 1e-4.
    [(torch.bfloat16, 0.3), (torch.float16, 0.05)],
    ids=["bf16", "fp16"],
)
def test_half_precision_paths_track_fp32(
    hf: torch.nn.Module, dtype: torch.dtype, atol: float
) -> None:
    """The half-precision code path (real-valued RoPE, fp32 softmax; what CUDA runs by default)
    stays within the format's precision of transformers' fp32 logits, prefill and decode."""
    from model_runner.runner import TorchRunner

    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    runner = TorchRunner(our_config(hf), state, RunnerOptions(64, 4, dtype=dtype, device=DEVICE))
    ids = random_ids(21, seed=80)
    table = [1, 2, 3, 4, 5, 6]
    got = [runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 15, table)]))["a"]]
    for pos in range(15, 21):
        got.append(runner.step_logits(plan(pos, decode=[seq("a", ids, pos, pos + 1, table)]))["a"])
    err = (torch.cat(got).to(DEVICE) - hf_logits(hf, ids)).abs().max().item()
    assert err <= atol, f"max |ours({dtype}) - transformers(fp32)| = {err:.3f} > {atol}"
