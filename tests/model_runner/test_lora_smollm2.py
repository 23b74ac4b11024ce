"""LoRA on the embedded SmolLM2 (slow): a random PEFT adapter on every projection (B not
zero), against transformers + PEFT on the same weights dequantized to fp32; and the default
Q4 weights with the adapter on the kernels against that reference, by vLLM's rule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.bench_answers import PROMPTS, compare, free_running
from benchmarks.tools.reference import build_hf_model
from model_runner import kernels
from model_runner.loader import LoadedModel, load_model
from model_runner.lora.files import read_adapter
from model_runner.lora.info import adapter_key
from scheduler import LoraRef, Request, SamplingParams
from tests.model_runner.lora_oracle import peft_adapter
from tests.model_runner.test_smollm2 import chat_ids, hf_greedy, run_engine

# Each test runs SmolLM2 for 8 x 32 tokens on both sides: minutes on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

NUM_TOKENS = 32


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: on a shared 2-core machine, two threads' barriers wait on each
    other's preempted core (a step took 5-8x longer with 2 threads than with 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def dense() -> LoadedModel:
    return load_model(None, weights="float32")


@pytest.fixture(scope="module")
def reference(dense: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """transformers + PEFT: a rank-16 adapter on every projection, saved by PEFT; B scaled
    so that the answers change but stay language."""
    hf = build_hf_model(dense.config, dense.state_dict, with_eos=False)
    folder = tmp_path_factory.mktemp("smollm2-lora") / "adapter"
    model = peft_adapter(hf, folder, r=16, alpha=32, seed=11, scale_b=0.05)
    return model, folder


def test_greedy_tokens_equal_transformers_peft(
    dense: LoadedModel, reference: tuple[Any, Path]
) -> None:
    """8 chat prompts x 32 greedy tokens, all in one continuous batch (chunked prefill, the
    system prompt's prefix shared), with the adapter: exactly transformers + PEFT's tokens;
    the adapter changes the answers (of the first three prompts, at least two)."""
    peft_model, folder = reference
    ref = LoraRef("a", adapter_key("a", read_adapter(folder).digest))
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    prompts = {f"q{i}": chat_ids(dense, p) for i, p in enumerate(PROMPTS)}
    requests = [
        (i, Request(rid, ids, sampling=sampling, eos_token_ids=(2,), lora=ref))
        for i, (rid, ids) in enumerate(prompts.items())
    ]
    outputs, _ = run_engine(dense, requests, adapters={"a": folder})
    base = peft_model.get_base_model()
    changed = 0
    for i, (rid, ids) in enumerate(prompts.items()):
        want = hf_greedy(peft_model, ids, NUM_TOKENS)
        assert outputs[rid] == want, (rid, dense.tokenizer.decode(want))
        if i < 3:
            with peft_model.disable_adapter():
                changed += want != hf_greedy(base, ids, NUM_TOKENS)
    assert changed >= 2, changed


@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
def test_q4_weights_hold_vllms_rule_against_the_fp32_reference(
    dense: LoadedModel, reference: tuple[Any, Path]
) -> None:
    """The default Q4_1 weights on the kernels, the adapter in fp16 inside the fused step:
    for each of the 8 prompts, 32 free-running greedy tokens against transformers + PEFT on
    the fp32 weights; where they first differ, each side's token is in the other's top 5
    within 0.5 nats (vLLM's check_logprobs_close)."""
    peft_model, folder = reference
    native = load_model(None, weights="native")
    rows = []
    for prompt in PROMPTS:
        ids = chat_ids(dense, prompt)
        ours = free_running(native, ids, NUM_TOKENS, adapter=folder)
        rows.append(compare("smollm2+lora", prompt, ours, peft_free_running(peft_model, ids), ""))
    failed = [r for r in rows if not r.ok]
    assert not failed, failed


def peft_free_running(model: Any, ids: list[int]) -> tuple[list[int], list[object]]:
    """transformers + PEFT's greedy tokens after ``ids`` and each step's log-probabilities
    (float64): the prompt's forward, then one token a step on transformers' KV cache."""
    out: list[int] = []
    logprobs: list[object] = []
    step, cache = torch.tensor([ids]), None
    with torch.no_grad():
        for _ in range(NUM_TOKENS):
            result = model(step, cache=cache, use_cache=True)
            cache = result.cache
            lp = torch.log_softmax(result.logits[0, -1].double(), dim=-1)
            logprobs.append(lp)
            out.append(int(lp.argmax()))
            step = torch.tensor([[out[-1]]])
    return out, logprobs
