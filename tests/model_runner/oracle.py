"""Shared pieces of the model-runner oracle tests: tiny random-weight Hugging Face models
(the reference), our runner on the same weights, and plan builders."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from model_runner.config import ModelConfig, RunnerOptions
from model_runner.constraints import ConstraintTracker
from model_runner.hf_loader import normalize_hf_config
from model_runner.loader import load_model
from model_runner.runner import TorchRunner
from model_runner.sampler import Sampler
from scheduler.output import ScheduledSeq, SchedulerOutput
from scheduler.request import SamplingParams

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0)

_COMMON = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


def tiny_hf(kind: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random-weight causal LM in fp32, eval mode, on DEVICE.

    kind: "llama" (4 heads, MHA), "llama-gqa" (4 heads / 2 KV heads, tied embeddings),
    "qwen2" (GQA + QKV bias), "mistral" (GQA + sliding window of 8 tokens), "qwen3" (GQA,
    QK-norm, head_dim 32 where hidden / heads is 16), "phi3" (GQA, fused qkv_proj and
    gate_up_proj), "phi4-mini" (phi3 with Phi-4-mini's RoPE: 3/4 of each head rotated,
    longrope with random short factors, which the 256 positions never leave, and a cos / sin
    attention factor of 1.25), "qwen3moe" (qwen3 with 8 experts of 32, top-2, renormalized;
    ``mlp_only_layers`` keeps dense MLPs), "mixtral" (mistral without a window, 4 experts of
    the 128-wide MLP, top-2), "gemma3" (GQA, head_dim 32, softmax scale 24 ** -0.5, a sliding
    layer of window 8 at base 10000 then a global one with linear RoPE scaling 4, norms of
    ``1 + w`` around 1).
    Weights are drawn wider than Hugging Face's init (std 0.02) so logits are well spread
    and greedy choices are not near-ties.
    """
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    torch.manual_seed(seed)
    common: dict[str, object] = {**_COMMON}
    for key in [k for k in overrides if k in common or k == "head_dim"]:
        common[key] = overrides.pop(key)
    if kind == "llama":
        cfg = LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=4, **overrides)
        model = LlamaForCausalLM(cfg)
    elif kind == "llama-gqa":
        cfg = LlamaConfig(
            **common,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            **overrides,
        )
        model = LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = Qwen2Config(**common, num_attention_heads=4, num_key_value_heads=2, **overrides)
        model = Qwen2ForCausalLM(cfg)
    elif kind == "mistral":
        cfg = MistralConfig(
            **common, num_attention_heads=4, num_key_value_heads=2, sliding_window=8, **overrides
        )
        model = MistralForCausalLM(cfg)
    elif kind == "qwen3":
        common.setdefault("head_dim", 32)
        cfg = Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, **overrides)
        model = Qwen3ForCausalLM(cfg)
    elif kind in ("phi3", "phi4-mini"):
        if kind == "phi4-mini":
            g = torch.Generator().manual_seed(seed)
            factors = (1.0 + 3.0 * torch.rand(2, 6, generator=g)).tolist()
            overrides.setdefault("partial_rotary_factor", 0.75)
            overrides.setdefault(
                "original_max_position_embeddings", common["max_position_embeddings"]
            )
            overrides.setdefault("rope_scaling", {"type": "longrope", "short_factor": factors[0],
                                                  "long_factor": factors[1],
                                                  "attention_factor": 1.25})  # fmt: skip
        cfg = Phi3Config(**common, num_attention_heads=4, num_key_value_heads=2, **overrides)
        model = Phi3ForCausalLM(cfg)
    elif kind == "qwen3moe":
        common.setdefault("head_dim", 32)
        moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "norm_topk_prob": True, **overrides}  # fmt: skip
        cfg = Qwen3MoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, **moe)
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "mixtral":
        moe = {"num_local_experts": 4, "num_experts_per_tok": 2, **overrides}
        cfg = MixtralConfig(**common, num_attention_heads=4, num_key_value_heads=2, **moe)
        model = MixtralForCausalLM(cfg)
    elif kind == "gemma3":
        common.setdefault("head_dim", 32)
        gemma = {"query_pre_attn_scalar": 24, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"],
                 "rope_scaling": {"rope_type": "linear", "factor": 4.0}, **overrides}  # fmt: skip
        if gemma["layer_types"] is not None:  # None: transformers' pattern (every 6th global)
            gemma["layer_types"] = gemma["layer_types"][: common["num_hidden_layers"]]
        cfg = Gemma3TextConfig(**common, num_attention_heads=4, num_key_value_heads=2, **gemma)
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    # Gemma's norms multiply by 1 + w: weights around 0 give multipliers around 1.
    low = -0.5 if kind == "gemma3" else 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(low, low + 1.0)
            else:
                p.normal_(0.0, 0.15)
    return model.to(DEVICE).eval()


def our_config(hf: torch.nn.Module) -> ModelConfig:
    return ModelConfig.from_hf_config(normalize_hf_config(hf.config.to_dict()), name="tiny")


