"""Greedy continuations under continuous batching with the real Scheduler and KVCacheManager
(chunked prefill, prefix hits, preemption by a small pool) equal transformers' generate()."""

from __future__ import annotations

import pytest
import torch

from cache_manager import KVCacheConfig, KVCacheManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig, SchedulerOutput
from tests.model_runner.oracle import DEVICE, make_runner, our_config, random_ids, tiny_hf

MAX_TOKENS = 10
BLOCK_SIZE = 4
# 8 prompts of different lengths; 2, 4 and 6 share a 12-token prefix with prompt 0 (three
# full blocks), so they hit the prefix cache once prompt 0's blocks are computed.
SHARED = random_ids(12, seed=100)
PROMPTS = [
    SHARED + random_ids(5, seed=101),
    random_ids(3, seed=102),
    SHARED + random_ids(14, seed=103),
    random_ids(23, seed=104),
    SHARED + random_ids(1, seed=105),
    random_ids(9, seed=106),
    SHARED + random_ids(8, seed=107),
    random_ids(30, seed=108),
]
ARRIVAL_STEPS = [0, 0, 3, 4, 6, 9, 10, 14]


def hf_greedy(hf: torch.nn.Module, prompt: list[int]) -> list[int]:
    """transformers generate(): greedy, exactly MAX_TOKENS new tokens (no EOS stop)."""
    # generate() merges the model's own generation config (which names an EOS) into any
    # config passed in, so the EOS is switched off there.
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ids = torch.tensor([prompt], device=DEVICE)
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    assert len(tokens) == MAX_TOKENS
    return tokens


@pytest.mark.parametrize(
    ("kind", "num_blocks"),
    # Mistral releases blocks that slide out of its 8-token window, so it needs a smaller pool
    # to be forced into preemption.
    [("llama-gqa", 22), ("qwen2", 22), ("mistral", 10)],
)
def test_greedy_continuous_batching_equals_generate(kind: str, num_blocks: int) -> None:
    """8 requests arriving over 15 steps, run by Scheduler + KVCacheManager + TorchRunner
    with 8-token chunks and a small pool, produce generate()'s tokens exactly; the run
    really chunked, hit the prefix cache and preempted."""
    hf = tiny_hf(kind, seed=7)
    config = our_config(hf)
    runner = make_runner(hf, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            sliding_window=config.sliding_window,
            block_bytes=runner.pool.block_bytes,
        )
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=16,
            max_model_len=64,
            long_prefill_token_threshold=8,
        ),
        kv,
    )
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    saw_middle_chunk = False
    step = 0
    while step == 0 or scheduler.has_unfinished_requests() or step <= max(ARRIVAL_STEPS):
        for i, arrival in enumerate(ARRIVAL_STEPS):
            if arrival == step:
                scheduler.add_request(Request(f"r{i}", list(PROMPTS[i]), sampling=sampling))
        plan: SchedulerOutput = scheduler.schedule()
        saw_middle_chunk |= any(not s.do_sample for s in plan.prefill)
        result = runner.execute(plan)
        assert not result.failed, result.failed
        for out in scheduler.update(plan, result):
            outputs[out.request_id].extend(out.new_token_ids)
        kv.check_invariants()
        step += 1
        assert step < 400, "the run did not finish"

    stats = scheduler.make_stats()
    assert saw_middle_chunk, "no prompt was chunked"
    assert stats.kv.prefix_hits_tokens_total > 0, "no prefix-cache hit"
    assert stats.num_preemptions_total > 0, "no preemption"
    for i, prompt in enumerate(PROMPTS):
        assert outputs[f"r{i}"] == hf_greedy(hf, prompt), f"request r{i} ({len(prompt)} tokens)"
