"""GGUF files in every native K-quant and 5-bit format, written in the test (``make_random_gguf``
with kvserve's reference quantizers), loaded by kvserve and held against the ``gguf`` package's
own decoder; and a Q4_K_M requantization of a file, by llama.cpp's per-tensor rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from benchmarks.tools import kquants, make_random_gguf
from model_runner import kernels, quant
from model_runner.config import RunnerOptions
from model_runner.gguf_loader import hf_name, load_gguf_checkpoint, unpermute_qk

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")

TINY = {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("kquant-files")
    return {
        t: make_random_gguf.write(folder / f"{t}.gguf", TINY, t)
        for t in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q4_K_M")
    }


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"])
def test_loaded_weights_dequantize_like_the_gguf_package(
    files: dict[str, Path], type_name: str
) -> None:
    """Every matrix of the file stays in its own format (no int8 detour) and dequantizes to
    exactly what gguf.quants.dequantize decodes from the file (Q and K unpermuted as the
    loader does for llama files)."""
    ckpt = load_gguf_checkpoint(files[type_name], keep_quantized=True)
    reader = gguf.GGUFReader(files[type_name])
    config = ckpt.config
    checked = 0
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        held = ckpt.state_dict.get(name or "")
        if not isinstance(held, quant.QuantWeight):
            continue
        assert held.fmt == type_name == tensor.tensor_type.name
        ref = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        if ".q_proj." in name or ".k_proj." in name:  # type: ignore[operator]
            heads = config.num_heads if ".q_proj." in name else config.num_kv_heads  # type: ignore[operator]
            ref = unpermute_qk(ref, heads)
        torch.testing.assert_close(held.dequantize(), torch.from_numpy(np.ascontiguousarray(ref)),
                                   rtol=0, atol=0)  # fmt: skip
        checked += 1
    assert checked == 1 + 7 * TINY["layers"]


def assert_tracks_dequantized(native: Any, dense: Any) -> None:
    """A 20-token prefill's logits of the file held in its formats are finite and within
    int8-activation error (5e-2 of max|logit|) of the same file dequantized to fp32."""
    from model_runner.runner import TorchRunner
    from tests.model_runner.oracle import plan, random_ids, seq

    outs = []
    for model in (native, dense):
        options = RunnerOptions(16, 16, dtype=torch.float32, device="cpu")
        runner = TorchRunner(model.config, model.state_dict, options)
        ids = random_ids(20, seed=3, vocab=1000)
        outs.append(runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 20, [0, 1])]))["a"])
    assert torch.isfinite(outs[0]).all()
    scale = outs[1].abs().max().item()
    assert (outs[0] - outs[1]).abs().max().item() <= 5e-2 * scale


def test_q4_k_m_file_holds_llama_cpps_mix_and_runs(files: dict[str, Path]) -> None:
    """The Q4_K_M file has llama.cpp's mix (Q6_K for the tied output and the first/last
    layers' attn_v and ffn_down, Q4_K elsewhere); loaded natively it holds each in its own
    format (a QKV stack of Q4_K and Q6_K), about its size on disk, and gives finite logits
    equal to the dequantized-fp32 model's within int8-activation error."""
    from model_runner.loader import load_model

    reader = gguf.GGUFReader(files["Q4_K_M"])
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["token_embd.weight"] == "Q6_K"
    # llama.cpp's use_more_bits with 2 layers: layer 1 (>= 7 * 2 / 8) gets the extra bits.
    assert types["blk.1.attn_v.weight"] == "Q6_K" and types["blk.0.attn_v.weight"] == "Q4_K"
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.1.ffn_down.weight"] == "Q6_K"
    native = load_model(str(files["Q4_K_M"]), weights="native")
    dense = load_model(str(files["Q4_K_M"]), weights="float32")
    held = sum(w.nbytes for w in native.state_dict.values() if isinstance(w, quant.QuantWeight))
    on_disk = sum(t.n_bytes for t in reader.tensors if t.tensor_type.name.startswith("Q"))
    assert on_disk <= held <= 1.1 * on_disk
    assert_tracks_dequantized(native, dense)


