"""Qwen3 (dense): QK-norm and a free head_dim, from its HF directory and from the GGUF
llama.cpp's converter would write, against transformers' ``Qwen3ForCausalLM``."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from benchmarks.tools import kquants
from model_runner import kernels
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.hf_loader import load_hf_dir
from model_runner.loader import LoadedModel, load_model
from model_runner.quant import QuantWeight
from model_runner.runner import TorchRunner
from scheduler import Request, SamplingParams
from tests.model_runner.oracle import plan, random_ids, seq, tiny_hf
from tests.model_runner.test_smollm2 import run_engine

NEW_TOKENS = 12
# 4 prompts; the 40-token one is longer than run_engine's prefill chunk (32 tokens).
PROMPTS = [random_ids(n, seed=70 + n) for n in (5, 11, 23, 40)]

# HF name (after ``model.layers.{i}.``) -> GGUF name (after ``blk.{i}.``), as llama.cpp's
# tensor map (gguf-py's constants) spells Qwen3's.
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def write_qwen3_gguf(hf: torch.nn.Module, path: Path, qtype: str = "F32") -> Path:
    """``hf`` as llama.cpp's convert_hf_to_gguf.py writes a Qwen3 (arch ``qwen3``, keys
    ``qwen3.*``, key_length = head_dim, Q/K rows unpermuted, the QK-norms ``attn_q_norm`` /
    ``attn_k_norm``), 2-D weights in ``qtype`` (via ``kquants.quantize``), vectors F32."""
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch="qwen3")
    writer.add_name("tiny-qwen3")
    add_shape_keys(writer, c)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_dimension_count(c.head_dim)
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 1e6)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_file_type(0 if qtype == "F32" else 7)
    add_test_vocab(writer, c.vocab_size)
    write_hf_tensors(writer, hf, _LAYER, _GLOBAL, qtype)
    return path


def add_shape_keys(writer: gguf.GGUFWriter, c: Any) -> None:
    """The converter's shape keys of HF config ``c``: layers, context, widths, heads."""
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)


