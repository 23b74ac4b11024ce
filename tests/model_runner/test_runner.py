"""TorchRunner.execute: sampling rows, per-request failures, ModelInfo, pool sizing, timings."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest
import torch

from cache_manager.sizing import block_bytes
from model_runner.config import RunnerOptions
from model_runner.runner import TorchRunner
from model_runner.sampler import Sampler, SamplingBatch
from scheduler.output import ScheduledSeq
from scheduler.request import SamplingParams
from tests.model_runner.oracle import (
    DEVICE,
    hf_logits,
    make_runner,
    our_config,
    plan,
    random_ids,
    seq,
    tiny_hf,
)


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return tiny_hf("qwen2", seed=11)


def greedy_next(hf: torch.nn.Module, ids: list[int]) -> int:
    return int(hf_logits(hf, ids)[-1].argmax())


def test_greedy_tokens_and_sampling_rows(hf: torch.nn.Module) -> None:
    """Only seqs with do_sample get a token: a middle chunk gets none; finished chunks and
    decodes get transformers' greedy next token."""
    runner = make_runner(hf)
    a, b = random_ids(12, seed=1), random_ids(20, seed=2)
    result = runner.execute(
        plan(
            0,
            prefill=[seq("a", a, 0, 12, [1, 2, 3]), seq("b", b, 0, 8, [4, 5, 6, 7, 8], False)],
        )
    )
    assert result.sampled_token_ids == {"a": greedy_next(hf, a)}
    assert result.failed == {}
    a2 = [*a, result.sampled_token_ids["a"]]
    result = runner.execute(
        plan(
            1,
            prefill=[seq("b", b, 8, 20, [4, 5, 6, 7, 8])],
            decode=[seq("a", a2, 12, 13, [1, 2, 3, 9])],
        )
    )
    assert result.sampled_token_ids == {"b": greedy_next(hf, b), "a": greedy_next(hf, a2)}


@pytest.mark.parametrize("fuse", [True, False])
def test_middle_chunks_alone_sample_nothing(hf: torch.nn.Module, fuse: bool) -> None:
    """A step whose only work is a middle chunk returns no token and no failure, and still
    writes the KV the next chunk reads."""
    runner = make_runner(hf, fuse_batches=fuse)
    a = random_ids(12, seed=12)
    result = runner.execute(plan(0, prefill=[seq("a", a, 0, 7, [1, 2, 3], do_sample=False)]))
    assert result.sampled_token_ids == {} and result.failed == {}
    result = runner.execute(plan(1, prefill=[seq("a", a, 7, 12, [1, 2, 3])]))
    assert result.sampled_token_ids == {"a": greedy_next(hf, a)}


@pytest.mark.parametrize("fuse", [True, False])
def test_timings_by_batch_kind(hf: torch.nn.Module, fuse: bool) -> None:
    """prefill_time_s / decode_time_s are positive exactly for the kinds the step ran."""
    runner = make_runner(hf, fuse_batches=fuse)
    a, b = random_ids(9, seed=3), random_ids(6, seed=4)
    only_prefill = runner.execute(plan(0, prefill=[seq("a", a, 0, 8, [1, 2, 3])]))
    assert only_prefill.prefill_time_s > 0.0 and only_prefill.decode_time_s == 0.0
    both = runner.execute(
        plan(1, prefill=[seq("b", b, 0, 6, [4, 5])], decode=[seq("a", a, 8, 9, [1, 2, 3])])
    )
    assert both.prefill_time_s > 0.0 and both.decode_time_s > 0.0
    only_decode = runner.execute(plan(2, decode=[seq("b", [*b, 7], 6, 7, [4, 5])]))
    assert only_decode.prefill_time_s == 0.0 and only_decode.decode_time_s > 0.0


