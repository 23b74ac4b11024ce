"""Phi-3 / Phi-4 (``Phi3ForCausalLM``): fused qkv_proj and gate_up_proj, partial rotary
embeddings and longrope scaling, from its HF directory and from the GGUF llama.cpp's
converter (``Phi3MiniModel``) writes, against transformers."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from model_runner import kernels
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.hf_loader import load_hf_dir
from model_runner.loader import LoadedModel, load_model
from model_runner.quant import QuantWeight
from model_runner.runner import TorchRunner
from scheduler import Request, SamplingParams
from tests.model_runner.oracle import random_ids, tiny_hf
from tests.model_runner.test_qwen3 import (
    add_shape_keys,
    assert_top5_rule,
    free_running,
    hf_greedy,
    runner_logits,
    write_hf_tensors,
)
from tests.model_runner.test_smollm2 import run_engine

NEW_TOKENS = 12
# 4 prompts; the 40-token one is longer than run_engine's prefill chunk (32 tokens).
PROMPTS = [random_ids(n, seed=90 + n) for n in (5, 11, 23, 40)]
# Every one longer than LONG_ORIGINAL: transformers rotates them with the long factors from
# the prompt on (its switch is per forward pass, on the largest position).
LONG_ORIGINAL = 16
LONG_PROMPTS = [random_ids(n, seed=95 + n) for n in (17, 23, 33, 40)]
SHORT_ORIGINAL = 64  # > 40 + 12: transformers stays on the short factors


def _factors(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(n, generator=g)).tolist()


def longrope_phi3(original: int, seed: int = 3, **overrides: Any) -> torch.nn.Module:
    """Phi-4-mini's RoPE in small: 3/4 of each 16-wide head rotated (6 pairs), longrope
    with random short and long factors in [1, 4), ``original`` of 256 positions (so the
    attention factor is sqrt(1 + ln(256 / original) / ln(original)) > 1)."""
    scaling = {"type": "longrope", "short_factor": _factors(6, 1), "long_factor": _factors(6, 2)}
    return tiny_hf("phi3", seed=seed, partial_rotary_factor=0.75, rope_scaling=scaling,
                   original_max_position_embeddings=original, **overrides)  # fmt: skip


def engine_greedy(
    config: ModelConfig,
    state: dict[str, Any],
    prompts: Sequence[Sequence[int]] = PROMPTS,
    repeat_last: bool = False,
    max_model_len: int | None = None,
    kv_dtype: str | None = None,
) -> tuple[list[list[int]], list[Request]]:
    """Each prompt's greedy tokens through Scheduler + KVCacheManager + TorchRunner (prefix
    caching on, 32-token prefill chunks); ``repeat_last`` sends the last prompt again after
    the others, so its prefill hits the cache."""
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sent = [*prompts, prompts[-1]] if repeat_last else list(prompts)
    requests = [Request(f"p{i}", list(p), sampling=sampling) for i, p in enumerate(sent)]
    arrivals = [0] * len(prompts) + ([40] if repeat_last else [])
    model = LoadedModel(config, state, None, "tiny", "")  # type: ignore[arg-type]
    outputs, _ = run_engine(
        model, list(zip(arrivals, requests, strict=True)), kv_dtype=kv_dtype,
        max_model_len=max_model_len,
    )  # fmt: skip
    return [outputs[r.request_id] for r in requests], requests


def _saved(hf: torch.nn.Module, path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    hf.save_pretrained(path)
    config, state = load_hf_dir(path)
    return config, dict(state)


def _longrope_inv_freq(hf: torch.nn.Module, factors: Sequence[float]) -> torch.Tensor:
    """transformers' formula for 6 rotary pairs of 12 dimensions, written out."""
    shape = torch.arange(0, 12, 2, dtype=torch.int64).float() / 12
    return 1.0 / (torch.tensor(factors) * hf.config.rope_parameters["rope_theta"] ** shape)


