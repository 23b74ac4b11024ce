"""Building the kernels (model_runner/kernels/build.py): side by side, and with progress."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from model_runner.kernels import build

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")

SCRIPT = """
import sys
from model_runner.kernels import build
print("LIB", build.build(None, lambda line: print("SAY", line, flush=True)), flush=True)
"""


def test_builds_side_by_side_compile_once_and_agree(tmp_path: Path) -> None:
    """Three processes that want the same library at once: one compiles it (progress lines
    name the library, objects done of all, seconds), the others wait and take its file;
    all three name the same whole library, and no temporary file is left behind."""
    env = {**os.environ, "KVSERVE_KERNEL_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", SCRIPT], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    libs = {line for out in outs for line in out.splitlines() if line.startswith("LIB")}
    assert libs == {f"LIB {tmp_path / build.library_name(None)}"}
    done = [line for out in outs for line in out.splitlines() if line.endswith("(done)")]
    assert len(done) == 1
    assert done[0].startswith("SAY kvserve kernels: dispatcher, 1 of 1 objects, ")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        build.library_name(None)
    ]


def test_a_family_is_one_object_per_format_and_a_core() -> None:
    """A split family compiles each KV_FORMATS format's tiles apart (in parallel), the
    K-quants first, and its core; the portable family is one object."""
    names = [name for name, _ in build._objects("avx2")]
    formats = build.format_names()
    assert sorted(names) == sorted([*(f"avx2-{f}" for f in formats), "avx2-core"])
    assert {name[5:] for name in names[:3]} == {f for f in formats if f.endswith("_K")}
    assert [name for name, _ in build._objects("portable")] == ["portable"]


def test_a_broken_source_says_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile error raises RuntimeError with the compiler's words, and leaves no library."""
    source = tmp_path / "kernels.cpp"
    source.write_text(
        Path(build.SOURCE).read_text().replace("namespace kv {", "namespace kv { oops", 1)
    )
    monkeypatch.setattr(build, "SOURCE", source)
    monkeypatch.setenv("KVSERVE_KERNEL_DIR", str(tmp_path / "out"))
    with pytest.raises(RuntimeError, match="oops"):
        build.build(None)
    assert not any(p.suffix == ".so" for p in (tmp_path / "out").iterdir())
