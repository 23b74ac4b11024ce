"""The runner's seams, read from its source: the CUDA graphs know no backend's metadata, the
model never asks what a weight is held as, and the two constructors stay short."""

from __future__ import annotations

import ast
from pathlib import Path

MODEL_RUNNER = Path(__file__).resolve().parents[2] / "model_runner"
MAX_CONSTRUCTOR_LINES = 60


def _method_lines(path: Path, cls: str, method: str) -> int:
    """Lines of ``cls.method`` in ``path``, from ``def`` to its last line (docstring included)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    assert item.end_lineno is not None
                    return item.end_lineno - item.lineno + 1
    raise AssertionError(f"{path.name} has no {cls}.{method}")


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside a function."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_cuda_graphs_import_no_paged_backend_or_page_table() -> None:
    """``cuda_graphs.py`` imports nothing from ``attention_backends/paged*`` or
    ``page_table``: the backend makes and fills a graph's batch (``graph_batch``, ``fill``)."""
    imported = _imported_modules(MODEL_RUNNER / "cuda_graphs.py")
    paged = sorted(m for m in imported if "paged" in m or "page_table" in m)
    assert not paged, f"cuda_graphs.py imports {paged}"
    assert "model_runner.attention_backends.base.PaddedDecode" in imported  # the walk sees it


def test_the_model_never_asks_what_a_weight_is_held_as() -> None:
    """``model.py`` calls no ``isinstance`` and names no quantized type: ``weights.py``
    prepares the weights and ``Linears.make_linear`` picks each layer."""
    source = (MODEL_RUNNER / "model.py").read_text()
    calls = [
        node.func.id
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    assert "isinstance" not in calls
    for name in ("QuantWeight", "QuantStack", "QLinear", "QEmbedding"):
        assert name not in source, name


def test_the_runner_and_model_constructors_stay_short() -> None:
    """``TorchRunner.__init__`` and ``LlamaModel.__init__`` are at most 60 lines each (they
    were 149 and 138): options come as one ``RunnerOptions``, weights from ``weights.py``."""
    lines = {
        "TorchRunner": _method_lines(MODEL_RUNNER / "runner.py", "TorchRunner", "__init__"),
        "LlamaModel": _method_lines(MODEL_RUNNER / "model.py", "LlamaModel", "__init__"),
    }
    assert all(n <= MAX_CONSTRUCTOR_LINES for n in lines.values()), lines
    assert all(n > 20 for n in lines.values()), lines  # the walk found the real ones
