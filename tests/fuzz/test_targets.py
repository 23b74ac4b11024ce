"""The fuzz targets without atheris: each runs over its seed corpus and over every input
``make fuzz`` ever found (``fuzz/regressions/<target>/``), so a finding stays fixed."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fuzz.run import TARGET_NAMES
from fuzz.targets import TARGETS
from model_runner.errors import CheckpointError
from model_runner.gguf_loader import config_from_metadata, read_header

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"


def _inputs(kind: str, target: str) -> list[Path]:
    folder = FUZZ / kind / target
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_every_target_has_a_seed_corpus_and_a_make_fuzz_entry() -> None:
    """``make fuzz`` (fuzz.run) knows every target, and each has seeds to start from."""
    assert set(TARGET_NAMES) == set(TARGETS)
    for target in TARGETS:
        assert len(_inputs("corpus", target)) >= 2, target


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_target_takes_its_corpus_and_regressions(target: str) -> None:
    """No seed and no past finding raises (each target raises on any contract breach)."""
    for path in [*_inputs("corpus", target), *_inputs("regressions", target)]:
        TARGETS[target](path.read_bytes())


def test_gguf_array_of_2_40_items_in_896_bytes_is_refused_at_once(tmp_path: Path) -> None:
    """make fuzz found it: gguf's reader returned empty arrays past the end of the file, so
    a header declaring a 2**40-item array looped for minutes, gigabytes deep. Now the read
    past the end is a CheckpointError naming the file, in well under a second."""
    path = tmp_path / "bad.gguf"
    path.write_bytes((FUZZ / "regressions" / "gguf_header" / "huge-array-count").read_bytes())
    start = time.monotonic()
    with pytest.raises(CheckpointError) as error:
        read_header(path)
    assert time.monotonic() - start < 1.0
    assert str(path) in str(error.value)
    assert "the header runs past the end of the file" in str(error.value)


def test_gguf_metadata_string_not_utf8_is_a_checkpoint_error(tmp_path: Path) -> None:
    """make fuzz found it: a metadata string that is not UTF-8 escaped the loader as a
    UnicodeDecodeError; now a CheckpointError names the file and the key."""
    path = tmp_path / "bad.gguf"
    path.write_bytes((FUZZ / "regressions" / "gguf_header" / "utf8-metadata-string").read_bytes())
    with pytest.raises(CheckpointError) as error:
        read_header(path)
    assert "the metadata key" in str(error.value) and "UnicodeDecodeError" in str(error.value)


def test_gguf_head_count_of_zero_is_a_checkpoint_error(tmp_path: Path) -> None:
    """make fuzz found it: attention.head_count = 0 was a ZeroDivisionError (hidden //
    heads); now a CheckpointError naming the key."""
    path = tmp_path / "bad.gguf"
    path.write_bytes((FUZZ / "regressions" / "gguf_header" / "zero-head-count").read_bytes())
    with pytest.raises(CheckpointError) as error:
        read_header(path)
    assert "llama.attention.head_count must be >= 1, got 0" in str(error.value)


def test_gguf_kv_head_count_of_zero_is_a_checkpoint_error() -> None:
    """make fuzz found it (a fresh clone's run, fuzz/regressions/gguf_header/
    zero-kv-head-count): attention.head_count_kv = 0 was a ZeroDivisionError in ModelConfig
    (heads % kv heads); every size of a model config is now checked >= 1 there, and the
    loader words it as a CheckpointError naming the file. (The file itself now stops earlier,
    at a tensor without dimensions: the config path is held here directly.)"""
    metadata = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 0,
        "llama.feed_forward_length": 128,
        "llama.block_count": 2,
    }
    with pytest.raises(CheckpointError) as error:
        config_from_metadata(metadata, {"token_embd.weight": (100, 64)}, "m", "m.gguf")
    assert "'m.gguf'" in str(error.value)
    assert "num_kv_heads must be >= 1, got 0" in str(error.value)


def test_gguf_tensor_without_dimensions_is_a_checkpoint_error(tmp_path: Path) -> None:
    """make fuzz found it (a fresh clone's run): a token_embd.weight of 0 dimensions was an
    IndexError (its row count read as the vocabulary); the embedding must be 2-D."""
    path = tmp_path / "bad.gguf"
    path.write_bytes((FUZZ / "regressions" / "gguf_header" / "zero-dim-embedding").read_bytes())
    with pytest.raises(CheckpointError) as error:
        read_header(path)
    assert str(path) in str(error.value)
    assert "token_embd.weight has shape []; it must be 2-D" in str(error.value)