def test_fused_and_separate_passes_agree(hf: torch.nn.Module) -> None:
    """The same mixed step gives the same tokens fused into one pass or run as two."""
    results = []
    for fuse in (True, False):
        runner = make_runner(hf, fuse_batches=fuse)
        a, b = random_ids(14, seed=5), random_ids(10, seed=6)
        runner.execute(plan(0, prefill=[seq("a", a, 0, 13, [1, 2, 3, 4])]))
        results.append(
            runner.execute(
                plan(
                    1,
                    prefill=[seq("b", b, 0, 10, [5, 6, 7])],
                    decode=[seq("a", a, 13, 14, [1, 2, 3, 4])],
                )
            ).sampled_token_ids
        )
    assert results[0] == results[1] == {"b": greedy_next(hf, b), "a": greedy_next(hf, a)}


def test_nan_in_one_request_fails_only_that_request(hf: torch.nn.Module) -> None:
    """NaN in a's cached keys/values gives a NaN logits row: a lands in ``failed``, b in the
    same decode batch still gets its greedy token."""
    runner = make_runner(hf)
    a, b = random_ids(7, seed=7), random_ids(9, seed=8)
    runner.execute(plan(0, prefill=[seq("a", a, 0, 6, [10, 11]), seq("b", b, 0, 8, [12, 13])]))
    runner.pool.data[:, :, 10] = float("nan")
    result = runner.execute(
        plan(1, decode=[seq("a", a, 6, 7, [10, 11]), seq("b", b, 8, 9, [12, 13, 14])])
    )
    assert set(result.failed) == {"a"}
    assert "NaN" in result.failed["a"]
    assert result.sampled_token_ids == {"b": greedy_next(hf, b)}


def test_decode_padding_never_reads_another_requests_blocks(hf: torch.nn.Module) -> None:
    """b (1 block) is padded to a's 4 blocks in one decode group; a owns block 0 and its KV is
    NaN. Padding reads only b's own block, so b still gets its greedy token."""
    runner = make_runner(hf)
    a, b = random_ids(14, seed=21), random_ids(3, seed=22)
    runner.execute(plan(0, prefill=[seq("a", a, 0, 13, [0, 1, 2, 3]), seq("b", b, 0, 2, [9])]))
    runner.pool.data[:, :, 0] = float("nan")
    result = runner.execute(
        plan(1, decode=[seq("a", a, 13, 14, [0, 1, 2, 3]), seq("b", b, 2, 3, [9])])
    )
    assert set(result.failed) == {"a"}
    assert result.sampled_token_ids == {"b": greedy_next(hf, b)}


def test_failed_request_leaves_no_nan_behind(hf: torch.nn.Module) -> None:
    """After a fails with NaN, its blocks are scrubbed before the next step runs (they are
    free once its result is applied): c, which gets a's block 11 and decodes with the
    unwritten (masked) tail of that block in its gather, still matches."""
    runner = make_runner(hf)
    a = random_ids(7, seed=7)
    runner.execute(plan(0, prefill=[seq("a", a, 0, 6, [10, 11])]))
    runner.pool.data[:, :, 10] = float("nan")
    result = runner.execute(plan(1, decode=[seq("a", a, 6, 7, [10, 11])]))
    assert set(result.failed) == {"a"}
    c = random_ids(2, seed=9)
    runner.execute(plan(2, prefill=[seq("c", c, 0, 1, [11])]))
    assert bool(torch.isfinite(runner.pool.data).all())
    result = runner.execute(plan(3, decode=[seq("c", c, 1, 2, [11])]))
    assert result.sampled_token_ids == {"c": greedy_next(hf, c)}


class RaisingSampler(Sampler):
    """The real sampler, except that preparing any batch holding ``bad_id`` raises."""

    def __init__(self, bad_id: str) -> None:
        super().__init__()
        self.bad_id = bad_id

    def prepare(self, seqs: Sequence[ScheduledSeq], *args: Any, **kwargs: Any) -> SamplingBatch:
        if any(s.request_id == self.bad_id for s in seqs):
            raise RuntimeError("boom")
        return super().prepare(seqs, *args, **kwargs)


