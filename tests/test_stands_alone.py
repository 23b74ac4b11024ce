"""The repository stands alone: nothing in it reads a file outside it (a user's clone has no
folder beside it, whatever its name)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from loadtest.workload import WORKLOADS_DIR

REPO = Path(__file__).resolve().parents[1]
# A path that leaves the repository for a folder beside it: one that climbs out with "../" to
# a named folder, or the repository root's parent, whatever the folder's name (``BESIDE``
# stands for it in the examples).
BESIDE = "beside"
OUTSIDE = re.compile(
    r"(?:\.\./){2,}[\w-]+/|^\s*\"?\.\./[\w-]+/|[\"']\.\./[\w-]+/"
    r"|\b(?:REPO_ROOT|REPO|ROOT|root)\.parents?\b"
)
SUFFIXES = {".py", ".json", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".ini"}
SKIP = {".venv", ".git", "node_modules", "bench-results", "gpu-check", ".gpu-wheels", "build"}


def _files() -> list[Path]:
    """Product code, tests, benchmarks, workloads and build files (not the docs)."""
    files = [REPO / "Makefile", REPO / "pyproject.toml"]
    for top in sorted(REPO.iterdir()):
        if top.is_dir() and top.name not in SKIP and not top.name.startswith("."):
            files += [
                p
                for p in top.rglob("*")
                if p.suffix in SUFFIXES and not SKIP & set(p.relative_to(REPO).parts)
            ]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


def test_no_file_reaches_for_a_folder_beside_the_repository() -> None:
    """No product, test, benchmark, workload or build file names a path that climbs out of
    the repository to a folder beside it (or the repository's parent joined with one)."""
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in _files()
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "files that read outside the repository:\n" + "\n".join(hits)


def test_the_check_sees_the_paths_it_looks_for() -> None:
    """The pattern catches each way a path to the folder beside the repository was written."""
    for text in (
        f'"path": "../../../{BESIDE}/workloads/chat128.json"',
        f'REPO_ROOT.parent / "{BESIDE}" / "workloads" / "chat128.json"',
        f'(root.parent / "{BESIDE}/workloads/chat128.json")',
        f'"../{BESIDE}/prompts.json"',
    ):
        assert OUTSIDE.search(text), text
    for inside in ('"shared_prefix": {"num_prefixes": 4}', 'REPO_ROOT / "loadtest" / "x"'):
        assert not OUTSIDE.search(inside), inside
    assert len(_files()) > 100  # the walk finds the tree


def test_every_workload_prompt_file_is_inside_the_repository() -> None:
    """Each shipped workload that reads a prompt file names one inside the repository, and
    it exists."""
    for path in sorted(WORKLOADS_DIR.glob("*.json")):
        prompt = json.loads(path.read_text()).get("prompt", {})
        if prompt.get("source") != "file":
            continue
        target = (path.parent / prompt["path"]).resolve()
        assert target.is_relative_to(REPO) and target.is_file(), f"{path.name}: {target}"
