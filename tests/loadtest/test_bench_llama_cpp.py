"""make bench's llama.cpp peer: finding the cached build, its flags and the table cells.

No test here downloads or builds llama.cpp: a missing build is a reason, and a stand-in
script plays the cached binary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks.bench_llama_cpp import (
    LLAMA_CPP_PYTHON_VERSION,
    LlamaCpp,
    binary_path,
    default_cache_dir,
    find_llama_cpp,
    llama_cpp_note,
    server_args,
)
from benchmarks.cpu.chat128 import _llama_cpp_columns
from benchmarks.harness.report import Row
from benchmarks.run_all import parse_levels


def _peer(tok_s: float, itl_p99_s: float, failed: int = 0) -> dict[str, Any]:
    return {
        "output_token_throughput_tps": tok_s,
        "latency_s": {"itl": {"p99": itl_p99_s}},
        "requests": {"failed": failed, "interrupted": 0},
    }


def test_cache_dir_follows_the_environment() -> None:
    """$KVSERVE_CACHE_DIR wins; otherwise ~/.cache/kvserve; then llama.cpp/<version>."""
    assert default_cache_dir({"KVSERVE_CACHE_DIR": "/c"}) == Path(
        f"/c/llama.cpp/{LLAMA_CPP_PYTHON_VERSION}"
    )
    assert default_cache_dir({}, "9.9") == Path.home() / ".cache/kvserve/llama.cpp/9.9"


def test_missing_build_is_a_reason_without_building(tmp_path: Path) -> None:
    """--llama-cpp cached on an empty cache builds nothing and says where it looked."""
    found = find_llama_cpp("cached", tmp_path)
    assert found == LlamaCpp(None, f"no cached build at {tmp_path}/bin/llama-server")
    assert list(tmp_path.iterdir()) == []
    assert find_llama_cpp("off", tmp_path) == LlamaCpp(None, "--llama-cpp off")
    note = llama_cpp_note(found, threads=2)
    assert (
        note == f"llama.cpp: not measured in this run (no cached build at {binary_path(tmp_path)})."
    )


def test_a_cached_binary_is_found_with_its_version(tmp_path: Path) -> None:
    """A runnable bin/llama-server is used as is; its --version line names the build."""
    path = binary_path(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("#!/bin/sh\necho 'version: 42 (abc123)' >&2\necho 'built with cc' >&2\n")
    path.chmod(0o755)
    assert find_llama_cpp("build", tmp_path) == LlamaCpp(path, version="42 (abc123)")
    path.write_text("#!/bin/sh\nexit 1\n")
    assert find_llama_cpp("cached", tmp_path).binary is None


def test_server_args_are_the_measured_configuration() -> None:
    """Same GGUF, N threads for decode and batch, flash attention on, 32 slots x 512 tokens."""
    assert server_args(Path("/m.gguf"), 8080, 2) == [
        "--model", "/m.gguf", "--host", "127.0.0.1", "--port", "8080",
        "--threads", "2", "--threads-batch", "2",
        "--flash-attn", "on", "--cont-batching",
        "--parallel", "32", "--ctx-size", "16384", "--no-webui",
    ]  # fmt: skip


def test_llama_cpp_cells_and_ratios() -> None:
    """The kvserve row gets llama.cpp's tok/s and ITL p99 and the ratios against issue 10's
    targets; a missing peer fills only the tok/s cell, with the reason."""
    kv = Row("chat128", "32 users", "kvserve", out_tok_s=120.0, itl_p99_ms=250.0)
    _llama_cpp_columns(kv, _peer(40.0, 0.5), users=32, full=True)
    assert (kv.llama_cpp_tok_s, kv.llama_cpp_itl_p99_ms) == (40.0, 500.0)
    assert kv.vs_llama_cpp == (
        "3.00x tok/s (target >= 3x: met); ITL p99 0.50x (target <= 0.5x: met)"
    )
    kv = Row("chat128", "1 user", "kvserve", out_tok_s=20.0, itl_p99_ms=40.0)
    _llama_cpp_columns(kv, _peer(50.0, 0.02, failed=1), users=1, full=True)
    assert kv.vs_llama_cpp == (
        "0.40x tok/s (target >= 1.3x: MISSED); ITL p99 2.00x; "
        "1 llama.cpp requests failed or interrupted"
    )
    kv = Row("chat128", "2 users", "kvserve", out_tok_s=20.0, itl_p99_ms=40.0)
    _llama_cpp_columns(kv, _peer(10.0, 0.08), users=2, full=False)
    assert kv.vs_llama_cpp == "2.00x tok/s; ITL p99 0.50x"
    kv = Row("chat128", "8 users", "kvserve", out_tok_s=20.0)
    _llama_cpp_columns(kv, "cmake build failed (exit 1; log: /x)", users=8, full=True)
    assert kv.llama_cpp_tok_s == "not measured: cmake build failed (exit 1; log: /x)"
    assert (kv.llama_cpp_itl_p99_ms, kv.vs_llama_cpp) == (None, "")


def test_chat_levels_parse() -> None:
    """--chat-levels 1:4,8:16 gives (users, requests) pairs; malformed or zero is an error."""
    assert parse_levels("1:4, 8:16") == ((1, 4), (8, 16))
    for bad in ("1", "1:0", "a:2", "1:4,"):
        with pytest.raises(ValueError, match="--chat-levels"):
            parse_levels(bad)