def add_test_vocab(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """A BPE vocabulary of ``vocab_size`` placeholder tokens, BOS 1 and EOS 2."""
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab_size)])
    writer.add_token_types([1] * vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_hf_tensors(
    writer: gguf.GGUFWriter,
    hf: torch.nn.Module,
    layer: dict[str, str],
    global_: dict[str, str],
    qtype: str | Callable[[str], str],
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """``hf``'s tensors (or ``tensors``, HF-named) under their GGUF names (``layer``: after
    ``model.layers.{i}.`` -> after ``blk.{i}.``; ``global_``: whole names), 2-D weights and
    3-D expert stacks (one matrix per expert) in ``qtype`` (via ``kquants.quantize``; a
    function: of the GGUF name), vectors and a MoE router (``ffn_gate_inp``, which the
    converter keeps F32) F32; a tied ``lm_head`` is left out (the checkpoint, and so the
    file, has no output). Then the file is written and closed."""
    tied = hf.config.tie_word_embeddings
    for name, tensor in (tensors if tensors is not None else hf.state_dict()).items():
        if name == "lm_head.weight" and tied:
            continue
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gguf_name = f"blk.{i}.{layer[rest]}"
        else:
            gguf_name = global_[name]
        data = tensor.detach().cpu().float().numpy()
        kind_name = qtype(gguf_name) if callable(qtype) else qtype
        if data.ndim in (2, 3) and kind_name != "F32" and "ffn_gate_inp" not in gguf_name:
            kind = getattr(gguf.GGMLQuantizationType, kind_name)
            rows = kquants.quantize(data.reshape(-1, data.shape[-1]), kind_name)
            writer.add_tensor(gguf_name, rows.reshape(*data.shape[:-1], -1), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def hf_greedy(hf: torch.nn.Module, prompt: Sequence[int], n: int = NEW_TOKENS) -> list[int]:
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None,
                           pad_token_id=0, bos_token_id=None)  # fmt: skip
    hf.generation_config.eos_token_id = None  # a fixed n tokens, as ignore_eos does
    with torch.no_grad():
        ids = torch.tensor([list(prompt)], device=hf.device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
    return list(out[0, len(prompt) :].tolist())


def engine_greedy(
    config: ModelConfig,
    state: dict[str, Any],
    repeat_first: bool = False,
    kv_dtype: str | None = None,
) -> tuple[list[list[int]], list[Request]]:
    """Every prompt's greedy tokens through Scheduler + KVCacheManager + TorchRunner (prefix
    caching on, 32-token prefill chunks); ``repeat_first`` sends PROMPTS[3] again after the
    others, so its prefill hits the cache."""
    sampling = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [*PROMPTS, PROMPTS[3]] if repeat_first else PROMPTS
    requests = [Request(f"q{i}", list(p), sampling=sampling) for i, p in enumerate(prompts)]
    arrivals = [0] * len(PROMPTS) + ([40] if repeat_first else [])
    model = LoadedModel(config, state, None, "tiny", "")  # type: ignore[arg-type]
    outputs, _ = run_engine(model, list(zip(arrivals, requests, strict=True)), kv_dtype=kv_dtype)
    return [outputs[r.request_id] for r in requests], requests


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return tiny_hf("qwen3", seed=4)


@pytest.fixture(scope="module")
def want(hf: torch.nn.Module) -> list[list[int]]:
    return [hf_greedy(hf, p) for p in PROMPTS]


def test_hf_directory_serves_transformers_greedy(
    hf: torch.nn.Module, want: list[list[int]], tmp_path: Path
) -> None:
    """From the directory save_pretrained writes (Qwen3ForCausalLM, head_dim 32 over hidden
    64 / 4 heads): config read as qwen3, and 4 prompts' greedy ids equal transformers'."""
    hf.save_pretrained(tmp_path / "qwen3")
    config, state = load_hf_dir(tmp_path / "qwen3")
    assert (config.architecture, config.head_dim, config.num_heads) == ("qwen3", 32, 4)
    assert config.attention_bias is False and config.sliding_window is None
    got, _ = engine_greedy(config, dict(state))
    assert got == want


def test_converter_layout_gguf_serves_transformers_greedy(
    hf: torch.nn.Module, want: list[list[int]], tmp_path: Path
) -> None:
    """From an F32 GGUF in the converter's layout (arch qwen3, attn_q_norm / attn_k_norm,
    key_length 32): the same greedy ids as transformers on the 4 prompts."""
    loaded = load_model(write_qwen3_gguf(hf, tmp_path / "q.gguf"))
    assert (loaded.config.architecture, loaded.config.head_dim) == ("qwen3", 32)
    for name in ("q_norm", "k_norm"):
        torch.testing.assert_close(
            loaded.state_dict[f"model.layers.1.self_attn.{name}.weight"],
            hf.state_dict()[f"model.layers.1.self_attn.{name}.weight"].cpu(), rtol=0, atol=0,
        )  # fmt: skip
    got, _ = engine_greedy(loaded.config, dict(loaded.state_dict))
    assert got == want


def test_tied_embeddings_gguf_serves_transformers_greedy(tmp_path: Path) -> None:
    """Qwen3-0.6B's layout, tied embeddings (no output.weight in the file): the LM head is
    the embedding, and the greedy ids equal transformers'."""
    tied = tiny_hf("qwen3", seed=6, tie_word_embeddings=True)
    loaded = load_model(write_qwen3_gguf(tied, tmp_path / "tied.gguf"))
    assert loaded.config.tie_word_embeddings and "lm_head.weight" not in loaded.state_dict
    got, _ = engine_greedy(loaded.config, dict(loaded.state_dict))
    assert got == [hf_greedy(tied, p) for p in PROMPTS]


def test_prefix_cache_hit_answers_the_same(hf: torch.nn.Module, want: list[list[int]]) -> None:
    """The 40-token prompt sent again after the others hits the prefix cache (blocks of the
    first run reused, QK-normed keys and all) and answers the same greedy ids."""
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    config = ModelConfig.from_hf_config(hf.config.to_dict(), name="tiny")
    got, requests = engine_greedy(config, state, repeat_first=True)
    assert requests[-1].num_cached_tokens >= 32
    assert got[:4] == want and got[4] == want[3]


def test_missing_qk_norm_is_named(hf: torch.nn.Module) -> None:
    """A Qwen3 state dict without its q_norm weights fails naming them."""
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items() if "q_norm" not in k}
    config = ModelConfig.from_hf_config(hf.config.to_dict(), name="tiny")
    with pytest.raises(ValueError, match=r"lacks 2 weights .*self_attn\.q_norm\.weight"):
        TorchRunner(config, state, RunnerOptions(8, 16, dtype=torch.float32, device="cpu"))


# ---------------------------------------------------------------- quantized weights


def free_running(step: Any, prompt: Sequence[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` free-running greedy tokens and each step's log-probabilities, ``step(ids)``
    giving the next token's logits."""
    tokens: list[int] = []
    logprobs: list[torch.Tensor] = []
    for _ in range(n):
        lp = torch.log_softmax(step([*prompt, *tokens]).double(), dim=-1)
        logprobs.append(lp)
        tokens.append(int(lp.argmax()))
    return tokens, logprobs


def runner_logits(runner: TorchRunner) -> Any:
    def step(ids: list[int]) -> torch.Tensor:
        table = list(range(8))
        rows = [seq("a", ids, 0, len(ids), table)]
        return runner.step_logits(plan(0, prefill=rows))["a"][-1]

    return step


def hf_logits_fn(hf: torch.nn.Module) -> Any:
    def step(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([ids], device=hf.device)).logits[0, -1].float().cpu()

    return step


def quantized_qwen3(tmp_path: Path, qtype: str) -> tuple[torch.nn.Module, Path]:
    """A 256-wide Qwen3 (head_dim 128 over 4 heads: 512 != 256) and its ``qtype`` GGUF."""
    hf = tiny_hf("qwen3", seed=5, hidden_size=256, intermediate_size=512, head_dim=128)
    return hf, write_qwen3_gguf(hf, tmp_path / f"{qtype}.gguf", qtype)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_quantized_gguf_is_logprobs_close_to_transformers(qtype: str, tmp_path: Path) -> None:
    """A 256-wide Qwen3 (head_dim 128, 4 heads) in a Q8_0 / Q4_K GGUF, held in its format and
    run by the kernels' fused step: vLLM's check_logprobs_close on 4 prompts x 12 tokens
    against transformers' Qwen3ForCausalLM holding the file's weights (where greedy first
    differs, each side's token is in the other's top-5)."""
    from benchmarks.tools.reference import build_hf_model

    _, path = quantized_qwen3(tmp_path, qtype)
    loaded = load_model(path, weights="native")
    held = loaded.state_dict["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(held, QuantWeight) and held.fmt == qtype
    dense = load_model(path, weights="float32")
    twin = build_hf_model(dense.config, dict(dense.state_dict), with_eos=False)  # type: ignore[arg-type]
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(loaded.config, loaded.state_dict, options)
    assert runner.paths.fused is not None  # the kernels' whole-step call, QK-norm inside
    assert_top5_rule(runner, twin, PROMPTS)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.available(), reason="kernels not built")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_fused_step_chunked_and_cached_equals_one_shot(qtype: str, tmp_path: Path) -> None:
    """Through the fused step, the engine's run (32-token prefill chunks, the 40-token prompt
    sent again and served from the prefix cache) gives the greedy ids of each prompt
    prefilled whole in a fresh runner, token for token."""
    _, path = quantized_qwen3(tmp_path, qtype)
    loaded = load_model(path, weights="native")
    options = RunnerOptions(8, 16, dtype=torch.float32, device="cpu", kv_dtype="float32")
    runner = TorchRunner(loaded.config, loaded.state_dict, options)
    assert runner.paths.fused is not None
    want = [free_running(runner_logits(runner), p, NEW_TOKENS)[0] for p in PROMPTS]
    got, requests = engine_greedy(
        loaded.config, dict(loaded.state_dict), repeat_first=True, kv_dtype="float32"
    )
    assert requests[-1].num_cached_tokens >= 32
    assert got == [*want, want[3]]


def assert_top5_rule(runner: TorchRunner, twin: Any, prompts: Sequence[Sequence[int]]) -> None:
    """vLLM's rule on each prompt's free-running greedy tokens: where ``runner``'s and the
    transformers ``twin``'s first differ, each side's token is in the other's top-5."""
    for prompt in prompts:
        ours, our_lp = free_running(runner_logits(runner), prompt, NEW_TOKENS)
        ref, ref_lp = free_running(hf_logits_fn(twin), prompt, NEW_TOKENS)
        first = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b), None)
        if first is None:
            continue
        for mine, lp in ((ours[first], ref_lp[first]), (ref[first], our_lp[first])):
            top5 = lp.topk(5).indices.tolist()
            assert mine in top5, f"{prompt} step {first}: {mine} not in the other's top-5 {top5}"
