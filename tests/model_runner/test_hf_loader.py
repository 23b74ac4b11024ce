"""load_hf_dir: a local Hugging Face directory becomes (ModelConfig, state_dict) that runs
like transformers; missing or broken checkpoints say what was looked for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_runner.config import RunnerOptions
from model_runner.errors import CheckpointError
from model_runner.hf_loader import load_hf_dir, normalize_hf_config
from model_runner.runner import TorchRunner
from tests.model_runner.oracle import (
    DEVICE,
    assert_close,
    hf_logits,
    plan,
    random_ids,
    seq,
    tiny_hf,
)


def run_prefill(path: Path, ids: list[int]) -> torch.Tensor:
    config, state = load_hf_dir(path, torch.float32)
    options = RunnerOptions(16, 4, dtype=torch.float32, device=DEVICE, kv_dtype="float32")
    runner = TorchRunner(config, state, options)
    return runner.step_logits(plan(0, prefill=[seq("a", ids, 0, len(ids), list(range(8)))]))["a"]


@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "qwen2"])
def test_saved_model_loads_and_matches(tmp_path: Path, kind: str) -> None:
    """save_pretrained() output loads into a runner whose logits equal transformers'."""
    hf = tiny_hf(kind, seed=1)
    hf.save_pretrained(tmp_path)
    ids = random_ids(17, seed=2)
    assert_close(run_prefill(tmp_path, ids), hf_logits(hf, ids))


def test_tied_embeddings_have_no_lm_head(tmp_path: Path) -> None:
    """A tied checkpoint yields no lm_head.weight and a config that says it is tied."""
    tiny_hf("llama-gqa", seed=1).save_pretrained(tmp_path)
    config, state = load_hf_dir(tmp_path)
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in state
    assert config.name == tmp_path.name
    assert config.rope_theta == 500000.0


def test_sharded_checkpoint_is_read_through_its_index(tmp_path: Path) -> None:
    """A checkpoint split into shards (model.safetensors.index.json) loads every shard."""
    hf = tiny_hf("qwen2", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = random_ids(9, seed=4)
    assert_close(run_prefill(tmp_path, ids), hf_logits(hf, ids))


def test_dtype_is_applied(tmp_path: Path) -> None:
    """Floating tensors come back in the requested dtype."""
    tiny_hf("llama", seed=1).save_pretrained(tmp_path)
    _, state = load_hf_dir(tmp_path, torch.bfloat16)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}


def test_missing_directory_says_how_to_get_one(tmp_path: Path) -> None:
    """A path that does not exist names the path and how to obtain a model directory."""
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_hf_dir(missing)
    assert str(missing) in str(info.value)
    assert "huggingface-cli download" in str(info.value)


def test_missing_config_json(tmp_path: Path) -> None:
    """A directory without config.json says so."""
    with pytest.raises(CheckpointError, match=r"no config\.json in"):
        load_hf_dir(tmp_path)


def test_missing_weights_list_what_was_found(tmp_path: Path) -> None:
    """No *.safetensors: the error lists the files present and flags .bin-only checkpoints."""
    tiny_hf("llama", seed=1).config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights") as info:
        load_hf_dir(tmp_path)
    assert "pytorch_model.bin" in str(info.value)
    assert "convert them to safetensors" in str(info.value)


def test_broken_files(tmp_path: Path) -> None:
    """Unparseable config.json or safetensors give a CheckpointError naming the file."""
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_hf_dir(tmp_path)
    tiny_hf("llama", seed=1).config.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load_hf_dir(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    """A model_type kvserve does not run is refused (a CheckpointError) with its name."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported; kvserve runs"):
        load_hf_dir(tmp_path)


def test_normalize_rope_parameters() -> None:
    """transformers 5's rope_parameters become rope_theta (+ rope_scaling unless default)."""
    scaled = {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}
    assert normalize_hf_config(scaled)["rope_theta"] == 5e5
    assert normalize_hf_config(scaled)["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    plain = normalize_hf_config({"rope_parameters": {"rope_type": "default", "rope_theta": 7.0}})
    assert plain["rope_theta"] == 7.0 and "rope_scaling" not in plain
    classic = {"rope_theta": 3.0, "rope_scaling": None}
    assert normalize_hf_config(classic) == classic