def test_hf_directory_serves_transformers_greedy(tmp_path: Path) -> None:
    """From the directory save_pretrained writes (fused qkv_proj / gate_up_proj, RoPE on the
    whole head): read as phi3, and 4 prompts' greedy ids equal transformers'."""
    hf = tiny_hf("phi3", seed=1)
    config, state = _saved(hf, tmp_path / "phi3")
    assert (config.architecture, config.head_dim, config.rotary_dim) == ("phi3", 16, None)
    assert "model.layers.0.self_attn.qkv_proj.weight" in state
    assert "model.layers.0.mlp.gate_up_proj.weight" in state
    got, _ = engine_greedy(config, state)
    assert got == [hf_greedy(hf, p) for p in PROMPTS]


def test_partial_rotary_with_short_factors(tmp_path: Path) -> None:
    """partial_rotary_factor 0.75 and longrope short factors (max_model_len within the
    original 64 positions): transformers' model really uses them (its inv_freq is the short
    formula, its cos / sin scale > 1), and our greedy ids equal its on 4 prompts."""
    hf = longrope_phi3(SHORT_ORIGINAL)
    config, state = _saved(hf, tmp_path / "phi4mini")
    assert config.rotary_dim == 12 and config.rope_scaling is not None
    assert config.rope_scaling["original_max_position_embeddings"] == SHORT_ORIGINAL
    want = [hf_greedy(hf, p) for p in PROMPTS]
    rotary = hf.model.rotary_emb
    short = _longrope_inv_freq(hf, config.rope_scaling["short_factor"])
    torch.testing.assert_close(rotary.inv_freq.cpu(), short, rtol=1e-6, atol=0)
    assert rotary.attention_scaling == pytest.approx(math.sqrt(1 + math.log(4) / math.log(64)))
    got, _ = engine_greedy(config, state, max_model_len=SHORT_ORIGINAL)
    assert got == want


def test_long_factors_past_the_original_context(tmp_path: Path) -> None:
    """Prompts past original_max_position_embeddings (16): transformers switches to the long
    factors (checked on its inv_freq after the run), and so do we (max_model_len 256 > 16):
    the greedy ids equal its. The factors matter: the same weights with the long factors
    all 1 answer otherwise."""
    hf = longrope_phi3(LONG_ORIGINAL, seed=4)
    config, state = _saved(hf, tmp_path / "phi3-128k")
    want = [hf_greedy(hf, p) for p in LONG_PROMPTS]
    long = _longrope_inv_freq(hf, config.rope_scaling["long_factor"])  # type: ignore[index]
    torch.testing.assert_close(hf.model.rotary_emb.inv_freq.cpu(), long, rtol=1e-6, atol=0)
    got, _ = engine_greedy(config, state, LONG_PROMPTS)
    assert got == want
    plain = {**config.rope_scaling, "long_factor": [1.0] * 6}  # type: ignore[dict-item]
    other = ModelConfig(**{**_fields(config), "rope_scaling": plain})
    assert engine_greedy(other, state, LONG_PROMPTS)[0] != want


def _fields(config: ModelConfig) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_hub_config_spellings_give_the_same_rope(tmp_path: Path) -> None:
    """The config.json the hub's Phi-3 / Phi-4-mini checkpoints carry (written by
    transformers 4: ``rope_scaling`` of type ``su`` or ``longrope``, ``partial_rotary_factor``
    and ``original_max_position_embeddings`` at the top level) reads as the directory
    transformers 5 saves (``rope_parameters``): the same rotary dimensions, frequencies and
    cos / sin scale, and the long factors past the original context."""
    from model_runner.hf_loader import load_hf_config
    from model_runner.rope import rope_inv_freq, rope_magnitude

    hf = longrope_phi3(LONG_ORIGINAL)
    saved, _ = _saved(hf, tmp_path / "v5")
    rope = hf.config.rope_parameters
    for kind in ("su", "longrope"):
        hub = {
            **{k: v for k, v in hf.config.to_dict().items() if k != "rope_parameters"},
            "rope_theta": rope["rope_theta"],
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": LONG_ORIGINAL,
            "rope_scaling": {"type": kind, "short_factor": rope["short_factor"],
                             "long_factor": rope["long_factor"]},
        }  # fmt: skip
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "config.json").write_text(json.dumps(hub))
        config = load_hf_config(tmp_path / kind)
        assert config.rotary_dim == saved.rotary_dim == 12
        for length in (LONG_ORIGINAL, 256):
            want = rope_inv_freq(saved, length)
            assert torch.equal(rope_inv_freq(config, length), want)
        assert torch.equal(rope_magnitude(config), rope_magnitude(saved))
    long = _longrope_inv_freq(hf, rope["long_factor"])
    assert torch.equal(rope_inv_freq(saved, 256)[:6], long)
    assert torch.equal(rope_inv_freq(saved, 256)[6:], torch.zeros(2))


