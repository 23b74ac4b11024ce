"""Product code imports one way: no module reaches itself again through its imports.

Every ``import`` counts, at module level or inside a function: a lazy import hides a circle
from the interpreter but not from the next reader (it is how ``self.http: Any`` came about).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Every product package: each top-level folder with an __init__.py but the tests.
PACKAGES = tuple(
    sorted(d.name for d in REPO.iterdir() if (d / "__init__.py").is_file() and d.name != "tests")
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _product_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "rpc" not in path.relative_to(REPO).parts:  # generated stubs
                modules[_module_name(path)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The product modules ``name`` imports (``from a import b``: ``a.b`` when a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in modules else base for t in targets]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_product_imports_have_no_cycle() -> None:
    """The import graph of the product packages (lazy imports included) is acyclic."""
    modules = _product_modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert {"kv_store", "fuzz", "server", "model_runner"} <= set(PACKAGES)
    assert len(graph) > 100  # the walk found the tree
    assert _cycles(graph) == []


def test_the_walk_sees_a_lazy_cycle() -> None:
    """The checker itself: a circle closed by an import inside a function is reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert _cycles(graph) == [["a", "b"]]