def make_runner(
    hf: torch.nn.Module,
    num_blocks: int = 64,
    block_size: int = 4,
    *,
    sampler: Sampler | None = None,
    constraints: ConstraintTracker | None = None,
    **options: Any,
) -> TorchRunner:
    """Our fp32 runner on ``hf``'s weights, with ``RunnerOptions`` fields in ``options``.
    The KV cache is float32 unless ``kv_dtype`` says otherwise: the oracle tests hold logits
    to ATOL of transformers' fp32 cache."""
    options.setdefault("kv_dtype", "float32")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    opts = RunnerOptions(num_blocks, block_size, dtype=torch.float32, device=DEVICE, **options)
    return TorchRunner(our_config(hf), state, opts, sampler=sampler, constraints=constraints)


def native_gguf_runner(path: str | Path) -> tuple[Any, TorchRunner]:
    """A GGUF file held in its formats (``weights="native"``: each quantized matrix a
    kernels' ``QLinear``) and an fp32 runner of 8 blocks of 16 on it, fp32 KV."""
    loaded = load_model(path, weights="native")
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32")
    return loaded, TorchRunner(loaded.config, loaded.state_dict, options)


def hf_logits(hf: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Reference logits [len, V] of a full forward over ``token_ids``."""
    with torch.no_grad():
        ids = torch.tensor([list(token_ids)], device=DEVICE)
        return hf(ids).logits[0].float()


def random_ids(n: int, seed: int, vocab: int = 128) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def seq(
    request_id: str,
    all_ids: Sequence[int],
    start: int,
    end: int,
    block_ids: Sequence[int],
    do_sample: bool = True,
) -> ScheduledSeq:
    """Entry computing positions ``start .. end - 1`` of ``all_ids``."""
    return ScheduledSeq(
        request_id=request_id,
        token_ids=list(all_ids[start:end]),
        start_pos=start,
        block_ids=list(block_ids),
        sampling=GREEDY,
        do_sample=do_sample,
        all_token_ids=list(all_ids[:end]),
        num_prompt_tokens=end,
    )


def plan(
    step: int,
    prefill: Sequence[ScheduledSeq] = (),
    decode: Sequence[ScheduledSeq] = (),
    block_copies: Sequence[tuple[int, int]] = (),
) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=step,
        prefill=list(prefill),
        decode=list(decode),
        block_copies=list(block_copies),
    )


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    err = (ours.to(ref.device) - ref).abs().max().item()
    assert err <= ATOL, f"max |ours - transformers| = {err:.3e} > {ATOL}"


def assert_fused_step_equals_torch(
    path: str | Path, prompt_lens: Sequence[int] = (5, 19, 33)
) -> TorchRunner:
    """The file's model (held in its formats) through the kernels' whole-step call and
    through the torch path, fp32 KV: a step of one prefill chunk per prompt, then four
    decode steps of every prompt's row, each step one kernel call; logits within 5e-2 of
    max|logit| (the paths differ in fp32 summation orders only, which can move an int8
    activation across a rounding boundary) and the same greedy token every step. Returns
    the fused runner."""
    from tests.model_runner.test_quant import assert_close

    loaded = load_model(str(path), weights="native")
    runners = {
        fused: TorchRunner(loaded.config, loaded.state_dict,
                           RunnerOptions(16, 16, dtype=torch.float32, device="cpu",
                                         kv_dtype="float32", fused_step=fused))
        for fused in (True, False)
    }  # fmt: skip
    assert runners[True].paths.fused is not None and runners[False].paths.fused is None
    lib = runners[True].paths.fused.kernel.lib  # type: ignore[attr-defined]
    original, calls = lib.kv_step_layers, []
    lib.kv_step_layers = lambda *args: (calls.append(1), original(*args))[1]
    prompts = {f"r{i}": random_ids(n, seed=20 + i) for i, n in enumerate(prompt_lens)}
    tables, first = {}, 0
    for r, ids in prompts.items():  # room for the prompt and the 5 tokens after it
        count = -(-(len(ids) + 5) // 16)
        tables[r], first = list(range(first, first + count)), first + count
    steps = [plan(0, prefill=[seq(r, ids, 0, len(ids), tables[r]) for r, ids in prompts.items()])]
    try:
        for step in range(5):
            got, want = (runners[fused].step_logits(steps[-1]) for fused in (True, False))
            for r in prompts:
                assert_close(got[r], want[r], 5e-2)
                assert int(got[r][-1].argmax()) == int(want[r][-1].argmax())
                prompts[r] = [*prompts[r], int(want[r][-1].argmax())]
            rows = [seq(r, ids, len(ids) - 1, len(ids), tables[r]) for r, ids in prompts.items()]
            steps.append(plan(1 + step, decode=rows))
    finally:
        lib.kv_step_layers = original
    assert len(calls) == 5, "each step is one kernel call"
    return runners[True]


@contextlib.contextmanager
def isa_and_threads(isa: str, threads: int) -> Iterator[None]:
    """The kernels' ISA family ``isa`` (the test skips where this CPU lacks it) and torch's
    ``threads`` inside the block; both restored after."""
    import pytest

    from model_runner import kernels

    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    before, before_threads = kernels.isa(), torch.get_num_threads()
    kernels.use_isa(isa)
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        kernels.use_isa(before)
        torch.set_num_threads(before_threads)