def test_sampler_raising_for_one_request_fails_only_that_request(hf: torch.nn.Module) -> None:
    """When the sampler raises on the batch, rows are re-sampled one by one: only the row
    that raises fails, with the error in its message."""
    runner = make_runner(hf, sampler=RaisingSampler("b"))
    ids = {r: random_ids(5 + i, seed=20 + i) for i, r in enumerate("abc")}
    tables = {"a": [1, 2], "b": [3, 4], "c": [5, 6, 7]}
    result = runner.execute(
        plan(0, prefill=[seq(r, ids[r], 0, len(ids[r]), tables[r]) for r in "abc"])
    )
    assert result.failed == {"b": "sampling failed: RuntimeError: boom"}
    assert result.sampled_token_ids == {r: greedy_next(hf, ids[r]) for r in "ac"}


def test_inconsistent_seqs_fail_alone(hf: torch.nn.Module) -> None:
    """A too-short block table, a token outside the vocabulary, a position past
    max_model_len and a block id outside the pool each fail their own request only."""
    runner = make_runner(hf, num_blocks=64, max_model_len=32)
    good = random_ids(6, seed=30)
    bad_vocab = [*random_ids(4, seed=31), 500]
    result = runner.execute(
        plan(
            0,
            prefill=[
                seq("short", random_ids(9, seed=32), 0, 9, [1, 2]),
                seq("vocab", bad_vocab, 0, 5, [3, 4]),
                seq("good", good, 0, 6, [5, 6]),
                seq("pool", random_ids(3, seed=33), 0, 3, [64]),
            ],
            decode=[seq("long", random_ids(33, seed=34), 32, 33, list(range(10, 19)))],
        )
    )
    assert set(result.failed) == {"short", "vocab", "pool", "long"}
    assert "block table of 2 blocks cannot hold position 8" in result.failed["short"]
    assert "vocabulary of 128" in result.failed["vocab"]
    assert "pool of 64 blocks" in result.failed["pool"]
    assert "max_model_len 32" in result.failed["long"]
    assert result.sampled_token_ids == {"good": greedy_next(hf, good)}


def test_execute_does_not_mutate_the_plan(hf: torch.nn.Module) -> None:
    """The plan (token ids, block tables, copies) is read-only to the runner."""
    runner = make_runner(hf)
    a = random_ids(8, seed=40)
    step = plan(0, prefill=[seq("a", a, 0, 8, [1, 2])], block_copies=[(5, 6)])
    before = copy.deepcopy(step)
    runner.execute(step)
    assert step == before


def test_logprobs_are_passed_through(hf: torch.nn.Module) -> None:
    """A request asking for 2 logprobs gets its sampled token's logprob and 2 alternatives
    (log-softmax of transformers' logits)."""
    runner = make_runner(hf)
    a = random_ids(7, seed=41)
    s = ScheduledSeq("a", a, 0, [1, 2], SamplingParams(temperature=0.0, logprobs=2), True)
    result = runner.execute(plan(0, prefill=[s]))
    ref = hf_logits(hf, a)[-1].log_softmax(-1)
    top = ref.topk(2)
    lp = result.logprobs["a"]
    assert lp.token_id == result.sampled_token_ids["a"] == int(top.indices[0])
    assert lp.logprob == pytest.approx(float(top.values[0]), abs=1e-4)
    assert [t for t, _ in lp.top] == top.indices.tolist()


def test_model_info_describes_model_and_pool(hf: torch.nn.Module) -> None:
    """ModelInfo carries the vocabulary, length limit, KV shape, dtype, device and pool size."""
    runner = make_runner(hf, num_blocks=40, block_size=4, max_model_len=100)
    config = our_config(hf)
    info = runner.info
    assert info.vocab_size == 128
    assert info.max_model_len == 100
    assert info.shape == config.kv_shape("float32")
    assert info.eos_token_ids == (2,)
    assert info.dtype == "float32"
    assert info.device == str(DEVICE)
    assert info.extra["num_blocks"] == "40"
    assert info.extra["block_size"] == "4"
    assert info.extra["kv_pool_bytes"] == str(40 * block_bytes(info.shape, 4))


