"""Gemma 3 (text): interleaved sliding and global layers, (1 + w) norms around attention and
MLP, GeGLU, a scaled embedding and its own softmax scale, from its HF directory and from the
GGUF llama.cpp's converter would write, against transformers' ``Gemma3ForCausalLM``."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import pytest
import torch

from cache_manager import KVCacheConfig
from cache_manager.hybrid import HybridKVCacheManager
from model_runner import kernels
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.gguf_loader import read_header
from model_runner.hf_loader import load_hf_dir
from model_runner.loader import load_model
from model_runner.quant import QLinear, QuantWeight
from model_runner.runner import TorchRunner
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from tests.model_runner.oracle import native_gguf_runner, tiny_hf
from tests.model_runner.test_chat_templates import TEMPLATES
from tests.model_runner.test_moe import q4_k_m
from tests.model_runner.test_qwen3 import (
    NEW_TOKENS,
    PROMPTS,
    add_shape_keys,
    add_test_vocab,
    assert_top5_rule,
    engine_greedy,
    free_running,
    hf_greedy,
    runner_logits,
    write_hf_tensors,
)

# 6 layers, transformers' default pattern (every 6th global): 0-4 slide within WINDOW
# tokens, 5 sees every position. PROMPTS run to 40 tokens (+12 generated), past it.
NUM_LAYERS, WINDOW = 6, 8
GLOBAL_LAYERS = (5,)

# HF name (after ``model.layers.{i}.``) -> GGUF name (after ``blk.{i}.``), as gguf-py's
# tensor map spells Gemma 3's.
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_FILE_TYPES = {"F32": 0, "Q8_0": 7, "Q4_K_M": 15}


def tiny_gemma3(seed: int, **overrides: Any) -> torch.nn.Module:
    """6 layers of Gemma 3 (head_dim 32 over hidden 64 / 4 heads), window 8, the global
    layer's RoPE at 1e6 with linear scaling 4, the sliding ones' at 10000."""
    fields: dict[str, Any] = {"num_hidden_layers": NUM_LAYERS, "layer_types": None,
                              "sliding_window": WINDOW, **overrides}  # fmt: skip
    return tiny_hf("gemma3", seed=seed, **fields)


def converter_tensors(hf: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``hf``'s tensors as llama.cpp's ``Gemma3Model`` hands them to the writer: 1 added to
    every ``*norm.weight`` (Gemma3RMSNorm's ``1 + w``, so ggml multiplies by the weight)."""
    return {
        name: t.detach().cpu().float() + (1.0 if name.endswith("norm.weight") else 0.0)
        for name, t in hf.state_dict().items()
    }


