"""The family table: one-line refusals for what kvserve does not run, a ``llama`` GGUF with
experts read as Mixtral, and the table as the one place an architecture name is read."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from model_runner import families
from model_runner.errors import CheckpointError
from model_runner.gguf_loader import read_header
from model_runner.hf_loader import load_hf_config

ROOT = Path(__file__).resolve().parents[2]


def write_header_gguf(path: Path, arch: str, experts: int = 0) -> Path:
    """A 1-layer GGUF of ``arch``; ``experts`` > 0 writes it as llama.cpp's converter writes
    Mixtral (arch ``llama``, ``llama.expert_count``, stacked ``ffn_*_exps`` tensors, no
    ``ffn_gate``)."""
    hidden, ffn = 8, 16
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(1)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, hidden), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", np.zeros((hidden, hidden), dtype=np.float32))
    if experts:
        writer.add_tensor("blk.0.ffn_gate_inp.weight", np.zeros((experts, hidden), np.float32))
        shapes = {"gate": (ffn, hidden), "up": (ffn, hidden), "down": (hidden, ffn)}
        for name, shape in shapes.items():
            zeros = np.zeros((experts, *shape), dtype=np.float32)
            writer.add_tensor(f"blk.0.ffn_{name}_exps.weight", zeros)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def one_line(message: str) -> str:
    assert "\n" not in message and "lacks tensors" not in message, message
    return message


def test_mixtral_gguf_is_read_as_mixtral(tmp_path: Path) -> None:
    """A Mixtral GGUF (arch llama + expert_count + ffn_*_exps, no ffn_gate) is Mixtral's
    family with its experts, not a dense Llama lacking tensors."""
    _, _, config = read_header(write_header_gguf(tmp_path / "mixtral.gguf", "llama", experts=4))
    assert config.architecture == "mixtral" and config.experts is not None
    assert (config.experts.num_experts, config.experts.num_used) == (4, 2)
    assert config.experts.layers == (0,) and config.experts.intermediate_size == 16


def test_more_experts_used_than_held_is_one_line(tmp_path: Path) -> None:
    """A file using 2 experts per token of the 1 it holds fails naming the counts."""
    with pytest.raises(CheckpointError) as info:
        read_header(write_header_gguf(tmp_path / "one.gguf", "llama", experts=1))
    assert "experts used per token must be in 1..1, got 2" in one_line(str(info.value))


@pytest.mark.parametrize(
    ("arch", "says"),
    [
        ("qwen2moe", "is not supported yet (Qwen2-MoE's shared expert)"),
        ("qwen3moe", "has no experts (qwen3moe.expert_count, ffn_*_exps tensors)"),
        ("gemma2", "is not supported yet (Gemma 2's soft-capping and sliding layers)"),
        ("phimoe", "is not supported yet (Phi-3.5-MoE's sparsemixer router)"),
        (
            "gpt2",
            "is not supported; kvserve runs llama, qwen2, qwen3, phi3, qwen3moe, gemma3 GGUFs",
        ),
    ],
)
def test_other_gguf_architectures_are_refused_in_one_line(
    tmp_path: Path, arch: str, says: str
) -> None:
    """Each architecture kvserve does not run is named with why and what it runs."""
    with pytest.raises(CheckpointError) as info:
        read_header(write_header_gguf(tmp_path / f"{arch}.gguf", arch))
    assert f"a {arch!r} GGUF {says}" in one_line(str(info.value))


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"model_type": "qwen2_moe", "num_experts": 60}, "is not supported yet (Qwen2-MoE's"),
        # A llama-typed config with experts is not taken for a dense Llama.
        (
            {"model_type": "llama", "num_local_experts": 4},
            "is a mixture-of-experts model: kvserve runs mixture-of-experts only as "
            "qwen3moe, mixtral",
        ),
        ({"model_type": "gemma2"}, "is not supported yet (Gemma 2's soft-capping"),
        ({"model_type": "phi3small"}, "is not supported yet (Phi-3-small's block-sparse"),
        ({"model_type": "gpt_neox"}, "is not supported; kvserve runs llama, mistral, qwen2"),
    ],
)
def test_hf_configs_are_refused_in_one_line(
    tmp_path: Path, config: dict[str, object], says: str
) -> None:
    """config.json of a family or feature kvserve does not run: one line naming it."""
    base = {"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
            "intermediate_size": 16, "vocab_size": 4}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**base, **config}))
    with pytest.raises(CheckpointError) as info:
        load_hf_config(tmp_path)
    assert f"model_type {config['model_type']!r} {says}" in one_line(str(info.value))


def test_every_family_is_found_by_its_checkpoint_names() -> None:
    """Each row's HF model_types and GGUF archs (with experts for a mixture-of-experts row)
    lead back to it, and no two rows share one."""
    hf_types = [t for f in families.FAMILIES.values() for t in f.hf_model_types]
    archs = [(a, f.moe) for f in families.FAMILIES.values() for a in f.gguf_archs]
    assert len(hf_types) == len(set(hf_types)) and len(archs) == len(set(archs))
    for fam in families.FAMILIES.values():
        experts = {"num_experts": 4, "num_local_experts": 4} if fam.moe else {}
        for t in fam.hf_model_types:
            assert families.for_hf_config({"model_type": t, **experts}) is fam
        for a in fam.gguf_archs:
            assert families.for_gguf(a, {f"{a}.expert_count": 4} if fam.moe else {}, ()) is fam


_NAMES = {n for f in families.FAMILIES.values() for n in (f.name, *f.hf_model_types, *f.gguf_archs)}


def test_architecture_names_are_compared_only_in_the_family_modules() -> None:
    """No module of model_runner (outside families/) compares a string with a family's name:
    the loaders, model, weights and kernels' step read the table instead."""
    offenders = []
    for path in sorted((ROOT / "model_runner").rglob("*.py")):
        if "families" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            for side in (node.left, *node.comparators):
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                for v in values:
                    if isinstance(v, ast.Constant) and v.value in _NAMES:
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {v.value!r}")
    assert offenders == []