def test_requantized_embedded_file_keeps_kquants_where_rows_allow(tmp_path: Path) -> None:
    """requantize_gguf's Q4_K_M of a file whose rows are not whole 256-blocks (576 wide)
    falls back per tensor as llama.cpp does (Q4_K -> Q5_0, Q6_K -> Q8_0), and keeps K-quants
    for the 768-wide ffn_down."""
    src = tmp_path / "wide.gguf"
    make_random_gguf.write(src, {**TINY, "hidden": 320, "heads": 5, "kv_heads": 5,
                                 "intermediate": 768}, "F16")  # fmt: skip
    chosen = kquants.requantize_gguf(str(src), str(tmp_path / "q4km.gguf"))
    assert chosen["blk.0.attn_q.weight"] == "Q5_0"
    assert chosen["token_embd.weight"] == "Q8_0"  # tied output: Q6_K, 320 wide -> Q8_0
    assert chosen["blk.0.ffn_down.weight"] == "Q4_K" and chosen["blk.1.ffn_down.weight"] == "Q6_K"
    assert chosen["blk.0.attn_norm.weight"] == "F32"


TINY_QWEN3 = {**TINY, "head_dim": 96, "qk_norm": 1}  # head_dim of its own: 4 x 96 != 256
TINY_QWEN3_MOE = {**TINY_QWEN3, "experts": 8, "experts_used": 2, "expert_intermediate": 256,
                  "output": 1}  # fmt: skip
TINY_GEMMA3 = {**TINY_QWEN3, "sliding_window": 8}


@pytest.mark.parametrize(
    "shape", [TINY_QWEN3, TINY_QWEN3_MOE, TINY_GEMMA3], ids=["qwen3", "qwen3moe", "gemma3"]
)
def test_random_files_load_as_their_family_and_answer_as_their_dequantized_weights(
    tmp_path: Path, shape: dict[str, int]
) -> None:
    """make_random_gguf's Qwen3 and Gemma 3 shapes (bench_models' random-qwen3-* and
    random-gemma3-* files) in the converter's layout: the dense one as arch qwen3 (QK-norm,
    head_dim 96 of its own), the MoE one as qwen3moe (8 experts, top 2, its own output
    matrix, experts' down stacks Q6_K in the more-bits layer), Gemma 3 as gemma3 (its
    sandwich norms, a window of 8); each loads as its family, and its Q4_K_M answers within
    int8-activation error of the same file dequantized to fp32. bench_models counts only the
    chosen experts' share of the stacks as read."""
    from benchmarks import bench_models
    from model_runner.loader import load_model

    path = make_random_gguf.write(tmp_path / "q.gguf", shape, "Q4_K_M")
    reader = gguf.GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q_norm.weight"] == "F32"
    native = load_model(str(path), weights="native")
    dense = load_model(str(path), weights="float32")
    assert native.config.head_dim == 96
    assert "model.layers.0.self_attn.q_norm.weight" in native.state_dict
    stacks = sum(t.n_bytes for t in reader.tensors if t.name.endswith("_exps.weight"))
    if shape.get("experts"):
        assert arch == "qwen3moe" and native.config.experts is not None
        assert native.config.experts.num_experts == 8 and native.config.experts.num_used == 2
        assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
        assert types["blk.1.ffn_down_exps.weight"] == "Q6_K"
        assert types["blk.0.ffn_gate_inp.weight"] == "F32"
        assert bench_models.unread_expert_bytes(path) == stacks - stacks * 2 // 8 > 0
    elif shape.get("sliding_window"):
        assert arch == "gemma3" and native.config.sliding_window == 8
        assert types["blk.1.post_ffw_norm.weight"] == "F32"
        assert "model.layers.1.post_feedforward_layernorm.weight" in native.state_dict
    else:
        assert arch == "qwen3" and native.config.experts is None
        assert stacks == 0 and bench_models.unread_expert_bytes(path) == 0
    assert_tracks_dequantized(native, dense)
