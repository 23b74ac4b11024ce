"""On a GPU, every attention backend serves what transformers generates: greedy tokens under
continuous batching (chunked prefill, prefix hits, preemption) equal generate()'s exactly
in fp32, and in bf16 follow the logprobs-close rule (where the two first differ, each one's
token is in the other's top 5). Skipped without CUDA: CI has no GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.config import RunnerOptions
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from tests.model_runner.oracle import DEVICE, make_runner, our_config, plan, seq, tiny_hf
from tests.model_runner.test_continuous_batching import (
    ARRIVAL_STEPS,
    BLOCK_SIZE,
    MAX_TOKENS,
    PROMPTS,
    hf_greedy,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA attention backends need a CUDA GPU"
)
BACKENDS = [
    pytest.param(
        name,
        marks=pytest.mark.skipif(
            module is not None and importlib.util.find_spec(module) is None,
            reason=f"{module} is not installed",
        ),
    )
    for name, module in (("torch", None), ("triton", "triton"), ("flashinfer", "flashinfer"))
]


def _serve(runner, kind_window: int | None, num_blocks: int) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """PROMPTS arriving at ARRIVAL_STEPS through Scheduler + KVCacheManager + ``runner``."""
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            sliding_window=kind_window,
            block_bytes=runner.pool.block_bytes,
        )
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=16, max_model_len=64,
            long_prefill_token_threshold=8,
        ),
        kv,
    )  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    step = 0
    while step == 0 or scheduler.has_unfinished_requests() or step <= max(ARRIVAL_STEPS):
        for i, arrival in enumerate(ARRIVAL_STEPS):
            if arrival == step:
                scheduler.add_request(Request(f"r{i}", list(PROMPTS[i]), sampling=sampling))
        step_plan = scheduler.schedule()
        result = runner.execute(step_plan)
        assert not result.failed, result.failed
        for out in scheduler.update(step_plan, result):
            outputs[out.request_id].extend(out.new_token_ids)
        kv.check_invariants()
        step += 1
        assert step < 400, "the run did not finish"
    stats = scheduler.make_stats()
    assert stats.kv.prefix_hits_tokens_total > 0 and stats.num_preemptions_total > 0
    return outputs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kind", "num_blocks"), [("llama-gqa", 22), ("mistral", 10)])
def test_fp32_greedy_equals_generate(backend: str, kind: str, num_blocks: int) -> None:
    """fp32: every request's greedy tokens equal transformers' generate() exactly."""
    hf = tiny_hf(kind, seed=7)
    runner = make_runner(
        hf, num_blocks=num_blocks, block_size=BLOCK_SIZE, attention_backend=backend
    )
    assert runner.info.extra["attention_backend"] == backend
    outputs = _serve(runner, our_config(hf).sliding_window, num_blocks)
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"] == hf_greedy(hf, prompt), f"r{i} on {backend}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_greedy_is_logprobs_close_to_generate(backend: str) -> None:
    """bf16 model and KV: where our tokens first differ from generate()'s (if anywhere),
    our token is in transformers' top 5 there and theirs is in ours."""
    hf32 = tiny_hf("llama-gqa", seed=7)
    state = {k: v.detach().cpu() for k, v in hf32.state_dict().items()}
    from model_runner.runner import TorchRunner

    options = RunnerOptions(
        num_blocks=22, block_size=BLOCK_SIZE, dtype=torch.bfloat16, device=DEVICE,
        kv_dtype="bfloat16", attention_backend=backend,
    )  # fmt: skip
    runner = TorchRunner(our_config(hf32), state, options)
    hf = hf32.to(torch.bfloat16)
    outputs = _serve(runner, None, 22)
    for i, prompt in enumerate(PROMPTS):
        ours, theirs = outputs[f"r{i}"], hf_greedy(hf, prompt)
        k = next((j for j, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if k is None:
            continue
        context = list(prompt) + theirs[:k]
        with torch.no_grad():
            hf_top5 = hf(torch.tensor([context], device=DEVICE)).logits[0, -1].topk(5).indices
        blocks = list(range(-(-len(context) // BLOCK_SIZE)))
        fresh = TorchRunner(our_config(hf32), state, options)
        logits = fresh.step_logits(plan(0, prefill=[seq("x", context, 0, len(context), blocks)]))
        our_top5 = logits["x"][-1].topk(5).indices
        assert ours[k] in hf_top5.tolist(), f"r{i}: our token {ours[k]} at {k} not in HF top 5"
        assert theirs[k] in our_top5.tolist(), f"r{i}: HF token {theirs[k]} not in our top 5"