def test_tied_embeddings_and_sliding_window(tmp_path: Path) -> None:
    """Tied embeddings and Phi-3-mini-4k's uniform sliding window (8 tokens here, shorter
    than 3 of the prompts): served as Mistral's window is, greedy ids equal transformers'."""
    hf = tiny_hf("phi3", seed=2, tie_word_embeddings=True, sliding_window=8)
    config, state = _saved(hf, tmp_path / "phi3-4k")
    assert config.tie_word_embeddings and config.sliding_window == 8
    assert "lm_head.weight" not in state
    got, _ = engine_greedy(config, state)
    assert got == [hf_greedy(hf, p) for p in PROMPTS]


def test_a_window_over_every_position_is_none(tmp_path: Path) -> None:
    """Phi-3-mini-128k's sliding_window (262144 over 131072 positions) covers every
    position: no window, from its config.json and from its GGUF."""
    hf = tiny_hf("phi3", seed=1, sliding_window=512)
    config, _ = _saved(hf, tmp_path / "phi3-128k")
    loaded = load_model(write_phi3_gguf(hf, tmp_path / "w.gguf"))
    assert config.sliding_window is None and loaded.config.sliding_window is None


def test_fused_rows_must_fit_the_config() -> None:
    """A qkv_proj with the wrong row count fails naming the fused projection."""
    hf = tiny_hf("phi3", seed=1)
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    name = "model.layers.0.self_attn.qkv_proj.weight"
    state[name] = state[name][:-16]
    config = ModelConfig.from_hf_config(hf.config.to_dict(), name="tiny")
    with pytest.raises(ValueError, match=r"self_attn\.q/k/v fused: 112 rows, .* 64 \+ 32 \+ 32"):
        TorchRunner(config, state, RunnerOptions(8, 16, dtype=torch.float32, device="cpu"))


# ---------------------------------------------------------------- GGUF

