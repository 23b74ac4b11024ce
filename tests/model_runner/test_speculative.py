"""Speculative decoding on the real model: verification of k + 1 positions in one pass on
both decode paths, and whole runs with drafts equal runs without them."""

from __future__ import annotations

import pytest
import torch

from cache_manager import KVCacheConfig, KVCacheManager
from loadtest.workload import CHAT128_PROMPTS, WORKLOADS_DIR
from model_runner.config import RunnerOptions
from model_runner.runner import TorchRunner
from scheduler import Request, SamplingParams, ScheduledSeq, Scheduler, SchedulerConfig
from tests.model_runner.oracle import (
    hf_logits,
    make_runner,
    plan,
    random_ids,
    seq,
    tiny_hf,
)

BLOCK_SIZE = 4


def verify_seq(ids: list[int], start: int, drafts: list[int], blocks: list[int]) -> ScheduledSeq:
    """A decode of ``ids[start]`` (the last known token) with ``drafts`` after it."""
    s = seq("v", ids, start, start + 1, blocks)
    s.token_ids = [ids[start], *drafts]
    s.num_draft_tokens = len(drafts)
    return s


@pytest.mark.parametrize(
    "kind",
    ["llama", "llama-gqa", "qwen2", "mistral", "qwen3", "phi4-mini", "qwen3moe", "mixtral",
     "gemma3"],
)  # fmt: skip
def test_verify_positions_equal_a_full_forward(kind: str) -> None:
    """The k + 1 positions of a decode with drafts (a chunk over the cached KV) give
    transformers' logits at those positions, mistral and gemma3's sliding layer past their
    window of 8 included."""
    hf = tiny_hf(kind)
    runner = make_runner(hf, num_blocks=16, block_size=BLOCK_SIZE)
    ids = random_ids(24, seed=3)
    blocks = [9, 2, 7, 11, 4, 5, 13]
    runner.step_logits(plan(0, prefill=[seq("v", ids, 0, 18, blocks)]))
    got = runner.step_logits(plan(1, decode=[verify_seq(ids, 18, ids[19:24], blocks)]))["v"]
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(got, ref[18:24], rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral", "qwen3", "phi4-mini"])
def test_fused_verify_rows_equal_the_torch_path(kind: str) -> None:
    """On the fused step kernel a decode with drafts runs as k + 1 rows sharing a block
    table; its logits and KV equal the torch path's chunk, next to a plain decode (layer 0's
    KV to one activation residual unit, deeper layers' within activation-rounding flips)."""
    from tests.model_runner.test_quant import quantized_pair

    fused, _ = quantized_pair(kind, "q4", fused_step=True)
    plain, _ = quantized_pair(kind, "q4", fused_step=False)
    ids = random_ids(20, seed=4)
    other = random_ids(9, seed=5)
    blocks, other_blocks = [3, 8, 1, 12, 6], [20, 21, 22]
    for runner in (fused, plain):
        runner.step_logits(
            plan(0, prefill=[seq("v", ids, 0, 13, blocks), seq("o", other, 0, 8, other_blocks)])
        )
    step = plan(
        1,
        decode=[seq("o", other, 8, 9, other_blocks), verify_seq(ids, 13, ids[14:18], blocks)],
    )
    got, want = fused.step_logits(step), plain.step_logits(step)
    for rid in ("v", "o"):
        torch.testing.assert_close(got[rid], want[rid], rtol=0, atol=1e-3)
    # Layer 0's K/V: the two paths' RMS norms round differently in fp32, which moves a
    # 16-bit activation by at most one residual unit (as test_quant's mixed-step test holds
    # it). Deeper layers: within 1e-2 of max, as test_quant holds the fused path to the torch
    # path.
    torch.testing.assert_close(fused.pool.data[0], plain.pool.data[0], rtol=0, atol=1e-4)
    err = (fused.pool.data - plain.pool.data).abs().max().item()
    assert err <= 1e-2 * plain.pool.data.abs().max().item()


def run(
    runner: TorchRunner,
    prompts: list[list[int]],
    sampling: SamplingParams,
    speculative: str,
    num_blocks: int,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Every prompt through Scheduler + KVCacheManager + ``runner``, two arriving per step;
    invariants checked after every step. Request ``ABORTED`` is aborted once it has 6 output
    tokens (a verify step may overshoot that). Returns the output tokens per request."""
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            sliding_window=runner.config.sliding_window,
        )
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=16,
            max_model_len=128,
            long_prefill_token_threshold=8,
            speculative=speculative,
            num_speculative_tokens=3,
            ngram_max=3,
            ngram_min=1,
        ),
        kv,
    )
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for i, prompt in pending[:2]:
            scheduler.add_request(Request(f"r{i}", list(prompt), sampling=sampling))
        pending = pending[2:]
        plan_ = scheduler.schedule()
        result = runner.execute(plan_)
        assert not result.failed, result.failed
        for out in scheduler.update(plan_, result):
            outputs[out.request_id].extend(out.new_token_ids)
            if out.request_id == ABORTED and not out.finished and len(outputs[ABORTED]) >= 6:
                assert scheduler.abort(ABORTED) is not None
        kv.check_invariants()
        steps += 1
        assert steps < 500, "the run did not finish"
    return outputs, scheduler


ABORTED = "r1"
# Prompts that repeat themselves, so prompt lookup finds drafts; 0 and 2 share 8 tokens.
_A, _B = random_ids(8, seed=20), random_ids(6, seed=21)
PROMPTS = [
    _A + _B + _A,
    random_ids(5, seed=22) * 3,
    _A + random_ids(7, seed=23) + _B + _B,
    _B + _A + _B + _A,
    random_ids(11, seed=24),
    random_ids(4, seed=25) * 5,
]


@pytest.mark.parametrize(
    ("kind", "num_blocks"),
    [
        ("llama-gqa", 18),
        ("qwen2", 18),
        ("mistral", 12),
        ("qwen3", 18),
        ("phi4-mini", 18),
        ("qwen3moe", 18),
        ("mixtral", 18),
        ("gemma3", 18),
    ],
)
@pytest.mark.parametrize("temperature", [0.0, 0.3])
def test_runs_with_drafts_equal_runs_without(
    kind: str, num_blocks: int, temperature: float
) -> None:
    """Greedy, and seeded sampling: the tokens with n-gram speculation on equal those with
    it off, on a pool small enough to preempt, with prefix hits; drafts were accepted and
    rejected (rolled back) along the way. The request aborted midway has the same tokens
    as far as both runs got."""
    # Gemma 3's model of seed 11 repeats itself greedily: every draft is accepted.
    hf = tiny_hf(kind, seed=12 if kind == "gemma3" else 11)
    # Seed 8: the seeded runs of all three models accept some drafts (mistral's accept none
    # with seeds 5..7; the draws are a pure function of the seed and the output index).
    sampling = SamplingParams(temperature=temperature, seed=8, max_tokens=24, ignore_eos=True)
    off, sched_off = run(make_runner(hf, 64, BLOCK_SIZE), PROMPTS, sampling, "off", num_blocks)
    on, sched_on = run(make_runner(hf, 64, BLOCK_SIZE), PROMPTS, sampling, "ngram", num_blocks)
    aborted_on, aborted_off = on.pop(ABORTED), off.pop(ABORTED)
    n = min(len(aborted_on), len(aborted_off))
    assert n >= 6 and aborted_on[:n] == aborted_off[:n]
    assert on == off
    stats = sched_on.make_stats()
    assert stats.num_preemptions_total > 0, "no preemption"
    assert stats.kv.prefix_hits_tokens_total > 0, "no prefix hit"
    assert 0 < stats.num_spec_accepted_tokens_total < stats.num_spec_draft_tokens_total
    assert sched_off.make_stats().num_spec_draft_tokens_total == 0
    assert stats.num_generation_tokens_total == 24 * (len(PROMPTS) - 1) + len(aborted_on)
    assert stats.num_finished_total["abort"] == 1


@pytest.mark.slow
def test_embedded_model_greedy_tokens_equal_with_and_without_drafts() -> None:
    """SmolLM2 on its own Q4 weights (the fused step, the server's default): greedy
    tokens with n-gram speculation equal those without, on chat128 and edit128 prompts run
    one at a time (k + 1 fused rows) and all together (verify chunks next to prefills);
    drafts were accepted and rejected."""
    import json

    from model_runner import kernels
    from model_runner.loader import load_model

    if not kernels.available():
        pytest.skip("kernels not built")
    model = load_model(None, weights="native")
    chat = json.loads(CHAT128_PROMPTS.read_text())["prompts"]
    edit = json.loads((WORKLOADS_DIR / "prompts/edit128.json").read_text())["prompts"]
    texts = [chat[0], *edit[:2]]
    prompts = [model.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    sampling = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def greedy(speculative: str, together: bool) -> tuple[list[list[int]], Scheduler]:
        options = RunnerOptions(160, 16, dtype=torch.float32, device="cpu")
        runner = TorchRunner(model.config, model.state_dict, options)
        kv = KVCacheManager(KVCacheConfig(num_blocks=160, block_size=16))
        config = SchedulerConfig(max_model_len=1024, speculative=speculative)
        scheduler = Scheduler(config, kv)
        outputs: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            scheduler.add_request(Request(f"r{i}", list(prompt), sampling=sampling))
            outputs[f"r{i}"] = []
            while scheduler.has_unfinished_requests() and (not together or i == len(prompts) - 1):
                plan_ = scheduler.schedule()
                for out in scheduler.update(plan_, runner.execute(plan_)):
                    outputs[out.request_id].extend(out.new_token_ids)
                kv.check_invariants()
        return [outputs[f"r{i}"] for i in range(len(prompts))], scheduler

    off, _ = greedy("off", together=False)
    for together in (False, True):
        on, scheduler = greedy("ngram", together)
        assert on == off, f"together={together}"
        stats = scheduler.make_stats()
        assert 0 < stats.num_spec_accepted_tokens_total < stats.num_spec_draft_tokens_total
