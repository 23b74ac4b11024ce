"""The runner's seams, read from its source: the CUDA graphs know no backend's metadata, and
the model never asks what a weight is held as."""

from __future__ import annotations

import ast
from pathlib import Path

MODEL_RUNNER = Path(__file__).resolve().parents[2] / "model_runner"


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