# HF name (after ``model.layers.{i}.``) -> GGUF name (after ``blk.{i}.``), as gguf-py's
# tensor map spells Phi-3's (``gate_up_proj`` is FFN_UP: gate rows, then up rows).
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_phi3_gguf(
    hf: torch.nn.Module,
    path: Path,
    qtype: str = "F32",
    vocab: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """``hf`` as convert_hf_to_gguf.py's ``Phi3MiniModel`` writes it: arch ``phi3``,
    rope.dimension_count = int(partial_rotary_factor * hidden) // heads, the original
    context, the sliding window (0 for none), and for longrope the attention factor
    sqrt(1 + ln(max / original) / ln(original)) plus the ``rope_factors_long`` /
    ``rope_factors_short`` tensors; fused ``attn_qkv`` / ``ffn_up``; 2-D weights in
    ``qtype`` (``kquants.quantize``), vectors F32. ``vocab`` writes the tokenizer (default:
    placeholder tokens ``t0`` ..., one per embedding row)."""
    c = hf.config
    rope = c.rope_parameters
    writer = gguf.GGUFWriter(str(path), arch="phi3")
    writer.add_name("tiny-phi3")
    max_pos = c.max_position_embeddings
    original = rope.get("original_max_position_embeddings", c.original_max_position_embeddings)
    add_shape_keys(writer, c)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rot_pct = rope.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(rot_pct * c.hidden_size) // c.num_attention_heads)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_file_type(0 if qtype == "F32" else 7)
    writer.add_sliding_window(c.sliding_window or 0)
    if rope.get("long_factor"):
        scale = max_pos / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        writer.add_rope_scaling_attn_factors(attn)
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    if vocab is not None:
        vocab(writer)
    else:
        writer.add_tokenizer_model("llama")
        writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
        writer.add_token_scores([0.0] * c.vocab_size)
        writer.add_token_types([1] * c.vocab_size)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    write_hf_tensors(writer, hf, _LAYER, _GLOBAL, qtype)  # tied (Phi-4-mini): no output
    return path


def test_converter_layout_gguf_serves_transformers_greedy(tmp_path: Path) -> None:
    """An F32 GGUF in the converter's layout (partial rotary, longrope factors as tensors,
    tied embeddings): config read back as the HF one runs, and the long prompts' greedy ids
    equal transformers'."""
    hf = longrope_phi3(LONG_ORIGINAL, seed=5, tie_word_embeddings=True)
    loaded = load_model(write_phi3_gguf(hf, tmp_path / "phi3.gguf"))
    c = loaded.config
    assert (c.architecture, c.rotary_dim, c.tie_word_embeddings) == ("phi3", 12, True)
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "longrope"
    rope = hf.config.rope_parameters
    assert c.rope_scaling["long_factor"] == pytest.approx(rope["long_factor"], rel=1e-6)
    assert c.rope_scaling["attention_factor"] == pytest.approx(
        hf.model.rotary_emb.attention_scaling, rel=1e-6
    )
    qkv = loaded.state_dict["model.layers.1.self_attn.qkv_proj.weight"]
    torch.testing.assert_close(
        qkv, hf.state_dict()["model.layers.1.self_attn.qkv_proj.weight"].cpu(), rtol=0, atol=0
    )
    got, _ = engine_greedy(c, dict(loaded.state_dict), LONG_PROMPTS)
    assert got == [hf_greedy(hf, p) for p in LONG_PROMPTS]


def test_plain_gguf_serves_transformers_greedy(tmp_path: Path) -> None:
    """Phi-3-mini-4k's GGUF layout (no rope factors, sliding_window 0, untied output):
    greedy ids equal transformers' on the 4 prompts."""
    hf = tiny_hf("phi3", seed=1)
    loaded = load_model(write_phi3_gguf(hf, tmp_path / "plain.gguf"))
    assert loaded.config.rope_scaling is None and loaded.config.sliding_window is None
    got, _ = engine_greedy(loaded.config, dict(loaded.state_dict))
    assert got == [hf_greedy(hf, p) for p in PROMPTS]


# ---------------------------------------------------------------- quantized, fused step


def _quantized_model(tmp_path: Path, qtype: str) -> tuple[torch.nn.Module, Path]:
    """A 256-wide Phi-4-mini-like model (4 heads of 64, 48 dimensions rotated, longrope
    with an original context of 16) and its ``qtype`` GGUF."""
    scaling = {"type": "longrope", "short_factor": _factors(24, 1), "long_factor": _factors(24, 2)}
    hf = tiny_hf("phi3", seed=6, hidden_size=256, intermediate_size=512,
                 partial_rotary_factor=0.75, rope_scaling=scaling,
                 original_max_position_embeddings=LONG_ORIGINAL)  # fmt: skip
    return hf, write_phi3_gguf(hf, tmp_path / f"{qtype}.gguf", qtype)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_quantized_gguf_is_logprobs_close_to_transformers(qtype: str, tmp_path: Path) -> None:
    """The 256-wide model in a Q8_0 / Q4_K GGUF, held in its format (the fused attn_qkv
    split by rows) and run by the kernels' fused step with partial rotary and long factors
    in its RoPE table: vLLM's check_logprobs_close on the 4 long prompts x 12 tokens
    against transformers' Phi3ForCausalLM holding the file's weights."""
    from benchmarks.tools.reference import build_hf_model

    _, path = _quantized_model(tmp_path, qtype)
    loaded = load_model(path, weights="native")
    held = loaded.state_dict["model.layers.0.self_attn.qkv_proj.weight"]
    assert isinstance(held, QuantWeight) and held.fmt == qtype
    dense = load_model(path, weights="float32")
    twin = build_hf_model(dense.config, dict(dense.state_dict), with_eos=False)  # type: ignore[arg-type]
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(loaded.config, loaded.state_dict, options)
    assert runner.paths.fused is not None
    assert_top5_rule(runner, twin, LONG_PROMPTS)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_fused_step_chunked_and_cached_equals_one_shot(qtype: str, tmp_path: Path) -> None:
    """Through the fused step, the engine's run (32-token prefill chunks, the 40-token
    prompt sent again and served from the prefix cache) gives the greedy ids of each prompt
    prefilled whole in a fresh runner, token for token."""
    _, path = _quantized_model(tmp_path, qtype)
    loaded = load_model(path, weights="native")
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(loaded.config, loaded.state_dict, options)
    assert runner.paths.fused is not None
    want = [free_running(runner_logits(runner), p, NEW_TOKENS)[0] for p in LONG_PROMPTS]
    got, requests = engine_greedy(
        loaded.config, dict(loaded.state_dict), LONG_PROMPTS, repeat_last=True,
        kv_dtype="float32",
    )  # fmt: skip
    assert requests[-1].num_cached_tokens >= 32
    assert got == [*want, want[3]]


# ---------------------------------------------------------------- LoRA

PHI3_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def test_peft_adapter_on_the_fused_projections(tmp_path: Path) -> None:
    """A random PEFT adapter on Phi-3's own module names (qkv_proj, gate_up_proj: one A, B's
    rows split into Q / K / V and gate / up, Q and K rows in the partial-rotary pair order):
    every position's logits equal transformers + PEFT's, and differ from the base model's."""
    from tests.model_runner.lora_oracle import peft_adapter
    from tests.model_runner.oracle import assert_close, hf_logits, make_runner
    from tests.model_runner.test_lora import logits_with

    hf = tiny_hf("phi4-mini")
    reference = peft_adapter(hf, tmp_path / "a", r=4, alpha=8, targets=PHI3_MODULES)
    runner = make_runner(hf)
    info = runner.lora.load("a", tmp_path / "a")
    assert info.target_modules == ("o_proj", "down_proj", "qkv_proj", "gate_up_proj")
    ids = random_ids(13, seed=1)
    ours = logits_with(runner, ids, runner.lora.resolve("a"))
    assert_close(ours, hf_logits(reference, ids))
    assert (ours - logits_with(runner, ids, None)).abs().max() > 0.1


def test_fused_projection_adapter_of_another_shape_is_refused(tmp_path: Path) -> None:
    """A gate_up_proj adapter made for a model with another intermediate size fails in one
    line naming the fused projection and its rows."""
    from model_runner.lora.info import AdapterError
    from tests.model_runner.lora_oracle import peft_adapter
    from tests.model_runner.oracle import make_runner

    other = tiny_hf("phi3", intermediate_size=64)
    peft_adapter(other, tmp_path / "a", r=4, alpha=8, targets=["gate_up_proj"])
    runner = make_runner(tiny_hf("phi3"))
    with pytest.raises(AdapterError, match=r"layer 0 gate_up_proj updates 128 rows; .* has 256"):
        runner.lora.load("a", tmp_path / "a")


def test_gguf_adapter_of_a_phi3_base(tmp_path: Path) -> None:
    """A GGUF LoRA of a phi3 base as llama.cpp's convert_lora_to_gguf.py names it
    (``attn_qkv``, ``ffn_up`` holding gate and up; rows unpermuted) gives PEFT's logits."""
    from tests.model_runner.lora_oracle import gguf_lora, peft_adapter
    from tests.model_runner.oracle import assert_close, hf_logits, make_runner
    from tests.model_runner.test_lora import logits_with

    hf = tiny_hf("phi4-mini")
    reference = peft_adapter(hf, tmp_path / "a", r=4, alpha=8, targets=PHI3_MODULES)
    path = gguf_lora(tmp_path / "a", tmp_path / "a.gguf", architecture="phi3", num_heads=4,
                     num_kv_heads=2)  # fmt: skip
    runner = make_runner(hf)
    info = runner.lora.load("g", path)
    assert info.kind == "gguf" and info.target_modules == (
        "o_proj", "down_proj", "qkv_proj", "gate_up_proj",
    )  # fmt: skip
    ids = random_ids(11, seed=3)
    assert_close(logits_with(runner, ids, runner.lora.resolve("g")), hf_logits(reference, ids))
