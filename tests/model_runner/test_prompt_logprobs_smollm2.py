"""Prompt logprobs of the embedded SmolLM2 GGUF on kvserve's defaults (its Q4_1 / Q8_0 weights
on kvserve's CPU kernels, fp16 KV) against transformers holding the same file's weights
dequantized to fp32: vLLM's logprobs-close rule at every prompt position (slow)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from benchmarks.tools.reference import build_hf_model
from cache_manager import KVCacheConfig, KVCacheManager
from model_runner import kernels
from model_runner.config import RunnerOptions
from model_runner.loader import LoadedModel, load_model
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import TokenLogprobs
from tests.model_runner.test_smollm2 import chat_ids

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.available(), reason="kernels not built"),
]

TOP_N = 5
# Measured: at most 0.011 nats between the two sides' logprob of a prompt token (the chat
# prompts; 0.0034 on the plain text): the bound leaves 9x margin (docs/api.md).
MAX_GAP = 0.1
BLOCK_SIZE = 16
QUESTIONS = ["What is the capital of France?"]
ANSWER = "The capital of France is Paris.<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n"
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and"


@pytest.fixture(scope="module")
def native() -> LoadedModel:
    return load_model(None, weights="native")


@pytest.fixture(scope="module")
def hf_model() -> Any:
    pytest.importorskip("transformers")
    dense = load_model(None, weights="float32")
    return build_hf_model(dense.config, dense.state_dict)


def score(
    model: LoadedModel, prompts: list[list[int]], then_plain: list[int]
) -> tuple[dict[str, Any], dict[str, int]]:
    """Scheduler + KVCacheManager + TorchRunner on the served defaults (fp16 KV, 48-token
    chunks) run each prompt after the other with prompt_logprobs 5 (r0, r1, ...), then
    ``then_plain`` without ("plain"): each scoring request's prompt logprobs and the cached
    tokens each request's first output reports."""
    from model_runner.runner import TorchRunner

    options = RunnerOptions(64, BLOCK_SIZE, dtype=torch.float32, device="cpu", kv_dtype="float16")
    runner = TorchRunner(model.config, model.state_dict, options)
    kv = KVCacheManager(
        KVCacheConfig(num_blocks=64, block_size=BLOCK_SIZE, block_bytes=runner.pool.block_bytes)
    )
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=48,
        max_model_len=512,
        long_prefill_token_threshold=48,
    )
    scheduler = Scheduler(config, kv)
    plain = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    scoring = replace(plain, prompt_logprobs=TOP_N)
    requests = [Request(f"r{i}", list(ids), sampling=scoring) for i, ids in enumerate(prompts)]
    requests.append(Request("plain", list(then_plain), sampling=plain))
    scored: dict[str, Any] = {}
    cached: dict[str, int] = {}
    for request in requests:
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            result = runner.execute(plan)
            assert not result.failed, result.failed
            for out in scheduler.update(plan, result):
                cached.setdefault(out.request_id, out.num_cached_tokens)
                if out.prompt_logprobs is not None:
                    scored[out.request_id] = out.prompt_logprobs
            kv.check_invariants()
    return scored, cached


def gaps(hf_model: Any, ids: list[int], ours: list[TokenLogprobs]) -> torch.Tensor:
    """Per prompt position: |kvserve's - transformers' logprob of the prompt token|, after
    checking each side's top-1 is in the other's top-5."""
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].double().log_softmax(dim=-1)[:-1]
    assert [s.token_id for s in ours] == ids[1:]
    ref_top = ref.topk(TOP_N, dim=-1).indices.tolist()
    for pos, (s, theirs) in enumerate(zip(ours, ref_top, strict=True)):
        mine = [t for t, _ in s.top]
        assert len(mine) == TOP_N
        assert mine[0] in theirs, f"position {pos}: our top-1 {mine[0]} not in {theirs}"
        assert theirs[0] in mine, f"position {pos}: its top-1 {theirs[0]} not in {mine}"
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    return (torch.tensor([s.logprob for s in ours], dtype=torch.float64) - want).abs()


def test_prompt_logprobs_on_the_defaults_are_logprobs_close_to_transformers(
    native: LoadedModel, hf_model: Any
) -> None:
    """A chat prompt, the same prompt with an answer and a second question after it (its
    first blocks are the first prompt's, in the cache) and a plain text, prefilled in
    48-token chunks: at every prompt position each side's top-1 token is in the other's
    top-5 and the prompt token's logprobs are within MAX_GAP nats; the sharer took no prefix
    hit (it scores its whole prompt) and its scores of the shared positions are the first
    prompt's; a later request without prompt logprobs hits the full blocks they cached."""
    tok = native.tokenizer
    first = chat_ids(native, QUESTIONS[0])
    sharer = first + tok.encode(ANSWER, add_special_tokens=False)
    prompts = [first, sharer, [1, *tok.encode(TEXT, add_special_tokens=False)]]
    assert len(first) >= 2 * BLOCK_SIZE  # the sharer's first full blocks are the first's
    scored, cached = score(native, prompts, then_plain=sharer)
    assert cached == {"r0": 0, "r1": 0, "r2": 0, "plain": len(sharer) // BLOCK_SIZE * BLOCK_SIZE}
    worst = [float(gaps(hf_model, ids, scored[f"r{i}"]).max()) for i, ids in enumerate(prompts)]
    first_rows = [(s.logprob, s.top) for s in scored["r0"]]
    assert [(s.logprob, s.top) for s in scored["r1"][: len(first) - 1]] == first_rows
    assert max(worst) <= MAX_GAP, worst
