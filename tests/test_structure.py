"""The house's size limits and the server's seam with the runner, read from the source.

- no product file over 650 lines (the generated gRPC stubs aside);
- no constructor (``__init__``, ``__post_init__``) over 60 lines, docstring included;
- server/ never asks what type a runner is (``isinstance``) and reads no runner attribute
  under a ``type: ignore``: what it needs is on ``model_runner.base.Runner``.

(No import circle: tests/test_import_cycles.py.)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = tuple(
    sorted(d.name for d in REPO.iterdir() if (d / "__init__.py").is_file() and d.name != "tests")
)
MAX_FILE_LINES = 650
MAX_CONSTRUCTOR_LINES = 60
CONSTRUCTORS = ("__init__", "__post_init__")


def _product_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).parts
            if "rpc" not in parts and "_build" not in parts:  # generated
                files.append(path)
    return files


def _long_constructors(source: str, limit: int) -> list[tuple[str, int]]:
    """(qualified name, lines) of each constructor in ``source`` over ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
                item.name in CONSTRUCTORS
            ):
                assert item.end_lineno is not None
                lines = item.end_lineno - item.lineno + 1
                if lines > limit:
                    found.append((f"{node.name}.{item.name}", lines))
    return found


def _runner_type_questions(source: str) -> list[str]:
    """``isinstance`` calls on a runner (its argument names one, or the class is a
    ``...Runner``), and runner attributes read under ``type: ignore``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            continue
        subject, classes = (ast.unparse(a) for a in node.args)
        if "runner" in subject.lower() or re.search(r"Runner\b", classes):
            found.append(ast.unparse(node))
    for line in source.splitlines():
        if re.search(r"runner\w*\.\w+.*#\s*type:\s*ignore", line, re.IGNORECASE):
            found.append(line.strip())
    return found


def test_no_product_file_is_over_the_limit() -> None:
    files = _product_files()
    long = {
        str(p.relative_to(REPO)): n
        for p in files
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"over {MAX_FILE_LINES} lines: {long}"
    assert len(files) > 100  # the walk found the packages


def test_no_constructor_is_over_the_limit() -> None:
    long = {
        f"{p.relative_to(REPO)}:{name}": n
        for p in _product_files()
        for name, n in _long_constructors(p.read_text(), MAX_CONSTRUCTOR_LINES)
    }
    assert not long, f"constructors over {MAX_CONSTRUCTOR_LINES} lines: {long}"


def test_the_server_never_asks_what_a_runner_is() -> None:
    """No ``isinstance`` on a runner in server/, no runner attribute under ``type: ignore``:
    every runner has ``submit``, ``can_run_ahead`` and ``adapters`` (``Runner``)."""
    questions = {
        str(p.relative_to(REPO)): q
        for p in sorted((REPO / "server").rglob("*.py"))
        if "rpc" not in p.parts and (q := _runner_type_questions(p.read_text()))
    }
    assert not questions, questions


def test_the_checks_see_what_they_look_for() -> None:
    """The walks find the shapes they forbid (the server's old lines among them)."""
    ahead = "ok = isinstance(runner, AheadRunner) and runner.can_run_ahead\n"
    ignored = "adapters = runner.lora  # type: ignore[attr-defined]\n"
    assert _runner_type_questions(ahead) == ["isinstance(runner, AheadRunner)"]
    assert _runner_type_questions(ignored) == [ignored.strip()]
    assert _runner_type_questions("isinstance(self._runner, object)\n")
    assert _runner_type_questions("isinstance(x, FakeRunner)\n")
    assert not _runner_type_questions("isinstance(router, Router)\n")
    body = "\n".join(f"        self.a{i} = {i}" for i in range(61))
    source = f"class C:\n    def __init__(self) -> None:\n{body}\n"
    assert _long_constructors(source, MAX_CONSTRUCTOR_LINES) == [("C.__init__", 62)]
    assert _long_constructors(source, 62) == []
