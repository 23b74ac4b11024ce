"""The embedded SmolLM2 GGUF served on its own quantization (Q4_1 matrices, Q8_0 embedding /
LM head) through kvserve's kernels, against the same weights dequantized to fp32 (slow)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from benchmarks.bench_answers import PROMPTS  # the 8 chat prompts vLLM's rule is checked on
from model_runner import kernels
from model_runner.config import RunnerOptions
from model_runner.loader import LoadedModel, load_model
from scheduler import Request, SamplingParams
from tests.model_runner.test_smollm2 import chat_ids, run_engine

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.available(), reason="kernels not built"),
]

NUM_TOKENS = 64


@pytest.fixture(scope="module")
def native() -> LoadedModel:
    return load_model(None, weights="native")


@pytest.fixture(scope="module")
def dense() -> LoadedModel:
    return load_model(None, weights="float32")


def greedy(
    model: LoadedModel, prompts: Sequence[str], together: bool, kv_dtype: str | None = None
) -> dict[str, list[int]]:
    """64 greedy tokens per prompt: all prompts in one continuous batch, or one at a time."""
    sampling = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    requests = [
        (0, Request(f"q{i}", chat_ids(model, p), sampling=sampling, eos_token_ids=(2,)))
        for i, p in enumerate(prompts)
    ]
    if together:
        return run_engine(model, requests, kv_dtype=kv_dtype)[0]
    out: dict[str, list[int]] = {}
    for item in requests:
        out.update(run_engine(model, [item], kv_dtype=kv_dtype)[0])
    return out


def forced_choices(
    model: LoadedModel,
    reference: dict[str, list[int]],
    prompts: dict[str, str],
    kv_dtype: str,
    together: bool,
) -> dict[str, list[int]]:
    """The token ``model`` picks at each of the reference's positions, fed the reference's own
    previous tokens (teacher forcing, as llama.cpp's "same top token" statistic): decode steps
    of all prompts in one batch, or of one prompt at a time (batch 1)."""
    import torch

    from model_runner.runner import TorchRunner
    from tests.model_runner.oracle import plan, seq

    block_size = 16
    options = RunnerOptions(96, block_size, dtype=torch.float32, device="cpu", kv_dtype=kv_dtype)
    runner = TorchRunner(model.config, model.state_dict, options)
    ids = {k: chat_ids(model, prompts[k]) for k in reference}
    groups = [list(reference)] if together else [[k] for k in reference]
    out: dict[str, list[int]] = {k: [] for k in reference}
    for group in groups:
        tables, next_block = {}, 1
        for k in group:
            need = -(-(len(ids[k]) + NUM_TOKENS) // block_size)
            tables[k], next_block = list(range(next_block, next_block + need)), next_block + need
        chunks = [seq(k, ids[k], 0, len(ids[k]), tables[k]) for k in group]
        logits = runner.step_logits(plan(0, prefill=chunks))
        for step in range(NUM_TOKENS):
            for k in group:
                out[k].append(int(logits[k][-1].argmax()))
            if step == NUM_TOKENS - 1:
                break
            rows = []
            for k in group:
                full = ids[k] + reference[k][: step + 1]
                rows.append(seq(k, full, len(full) - 1, len(full), tables[k]))
            logits = runner.step_logits(plan(1 + step, decode=rows))
    return out


def agreement(a: dict[str, list[int]], b: dict[str, list[int]]) -> float:
    """Share of positions where both chose the same token."""
    same = sum(x == y for k in a for x, y in zip(a[k], b[k], strict=True))
    return same / sum(len(v) for v in a.values())


def test_native_weights_are_kept_quantized(native: LoadedModel) -> None:
    """native keeps the GGUF's Q4_1 matrices and Q8_0 embedding, ~100 MB instead of ~540 MB."""
    from model_runner.quant import QuantWeight

    assert native.weights == "native"
    sources = {w.source for w in native.state_dict.values() if isinstance(w, QuantWeight)}
    assert sources == {"Q4_1", "Q8_0"}
    quant_bytes = sum(w.nbytes for w in native.state_dict.values() if isinstance(w, QuantWeight))
    assert quant_bytes < 130e6


@pytest.fixture(scope="module")
def reference(dense: LoadedModel) -> dict[str, list[int]]:
    """The dequantized-fp32 model's free-running greedy tokens (fp32 KV)."""
    return greedy(dense, PROMPTS, together=True, kv_dtype="float32")


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_greedy_tokens_agree_with_the_dequantized_model(
    native: LoadedModel, reference: dict[str, list[int]], kv_dtype: str
) -> None:
    """8 chat prompts x 64 tokens: at >= 95 % of the dequantized-fp32 model's greedy positions
    the quantized path (Q4_1/Q8_0 weights, this KV precision) picks the same token, both in
    one batch of 8 (fp32 activations) and alone (batch 1: int16 activations). Teacher-forced,
    so that one near-tie (SmolLM2 has top-2 logits 6e-4 apart on a 29 scale in these prompts)
    does not count as every later token of its prompt."""
    prompts = {f"q{i}": p for i, p in enumerate(PROMPTS)}
    batched = forced_choices(native, reference, prompts, kv_dtype, together=True)
    alone_ref = {k: reference[k] for k in list(reference)[:4]}
    alone = forced_choices(native, alone_ref, prompts, kv_dtype, together=False)
    assert agreement(batched, reference) >= 0.95
    assert agreement(alone, alone_ref) >= 0.95


def test_the_quantized_model_still_names_paris(native: LoadedModel) -> None:
    """Free-running greedy decoding on the served defaults (fp16 KV) answers Paris, batched
    with the other prompts and alone."""
    batched = greedy(native, PROMPTS, together=True)
    alone = greedy(native, PROMPTS[:1], together=False)
    for run in (batched, alone):
        assert "Paris" in native.tokenizer.decode(run["q0"], skip_special_tokens=True)


def free_running(
    model: LoadedModel, prompts: Sequence[str], together: bool
) -> list[tuple[list[int], list[object]]]:
    """NUM_TOKENS free-running greedy tokens of each prompt and each step's log-probabilities
    (fp32 KV): all prompts decoding in one batch, or one at a time (batch 1, the quantized
    path's int8-activation decode)."""
    import torch

    from model_runner.runner import TorchRunner
    from tests.model_runner.oracle import plan, seq

    block_size = 16
    ids = [chat_ids(model, p) for p in prompts]
    need = [-(-(len(x) + NUM_TOKENS) // block_size) for x in ids]
    groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
    out: list[tuple[list[int], list[object]]] = [([], []) for _ in prompts]
    for group in groups:
        blocks = sum(need[i] for i in group)
        options = RunnerOptions(blocks, block_size, dtype=torch.float32, device="cpu",
                                kv_dtype="float32")  # fmt: skip
        runner = TorchRunner(model.config, model.state_dict, options)
        tables, first = {}, 0
        for i in group:
            tables[i], first = list(range(first, first + need[i])), first + need[i]
        chunks = [seq(f"p{i}", ids[i], 0, len(ids[i]), tables[i]) for i in group]
        logits = runner.step_logits(plan(0, prefill=chunks))
        for step in range(NUM_TOKENS):
            rows = []
            for i in group:
                lp = torch.log_softmax(logits[f"p{i}"][-1].double(), dim=-1)
                tokens, logprobs = out[i]
                logprobs.append(lp)
                tokens.append(int(lp.argmax()))
                full = ids[i] + tokens
                rows.append(seq(f"p{i}", full, len(full) - 1, len(full), tables[i]))
            if step < NUM_TOKENS - 1:
                logits = runner.step_logits(plan(1 + step, decode=rows))
    return out


def test_greedy_is_logprobs_close_to_the_dequantized_model(
    native: LoadedModel, dense: LoadedModel
) -> None:
    """vLLM's check_logprobs_close on 8 prompts x 64 free-running greedy tokens: where the
    quantized path (int8 activations, Q4_1/Q8_0 weights) first differs from the dequantized
    fp32 model, each side's token is in the other's top-5, within 0.5 nats of its top."""
    assert_logprobs_close(native, dense, PROMPTS)


def assert_logprobs_close(
    model_a: LoadedModel, model_b: LoadedModel, prompts: Sequence[str]
) -> None:
    """vLLM's check_logprobs_close: free-running greedy tokens of both models (``model_a``
    one prompt at a time, the path under test; the reference ``model_b`` all prompts in one
    batch); where they first differ, each side's token is in the other's top-5, within 0.5
    nats of its top."""
    references = free_running(model_b, prompts, together=True)
    for prompt, (ours, our_lp), (ref, ref_lp) in zip(
        prompts, free_running(model_a, prompts, together=False), references, strict=True
    ):
        first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
        if first is None:
            continue
        sides = ((ours[first], ref[first], ref_lp[first]), (ref[first], ours[first], our_lp[first]))
        for mine, other, lp in sides:
            top5 = lp.topk(5).indices.tolist()  # type: ignore[attr-defined]
            assert mine in top5, f"{prompt!r} step {first}: {mine} not in the other's top-5 {top5}"
            gap = float(lp[other] - lp[mine])  # type: ignore[index]
            assert gap <= 0.5, f"{prompt!r} step {first}: {gap:.3f} nats apart"


def test_the_q4_k_m_requantization_runs_in_its_own_formats(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The embedded file requantized to Q4_K_M (llama.cpp's per-tensor rules; 576-wide rows
    fall back to Q5_0 / Q8_0, the 1,536-wide ffn_down keeps Q4_K / Q6_K) loads natively in
    those formats, and its quantized path is logprobs-close to the same file dequantized to
    fp32. (Whether it names Paris is the file's property, not the kernels': requantized from
    Q4_1, its Q5_0 tensors lose "Paris" even in fp32; see the README.)"""
    from benchmarks.tools import kquants
    from model_runner.gguf_loader import default_model_path
    from model_runner.loader import load_model
    from model_runner.quant import QuantWeight

    path = tmp_path_factory.mktemp("q4km") / "smollm2-q4km.gguf"
    kquants.requantize_gguf(str(default_model_path()), str(path), "Q4_K_M")
    native = load_model(str(path), weights="native")
    sources = {w.source for w in native.state_dict.values() if isinstance(w, QuantWeight)}
    assert sources == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert_logprobs_close(native, load_model(str(path), weights="float32"), PROMPTS[:4])