def write_gemma3_gguf(
    hf: torch.nn.Module,
    path: Path,
    qtype: str | Callable[[str], str] = "F32",
    vocab: Callable[[gguf.GGUFWriter], None] | None = None,
) -> Path:
    """``hf`` as convert_hf_to_gguf.py's ``Gemma3Model`` writes it: arch ``gemma3``, keys
    ``gemma3.*`` (key_length = head_dim, rope.freq_base = the global layers' theta and their
    linear scaling, sliding_window; no layer pattern, local base or softmax scale), Q/K
    unpermuted, the norms +1, no output.weight (tied); 2-D weights in ``qtype``, vectors
    F32. ``vocab``: writes the vocabulary (default: placeholder BPE tokens)."""
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch="gemma3")
    writer.add_name("tiny-gemma3")
    add_shape_keys(writer, c)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    full = c.rope_parameters["full_attention"]
    writer.add_rope_freq_base(float(full["rope_theta"]))
    if full.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(full["factor"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_sliding_window(c.sliding_window)
    if c.final_logit_softcapping:
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    name = qtype if isinstance(qtype, str) else "Q4_K_M"
    writer.add_file_type(_FILE_TYPES[name])
    (vocab or (lambda w: add_test_vocab(w, c.vocab_size)))(writer)
    write_hf_tensors(writer, hf, _LAYER, _GLOBAL, qtype, converter_tensors(hf))
    return path


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    """query_pre_attn_scalar 24, not head_dim: only a config.json says so. (Seed 22: its
    greedy ids change both when the global layer slides and when the sliding ones do not;
    seed 21's do not when the global layer slides.)"""
    return tiny_gemma3(seed=22)


@pytest.fixture(scope="module")
def want(hf: torch.nn.Module) -> list[list[int]]:
    return [hf_greedy(hf, p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_gguf() -> torch.nn.Module:
    """query_pre_attn_scalar = head_dim (Gemma 3 1B-12B's): what the GGUF implies."""
    return tiny_gemma3(seed=21, query_pre_attn_scalar=32)


def test_hf_directory_serves_transformers_greedy(
    hf: torch.nn.Module, want: list[list[int]], tmp_path: Path
) -> None:
    """From the directory save_pretrained writes (transformers 5: layer_types and
    rope_parameters per layer type): the layers' windows and RoPE, the softmax scale read,
    and 4 prompts' greedy ids (fp32 weights and KV) equal transformers'."""
    hf.save_pretrained(tmp_path / "gemma3")
    config, state = load_hf_dir(tmp_path / "gemma3")
    assert (config.architecture, config.head_dim, config.query_pre_attn_scalar) == (
        "gemma3", 32, 24.0
    )  # fmt: skip
    windows = tuple(None if i in GLOBAL_LAYERS else WINDOW for i in range(NUM_LAYERS))
    assert config.layer_windows == windows and config.sliding_window is None
    assert (config.rope_theta, config.local_rope_theta) == (1e6, 10000.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.tie_word_embeddings
    got, _ = engine_greedy(config, dict(state), kv_dtype="float32")
    assert got == want


def test_image_text_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """A Gemma3ForConditionalGeneration directory (config gemma3, weights under
    language_model, a SigLIP tower): its text model is read (the tower is not), and text
    prompts' greedy ids equal transformers' image-text model's on text alone."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    text = tiny_gemma3(seed=24).config
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)  # fmt: skip
    torch.manual_seed(24)
    full = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=text.to_dict(),
            vision_config=vision,
            mm_tokens_per_image=4,
            boi_token_index=125,
            eoi_token_index=126,
            image_token_index=127,
        )
    ).eval()
    with torch.no_grad():
        for name, p in full.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
            else:
                p.normal_(0.0, 0.15)
    full.save_pretrained(tmp_path / "it")
    config, state = load_hf_dir(tmp_path / "it")
    assert config.architecture == "gemma3" and config.layer_windows[GLOBAL_LAYERS[0]] is None
    assert not [k for k in state if "vision" in k or "projector" in k]
    assert "model.layers.0.self_attn.q_norm.weight" in state
    got, _ = engine_greedy(config, dict(state), kv_dtype="float32")
    assert got == [hf_greedy(full, p) for p in PROMPTS]


def test_a_sparse_image_text_config_takes_gemma3s_defaults() -> None:
    """Gemma 3 4B's config.json (older transformers saved only the text fields that differ
    from Gemma3TextConfig's defaults, the EOS ids at the top): head_dim, vocabulary,
    softmax scale, theta, tying and the pattern are the defaults."""
    from model_runner.hf_loader import normalize_hf_config

    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_attention_heads": 8, "num_hidden_layers": 34, "num_key_value_heads": 4,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}  # fmt: skip
    cfg = {"model_type": "gemma3", "eos_token_id": [1, 106], "text_config": text}
    config = ModelConfig.from_hf_config(normalize_hf_config(cfg))
    assert (config.head_dim, config.vocab_size, config.query_pre_attn_scalar) == (256, 262208, 256)
    assert (config.rope_theta, config.local_rope_theta, config.tie_word_embeddings) == (
        1e6, 10000.0, True
    )  # fmt: skip
    assert config.eos_token_ids == (1, 106) and config.bos_token_id == 2
    assert [i for i, w in enumerate(config.layer_windows) if w is None] == [5, 11, 17, 23, 29]


def test_older_config_spellings(hf: torch.nn.Module) -> None:
    """The hub's config.json of transformers 4.5x: sliding_window_pattern, rope_theta,
    rope_local_base_freq and rope_scaling instead of layer_types and rope_parameters."""
    cfg = {k: v for k, v in hf.config.to_dict().items()
           if k not in ("layer_types", "rope_parameters")}  # fmt: skip
    cfg.update(sliding_window_pattern=3, rope_theta=1e6, rope_local_base_freq=100.0,
               rope_scaling={"rope_type": "linear", "factor": 4.0})  # fmt: skip
    config = ModelConfig.from_hf_config(cfg)
    assert config.layer_windows == tuple(None if i % 3 == 2 else WINDOW for i in range(NUM_LAYERS))
    assert (config.local_rope_theta, config.rope_scaling) == (100.0, cfg["rope_scaling"])


def test_windows_matter(hf: torch.nn.Module, want: list[list[int]]) -> None:
    """Each layer's own window is what matches transformers: on the same weights and RoPE,
    a window of 8 on every layer (``--sliding-window 8``, the model-wide mask) or on none
    (the sliding layers' windows past every position) gives other greedy ids."""
    config = ModelConfig.from_hf_config(_normalized(hf), name="tiny")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32")
    unmasked = dataclasses.replace(
        config, layer_windows=tuple(None if w is None else 10**6 for w in config.layer_windows)
    )
    runs = {}
    for name, c, o in (
        ("own", config, options),
        ("model-wide", config, dataclasses.replace(options, sliding_window=WINDOW)),
        ("none", unmasked, options),
    ):
        runner = TorchRunner(c, state, o)
        runs[name] = [free_running(runner_logits(runner), p, NEW_TOKENS)[0] for p in PROMPTS]
    assert runs["own"] == want
    assert runs["model-wide"] != want and runs["none"] != want


def _normalized(hf: torch.nn.Module) -> dict[str, Any]:
    from model_runner.hf_loader import normalize_hf_config

    return normalize_hf_config(hf.config.to_dict())


def test_converter_layout_gguf_serves_transformers_greedy(
    hf_gguf: torch.nn.Module, tmp_path: Path
) -> None:
    """From an F32 GGUF in the converter's layout: the pattern, local base and softmax scale
    derived as llama.cpp's gemma3 hparams derive them, the norms' +1 taken off (the state
    dict holds transformers' weights), and the greedy ids equal transformers'."""
    loaded = load_model(write_gemma3_gguf(hf_gguf, tmp_path / "g.gguf"))
    config = loaded.config
    windows = tuple(None if i in GLOBAL_LAYERS else WINDOW for i in range(NUM_LAYERS))
    assert (config.architecture, config.layer_windows, config.sliding_window) == (
        "gemma3", windows, None
    )  # fmt: skip
    assert (config.local_rope_theta, config.query_pre_attn_scalar) == (10000.0, 32.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.tie_word_embeddings and "lm_head.weight" not in loaded.state_dict
    ref = hf_gguf.state_dict()
    for name in ("model.norm.weight", "model.layers.5.self_attn.k_norm.weight",
                 "model.layers.2.post_feedforward_layernorm.weight"):  # fmt: skip
        torch.testing.assert_close(loaded.state_dict[name], ref[name].cpu(), rtol=0, atol=1e-7)
    got, _ = engine_greedy(config, dict(loaded.state_dict), kv_dtype="float32")
    assert got == [hf_greedy(hf_gguf, p) for p in PROMPTS]


def test_gguf_of_the_27b_takes_its_softmax_scale_by_hidden_over_heads(tmp_path: Path) -> None:
    """llama.cpp's rule for a 62-layer gemma3 file (the 27B: query_pre_attn_scalar 168 =
    5376 / 32 where head_dim is 128): the scale by hidden / heads, every 6th layer global."""
    writer = gguf.GGUFWriter(str(tmp_path / "27b.gguf"), arch="gemma3")
    writer.add_block_count(62)
    writer.add_embedding_length(5376)
    writer.add_feed_forward_length(64)
    writer.add_head_count(32)
    writer.add_head_count_kv(16)
    writer.add_key_length(128)
    writer.add_context_length(4096)
    writer.add_sliding_window(1024)
    writer.add_tensor("token_embd.weight", np.zeros((4, 5376), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _, _, config = read_header(tmp_path / "27b.gguf")
    assert (config.head_dim, config.query_pre_attn_scalar) == (128, 168.0)
    assert [i for i, w in enumerate(config.layer_windows) if w is None] == list(range(5, 62, 6))
    assert set(config.layer_windows) == {1024, None}


def test_prefix_cache_hit_answers_the_same(hf: torch.nn.Module, want: list[list[int]]) -> None:
    """The 40-token prompt (chunked: 32 tokens a step) sent again after the others hits the
    prefix cache, sliding and global layers' keys alike, and answers the same greedy ids."""
    config = ModelConfig.from_hf_config(_normalized(hf), name="tiny")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    got, requests = engine_greedy(config, state, repeat_first=True, kv_dtype="float32")
    assert requests[-1].num_cached_tokens >= 32
    assert got[:4] == want and got[4] == want[3]


def test_final_logit_softcapping(tmp_path: Path) -> None:
    """Gemma 2's ``final_logit_softcapping`` (none in Gemma 3's released configs) on a Gemma
    3 model, from config.json and from the GGUF key the converter writes: logits equal
    transformers' (every one within the cap)."""
    from tests.model_runner.oracle import assert_close, hf_logits, make_runner, plan, seq

    capped = tiny_hf("gemma3", seed=25, final_logit_softcapping=3.0, query_pre_attn_scalar=32)
    ids = PROMPTS[3]
    ref = hf_logits(capped, ids)
    assert ref.abs().max() < 3.0
    runner = make_runner(capped)
    assert runner.config.final_logit_softcapping == 3.0
    table = list(range(1, 12))
    assert_close(runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 40, table)]))["a"], ref)
    loaded = load_model(write_gemma3_gguf(capped, tmp_path / "capped.gguf"))
    assert loaded.config.final_logit_softcapping == 3.0


def test_fused_step_needs_quantized_matrices(hf: torch.nn.Module) -> None:
    """Float weights: asked for, the kernels' whole-step call is refused naming why; by
    default the runner steps layer by layer (the quantized files run it: below)."""
    config = ModelConfig.from_hf_config(_normalized(hf), name="tiny")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", fused_step=True)
    with pytest.raises(ValueError, match=r"fused_step=True but needs every layer matrix quantized"):
        TorchRunner(config, state, options)
    runner = TorchRunner(config, state, dataclasses.replace(options, fused_step=None))
    assert runner.paths.fused is None


# ---------------------------------------------------------------- tokenizer and template

_SPECIAL = {0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 105: "<start_of_turn>",
            106: "<end_of_turn>"}  # fmt: skip


def gemma_vocab(vocab_size: int) -> Callable[[gguf.GGUFWriter], None]:
    """A SentencePiece vocabulary with Gemma's special ids (pad 0, eos 1, bos 2, unk 3,
    ``<start_of_turn>`` 105, ``<end_of_turn>`` 106), as the converter writes Gemma 3's
    (``add_space_prefix`` false; no eot key), with its chat template."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = ["▁", *letters, *(f"▁{c}" for c in letters), "\n"]

    def write(writer: gguf.GGUFWriter) -> None:
        tokens, types = [], []
        normal = iter(pieces)
        for i in range(vocab_size):
            if i in _SPECIAL:
                tokens.append(_SPECIAL[i])
                types.append(2 if i == 3 else 3)  # unknown, control
            else:
                tokens.append(next(normal, f"<unused{i}>"))
                types.append(1 if tokens[-1] in pieces else 5)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(vocab_size)])
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
        writer.add_chat_template((TEMPLATES / "gemma3.jinja").read_text(encoding="utf-8"))

    return write


def test_gguf_vocabulary_special_tokens_and_template(
    hf_gguf: torch.nn.Module, tmp_path: Path
) -> None:
    """Gemma's ids load right from a GGUF: BOS 2 first, EOS 1 and ``<end_of_turn>`` (106,
    which llama.cpp's vocabulary marks end-of-generation by its text) both stop,
    ``<start_of_turn>`` is one token, and the template renders as transformers renders it."""
    from tests.model_runner.test_chat_templates import pair

    path = write_gemma3_gguf(hf_gguf, tmp_path / "v.gguf", vocab=gemma_vocab(128))
    loaded = load_model(path)
    assert loaded.config.bos_token_id == 2 and set(loaded.config.eos_token_ids) == {1, 106}
    tok = loaded.tokenizer
    assert tok is not None
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    theirs = pair("gemma3")[1]
    assert text == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text.removeprefix("<bos>"))
    assert ids[:2] == [2, 105] and ids.count(106) == 1 and 105 in ids[ids.index(106) :]


# ---------------------------------------------------------------- quantized weights

QTYPES: dict[str, Any] = {"Q8_0": "Q8_0", "Q4_K_M": q4_k_m}


def quantized_gemma3(tmp_path: Path, qtype: str) -> Path:
    """A 256-wide Gemma 3 (4 heads of 64, MLP 512; query_pre_attn_scalar = head_dim) in a
    ``qtype`` GGUF of the converter's layout (Q4_K_M: Q6_K for V and down, Q4_K else)."""
    hf = tiny_gemma3(seed=23, hidden_size=256, intermediate_size=512, head_dim=64,
                     query_pre_attn_scalar=64)  # fmt: skip
    return write_gemma3_gguf(hf, tmp_path / f"{qtype}.gguf", QTYPES[qtype])


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_quantized_gguf_is_logprobs_close_to_transformers(qtype: str, tmp_path: Path) -> None:
    """A Q8_0 / Q4_K_M file held in its formats, each matrix a kernels' ``QLinear``, every
    step one call of the kernels' whole step: vLLM's check_logprobs_close on
    4 prompts x 12 tokens against transformers holding the file's weights (where greedy
    first differs, each side's token is in the other's top-5)."""
    from benchmarks.tools.reference import build_hf_model

    path = quantized_gemma3(tmp_path, qtype)
    loaded, runner = native_gguf_runner(path)
    held = loaded.state_dict["model.layers.5.mlp.down_proj.weight"]
    assert isinstance(held, QuantWeight) and held.fmt == ("Q8_0" if qtype == "Q8_0" else "Q6_K")
    layer = runner.model.layers[5]
    assert all(isinstance(m, QLinear) for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert runner.paths.fused is not None  # the kernels' whole-step call
    dense = load_model(path, weights="float32")
    twin = build_hf_model(dense.config, dict(dense.state_dict), with_eos=False)  # type: ignore[arg-type]
    assert_top5_rule(runner, twin, PROMPTS)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
def test_quantized_chunked_and_cached_equals_one_shot(tmp_path: Path) -> None:
    """On Q4_K_M weights, the engine's run (32-token prefill chunks, the 40-token prompt sent
    again and served from the prefix cache) gives the greedy ids of each prompt prefilled
    whole in a fresh runner, token for token."""
    loaded, runner = native_gguf_runner(quantized_gemma3(tmp_path, "Q4_K_M"))
    want = [free_running(runner_logits(runner), p, NEW_TOKENS)[0] for p in PROMPTS]
    got, requests = engine_greedy(
        loaded.config, dict(loaded.state_dict), repeat_first=True, kv_dtype="float32"
    )
    assert requests[-1].num_cached_tokens >= 32
    assert got == [*want, want[3]]


@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("isa", list(reversed(kernels.ISAS)))
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K_M"])
def test_fused_step_runs_gemma3s_block_as_the_torch_path(
    qtype: str, isa: str, threads: int, tmp_path: Path
) -> None:
    """The kernels' whole-step call on Gemma 3's block (the (1 + w) norms as held, the
    sandwich norms after attention and the MLP, GeGLU with tanh GELU in the gate-up
    epilogue, QK-norm with the softmax scale in Q's, the sliding layers within their window
    of 8 on their own RoPE base, the global layer over every position) gives the torch
    path's logits and greedy tokens: prompts of 5, 19 and 33 tokens (past the window), then
    decodes; on each ISA family this CPU runs, with one thread and two."""
    from tests.model_runner.oracle import assert_fused_step_equals_torch, isa_and_threads

    path = quantized_gemma3(tmp_path, qtype)
    config = load_model(path, weights="native").config
    assert config.layer_windows[0] == 8 and config.layer_windows[5] is None
    with isa_and_threads(isa, threads):
        runner = assert_fused_step_equals_torch(path)
    kernel = runner.paths.fused.kernel  # type: ignore[union-attr]
    assert kernel.step.gelu == 1  # the tiny model's gates are too small to tell GELU by logits
    assert [layer.window for layer in kernel.layers] == [8, 8, 8, 8, 8, 0]
    assert [bool(layer.rope) for layer in kernel.layers] == [True] * 5 + [False]
    assert all(layer.attn_out_norm and layer.mlp_out_norm for layer in kernel.layers)


def hybrid_engine(
    config: ModelConfig,
    state: dict[str, Any],
    *,
    window_blocks: int,
    num_blocks: int = 64,
    repeat_first: bool = True,
    weights_dtype: str = "float32",
) -> HybridRun:
    """PROMPTS' greedy tokens (PROMPTS[3] again after the others when ``repeat_first``)
    through Scheduler + HybridKVCacheManager + TorchRunner with the sliding layers' own
    pool of ``window_blocks`` blocks of 4 tokens (global pool: ``num_blocks``), fp32 KV,
    prefill chunks of 32."""
    bs = 4
    options = RunnerOptions(
        num_blocks, bs, dtype=torch.float32, device="cpu", kv_dtype="float32",
        sliding_layer_blocks=window_blocks,
    )  # fmt: skip
    runner = TorchRunner(config, state, options)
    assert runner.pool.window_layers == (0, 1, 2, 3, 4)
    full = KVCacheConfig(num_blocks=num_blocks, block_size=bs)
    window = KVCacheConfig(num_blocks=window_blocks, block_size=bs, sliding_window=WINDOW)
    kv = HybridKVCacheManager(full, window, max_chunk_tokens=32)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=48, max_model_len=128,
            long_prefill_token_threshold=32,
        ),
        kv,
    )  # fmt: skip
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [*PROMPTS, PROMPTS[3]] if repeat_first else PROMPTS
    requests = [Request(f"q{i}", list(p), sampling=sampling) for i, p in enumerate(prompts)]
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    most_held = 0
    used: tuple[set[int], set[int]] = (set(), set())
    for step in range(500):
        if step == 0:
            for r in requests[: len(PROMPTS)]:
                scheduler.add_request(r)
        if step == 40 and repeat_first:
            scheduler.add_request(requests[-1])
        if step > 40 and not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        for seq in (*plan.prefill, *plan.decode):
            live = [b for b in seq.window_block_ids or [] if b != num_blocks]  # not the null
            most_held = max(most_held, len(live))
            used[0].update(seq.block_ids)
            used[1].update(b - num_blocks for b in live)
        result = runner.execute(plan)
        assert not result.failed, result.failed
        for out in scheduler.update(plan, result):
            outputs[out.request_id].extend(out.new_token_ids)
        kv.check_invariants()
    assert not scheduler.has_unfinished_requests()
    got = [outputs[r.request_id] for r in requests]
    preempted = scheduler.make_stats().num_preemptions_total
    return HybridRun(got, requests, kv, runner, most_held, used, preempted)


class HybridRun(NamedTuple):
    outputs: list[list[int]]
    requests: list[Request]
    kv: HybridKVCacheManager
    runner: TorchRunner
    most_held: int  # the most sliding-layer blocks a request held at once (not the null)
    used: tuple[set[int], set[int]]  # block ids the tables held: global, sliding (its own)
    num_preemptions: int


def assert_kv_only_in_used_blocks(run: HybridRun) -> None:
    """Each pool holds KV in the blocks its tables handed out and nowhere else: the sliding
    layers wrote theirs through their own tables, the global layers through theirs."""
    pool = run.runner.pool
    assert pool.window_data is not None
    for data, used in ((pool.data, run.used[0]), (pool.window_data, run.used[1])):
        written = data.abs().flatten(3).amax(dim=(0, 1, 3)) > 0
        assert set(written.nonzero().flatten().tolist()) == used


def _released_blocks(prompts: list[list[int]], block_size: int = 4) -> int:
    """Blocks a request's sliding layers release by its end: those wholly before the window
    of the last query (position len(prompt) + NEW_TOKENS - 2, the last token sampled needs
    no KV)."""
    last = [len(p) + NEW_TOKENS - 2 for p in prompts]
    return sum(max(0, q - WINDOW + 1) // block_size for q in last)


def test_sliding_layers_free_their_blocks_past_the_window(
    hf: torch.nn.Module, want: list[list[int]]
) -> None:
    """Gemma 3 with the sliding layers' KV in blocks of their own (``cache_manager.hybrid``):
    the 4 prompts (up to 40 tokens, past the window of 8; chunks of 32) and the 40-token one
    again, served from the prefix cache, give transformers' greedy ids; each sliding block
    is released once no query can see it (counted: every block wholly before the last
    query's window), a request never holds more than its window, a chunk and a partial
    block there, and at the end both pools are whole again."""
    config = ModelConfig.from_hf_config(_normalized(hf), name="tiny")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    run = hybrid_engine(config, state, window_blocks=64)
    got, requests, kv = run.outputs, run.requests, run.kv
    assert got[:4] == want and got[4] == want[3]
    assert_kv_only_in_used_blocks(run)
    assert requests[-1].num_cached_tokens >= 32
    stats = kv.make_stats()
    # The repeated prompt's hit blocks the window left behind are released at admission.
    assert stats.sliding_blocks_released_total == _released_blocks([*PROMPTS, PROMPTS[3]])
    assert run.most_held <= -(-(WINDOW + 32) // 4) + 1
    assert (stats.sliding_blocks_used, stats.num_blocks_used) == (0, 0)
    assert kv.window.num_free_blocks == kv.window.num_usable_blocks


def test_sliding_layers_own_blocks_under_preemption(
    hf: torch.nn.Module, want: list[list[int]]
) -> None:
    """A global pool too small for the 4 requests at once (14 blocks of 4: the 40-token
    prompt and its answer take 13) preempts and recomputes; a sliding pool of 3 requests'
    windows makes the 4th wait there too: the greedy ids stay transformers'."""
    config = ModelConfig.from_hf_config(_normalized(hf), name="tiny")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    run = hybrid_engine(config, state, window_blocks=3 * 11 + 1, num_blocks=14, repeat_first=False)
    assert run.outputs == want
    assert run.kv.make_stats().num_blocks_used == 0
    assert run.num_preemptions > 0


@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
def test_sliding_layers_own_blocks_through_the_kernels(tmp_path: Path) -> None:
    """On Q4_K_M weights through the kernels' whole-step call (each sliding layer reading
    its own table in its own pool): the greedy ids of each prompt prefilled whole in a
    runner with one table for every layer, token for token, prefix hit included."""
    loaded, runner = native_gguf_runner(quantized_gemma3(tmp_path, "Q4_K_M"))
    assert runner.paths.fused is not None
    want = [free_running(runner_logits(runner), p, NEW_TOKENS)[0] for p in PROMPTS]
    # A sliding pool smaller than the global one: the global ids run past its end.
    run = hybrid_engine(loaded.config, dict(loaded.state_dict), window_blocks=3 * 11 + 1)
    assert run.outputs == [*want, want[3]]
    assert run.requests[-1].num_cached_tokens >= 32
    assert_kv_only_in_used_blocks(run)
    assert run.kv.make_stats().sliding_blocks_released_total == _released_blocks(
        [*PROMPTS, PROMPTS[3]]
    )
