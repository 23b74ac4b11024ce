"""The kernels' sources keep one fact in one place (model_runner/kernels/).

- No switch over formats has a ``default:`` (a forgotten format would decode as the default
  one), and the build turns a missing case into an error (``-Werror=switch``).
- ``qtile.h`` is written once over the register width: no run of 6 or more code lines
  appears twice, even with other names and numbers (a small twin-run finder, below, in the
  spirit of the ``duplicates`` tool; CI machines do not have that tool).
- The library's format table (names, values per record, record bytes) equals
  ``interleave.GEOMETRY``, and the load-time check that compares them catches a difference.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from model_runner import interleave, kernels
from model_runner.kernels import build

KERNELS = Path(build.SOURCE).parent
SOURCES = sorted([*KERNELS.glob("*.cpp"), *KERNELS.glob("*.h")])

# ---------------------------------------------------------------------- format switches


def test_no_switch_in_the_kernels_has_a_default() -> None:
    """No ``default:`` anywhere in the kernel sources (format switches list every format;
    the others, over column counts, are dispatch templates), and the build flags make a
    switch that misses an enum value an error."""
    found = [
        f"{path.name}:{n}"
        for path in SOURCES
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bdefault\s*:", line.split("//")[0])
    ]
    assert found == []
    assert "-Werror=switch" in build.FLAGS


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_build_flags_reject_a_switch_that_misses_a_format(tmp_path: Path) -> None:
    """With the kernels' flags, a switch over an enum that lacks one case does not compile,
    and the same switch with every case does (what keeps with_decoder whole)."""
    source = """
    enum Format { Q4_0, Q4_1, Q6_K };
    int code(Format f) {
      switch (f) {
        case Q4_0: return 0;
        case Q4_1: return 1;
        %s
      }
      return -1;
    }
    """
    results = []
    for extra in ("", "case Q6_K: return 2;"):
        path = tmp_path / "switch.cpp"
        path.write_text(source % extra)
        cmd = ["g++", *build.FLAGS, "-fsyntax-only", str(path)]
        results.append(subprocess.run(cmd, capture_output=True, text=True, check=False))
    missing, whole = results
    assert missing.returncode != 0 and "Q6_K" in missing.stderr
    assert whole.returncode == 0, whole.stderr


# ---------------------------------------------------------------------- twin runs

WINDOW = 6
_TOKEN = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[A-Za-z_]\w*|\d[\w.]*|\S")
_SUBSTANCE = re.compile(r"[^\s{}()\[\];,:.]")


def _letter(token: str) -> str:
    if token[0].isalpha() or token[0] == "_":
        return "x"
    if token[0].isdigit():
        return "0"
    return "s" if token[0] in "\"'" else token


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, shape) of each line that carries code: comments, blank lines, includes
    and lone punctuation are passed over; names become ``x``, numbers ``0``, strings ``s``."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("//")[0].strip()
        if not _SUBSTANCE.search(line) or line.startswith(("/*", "*", "#include")):
            continue
        out.append((n, " ".join(_letter(t) for t in _TOKEN.findall(line))))
    return out


def twin_runs(text: str, window: int = WINDOW) -> list[tuple[int, int]]:
    """Where a run of ``window`` or more code lines stands twice with the same shape, not
    overlapping itself: (first line of one place, first line of the other), a pair a run."""
    lines = code_lines(text)
    seen: dict[str, list[int]] = {}
    matches: set[tuple[int, int]] = set()
    runs = []
    for i in range(len(lines) - window + 1):
        chunk = lines[i : i + window]
        if sum(len(shape.split()) for _, shape in chunk) < 4 * window:
            continue  # too thin to mean anything (braces and keywords)
        key = hashlib.sha1("\n".join(shape for _, shape in chunk).encode()).hexdigest()
        for j in seen.get(key, []):
            if j + window <= i:
                matches.add((j, i))
                if (j - 1, i - 1) not in matches:  # a new run, not the last one going on
                    runs.append((lines[j][0], lines[i][0]))
        seen.setdefault(key, []).append(i)
    return runs


def test_qtile_has_no_twin_runs() -> None:
    """qtile.h (the tiles over the register width) repeats no run of 6 code lines, even as a
    shape: the tiles, their column sums and their dispatch are each written once."""
    assert twin_runs((KERNELS / "qtile.h").read_text()) == []


def test_the_twin_finder_catches_a_planted_twin() -> None:
    """The finder is not blind: a copy of one of qtile.h's functions with every name and
    number changed (as a ymm / zmm twin would be) is reported, at both places."""
    text = (KERNELS / "qtile.h").read_text()
    start = text.index("template <class W, bool HALVES, bool SIGNED, int G, bool RES, int NC>")
    end = text.index("\n}\n", start) + 3
    body = text[start:end]
    twin = re.sub(r"\b(W|acc|col_dots|k)\b", lambda m: m.group(1) + "16", body).replace(
        "0, 4", "0, 2"
    )
    planted = text + "\n" + twin
    pairs = twin_runs(planted)
    first = text[:start].count("\n") + 1
    assert pairs and pairs[0][0] >= first and pairs[0][1] > text.count("\n")
    assert twin_runs("\n".join(["int a = b + c * d;"] * 5)) == []  # one run: no pair


# ---------------------------------------------------------------------- the format table


needs_kernels = pytest.mark.skipif(not kernels.available(), reason="kernels not built")


@needs_kernels
def test_the_librarys_format_table_equals_interleaves() -> None:
    """Every family library in use lists the formats of interleave.GEOMETRY, with its values
    per record and row and its record bytes (8 rows), in KV_FORMATS' order; the codes the
    Python side passes come from that table."""
    family = kernels._families[kernels.isa()]
    table = kernels.format_table(family)
    assert list(table) == build.format_names()
    assert {name: (block, record) for name, (_, block, record) in table.items()} == {
        name: (block, interleave.record_bytes(name))
        for name, (block, _) in interleave.GEOMETRY.items()
    }
    assert [kernels.format_code(name) for name in table] == list(range(len(table)))
    assert kernels._format_mismatch(table) is None


@needs_kernels
def test_a_table_that_differs_from_interleave_is_refused() -> None:
    """The load-time check names a format whose record size, or whose presence, differs."""
    table = dict(kernels.format_table(kernels._families[kernels.isa()]))
    code, block, record = table["Q5_K"]
    table["Q5_K"] = (code, block, record + 8)
    assert "Q5_K" in (kernels._format_mismatch(table) or "")
    del table["Q5_K"]
    assert "Q5_K" in (kernels._format_mismatch(table) or "")


# ---------------------------------------------------------------------- the LoRA target table


@needs_kernels
def test_the_librarys_lora_targets_equal_the_python_table() -> None:
    """The kernels' LoRA targets (lora.h: name, projection, output width, by index) are
    ``lora.targets.TARGETS`` (the order an adapter's pair table is written in), and the
    spans the kernels derive from them are the Python side's."""
    from model_runner.lora import targets

    rows = kernels.lora_target_table(kernels._families[kernels.isa()])
    assert [name for name, _, _ in rows] == [t.name for t in targets.TARGETS]
    assert rows == targets.kernel_rows()
    assert targets.check_kernel_table(rows) is None


def test_a_lora_target_table_that_differs_is_refused() -> None:
    """The load-time check names the difference: a target moved to another projection, a
    width changed, or one missing."""
    from model_runner.lora import targets

    rows = targets.kernel_rows()
    moved = [*rows[:4], ("gate", 3, rows[4][2]), *rows[5:]]
    assert "gate" in (targets.check_kernel_table(moved) or "")
    wider = [(n, p, 0 if n == "down" else w) for n, p, w in rows]
    assert "down" in (targets.check_kernel_table(wider) or "")
    assert targets.check_kernel_table(rows[:-1]) is not None