def test_pool_is_allocated_once(hf: torch.nn.Module) -> None:
    """Steps write into the pool allocated at start-up: same storage, same size."""
    runner = make_runner(hf, num_blocks=16)
    ptr, nbytes = runner.pool.data.data_ptr(), runner.pool.num_bytes
    a = random_ids(10, seed=50)
    runner.execute(plan(0, prefill=[seq("a", a, 0, 9, [1, 2, 3])]))
    runner.execute(plan(1, decode=[seq("a", a, 9, 10, [1, 2, 3])], block_copies=[(1, 4)]))
    assert runner.pool.data.data_ptr() == ptr
    assert runner.pool.num_bytes == nbytes == 16 * runner.pool.block_bytes


def test_num_blocks_sized_from_a_memory_budget(hf: torch.nn.Module) -> None:
    """num_blocks=None sizes the pool from kv_budget_bytes with the cache manager's sizing."""
    config = our_config(hf)
    per_block = block_bytes(config.kv_shape("float32"), 4)
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    options = RunnerOptions(block_size=4, dtype=torch.float32, device=DEVICE, kv_dtype="float32")
    runner = TorchRunner(config, state, replace(options, kv_budget_bytes=7 * per_block + 5))
    assert runner.num_blocks == 7
    assert runner.pool.num_bytes == 7 * per_block
    with pytest.raises(ValueError, match="holds no block"):
        TorchRunner(config, state, replace(options, kv_budget_bytes=per_block - 1))


def test_missing_weights_are_named(hf: torch.nn.Module) -> None:
    """A state dict without a weight the config needs is refused with the weight's name."""
    state = {k: v for k, v in hf.state_dict().items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        TorchRunner(our_config(hf), state, RunnerOptions(8, 4, dtype=torch.float32, device=DEVICE))


def run_sampled(
    runner: TorchRunner, prompts: dict[str, list[int]], params: dict[str, SamplingParams]
) -> dict[str, list[int]]:
    """Prefill every prompt, then decode 5 steps; returns each request's 6 sampled tokens."""
    tables = {r: [1 + 6 * i + j for j in range(6)] for i, r in enumerate(prompts)}
    ids = {r: list(p) for r, p in prompts.items()}
    n_prompt = {r: len(p) for r, p in prompts.items()}
    out: dict[str, list[int]] = {r: [] for r in prompts}
    for step in range(6):
        seqs = []
        for r in prompts:
            start = 0 if step == 0 else len(ids[r]) - 1
            seqs.append(
                ScheduledSeq(
                    request_id=r,
                    token_ids=ids[r][start:],
                    start_pos=start,
                    block_ids=tables[r],
                    sampling=params[r],
                    do_sample=True,
                    all_token_ids=list(ids[r]),
                    num_prompt_tokens=n_prompt[r],
                    num_output_tokens=len(out[r]),
                )
            )
        result = runner.execute(plan(step, prefill=seqs) if step == 0 else plan(step, decode=seqs))
        assert not result.failed
        for r in prompts:
            token = result.sampled_token_ids[r]
            out[r].append(token)
            ids[r].append(token)
    return out


def test_seeded_sampling_is_batch_independent(hf: torch.nn.Module) -> None:
    """A seeded temperature-1 request samples the same tokens alone as inside a batch of 16
    others with mixed (seeded, unseeded, greedy, top-k/top-p) sampling settings."""
    target = SamplingParams(temperature=1.0, seed=1234)
    prompt = random_ids(9, seed=60)
    alone = run_sampled(make_runner(hf, num_blocks=110), {"t": prompt}, {"t": target})
    prompts = {"t": prompt} | {f"o{i}": random_ids(3 + i, seed=61 + i) for i in range(16)}
    others = [
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.9, seed=7),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
    ]
    params = {"t": target} | {f"o{i}": others[i % 4] for i in range(16)}
    batched = run_sampled(
        make_runner(hf, num_blocks=110, sampler=Sampler(seed=99)), prompts, params
    )
    assert batched["t"] == alone["t"]
