"""The house's size limits and the server's seam with the runner, read from the source.

- no product file over 650 lines (the generated gRPC stubs aside);
- no constructor (``__init__``, ``__post_init__``) over 60 lines, docstring included;
- server/ never asks what type a runner is (``isinstance``) and reads no runner attribute
  under a ``type: ignore``: what it needs is on ``model_runner.base.Runner``;
- the server's packages read the environment in one place (``model_runner.environment``),
  besides the cluster's Ray plumbing.

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
# The packages of the server (loadtest/ and benchmarks/ are clients and tools), and the files
# that may read the environment there: the one reader, and the cluster's Ray plumbing (Ray
# hands settings to the processes it starts through the environment).
SERVER_PACKAGES = ("cache_manager", "cluster", "kv_store", "metrics", "model_runner",
                   "scheduler", "server")  # fmt: skip
ENV_READERS = ("model_runner/environment.py", "cluster/app.py", "cluster/cli.py", "cluster/edge.py")
_ENV_READ = re.compile(r"\bos\.(environ|getenv)\b|\bgetenv\(")


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


def test_the_environment_is_read_in_one_place() -> None:
    """STYLE rule 8: ``model_runner.environment`` reads it (the server's settings and the
    process switches: the kernels', the model's), not each module for itself."""
    assert set(SERVER_PACKAGES) <= set(PACKAGES)
    readers = {
        str(p.relative_to(REPO)): hits
        for package in SERVER_PACKAGES
        for p in sorted((REPO / package).rglob("*.py"))
        if "_build" not in p.parts
        and (hits := [ln.strip() for ln in p.read_text().splitlines() if _ENV_READ.search(ln)])
    }
    assert "model_runner/environment.py" in readers  # the walk sees what it looks for
    stray = {path: hits for path, hits in readers.items() if path not in ENV_READERS}
    assert not stray, f"read the environment through model_runner.environment: {stray}"


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
