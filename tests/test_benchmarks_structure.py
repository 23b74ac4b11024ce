"""benchmarks/ is one harness, and model_runner/ holds no tools, read from the source.

- one size table (a ``Sizes`` class; ``FULL`` / ``QUICK`` / ``DRY`` assigned in one module),
  one section registry (a ``SECTIONS`` written out as a table, not derived from it), one
  context, one report, one ``SectionResult``: the CPU and GPU sections share them;
- nothing in model_runner/ is imported only by tests/ and benchmarks/ (a module no product
  code imports is a tool: it lives in benchmarks/tools/). The importers come from the same
  walk as the import-circle check (tests/test_import_cycles.py), lazy imports included, and
  a table that names a module to load by name (``"model_runner.x:Class"``) imports it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

from tests.test_import_cycles import _imports, _module_name, _product_modules

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
# The harness's pieces: each class is defined once in benchmarks/.
HARNESS_CLASSES = ("Sizes", "Context", "Report", "SectionResult", "Section")
SIZE_TABLES = ("FULL", "QUICK", "DRY")
# Who may import a model_runner module without making it product code.
NOT_PRODUCT = ("benchmarks", "tests")


def _trees() -> dict[str, ast.Module]:
    return {
        str(p.relative_to(REPO)): ast.parse(p.read_text(), str(p))
        for p in sorted(BENCHMARKS.rglob("*.py"))
    }


def _classes(trees: dict[str, ast.Module], names: Iterable[str]) -> dict[str, list[str]]:
    """For each class name, the files defining a class of that name (or ending in it: a
    ``GpuSizes`` is a second size table)."""
    found: dict[str, list[str]] = {n: [] for n in names}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for name in found:
                    if node.name == name or (name == "Sizes" and node.name.endswith(name)):
                        found[name].append(f"{path}:{node.name}")
    return found


def _assigned(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level ``NAME = value`` and ``NAME: T = value``."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and node.value is not None
        ):
            out[node.target.id] = node.value
    return out


def _registries(trees: dict[str, ast.Module]) -> list[str]:
    """Files with a ``SECTIONS`` written out (a dict, tuple, list or set, or a comprehension
    over one): a registry. ``SECTIONS = registry.names("cpu")`` is a view of one."""
    tables = (ast.Dict, ast.Tuple, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    return [
        path for path, tree in trees.items() if isinstance(_assigned(tree).get("SECTIONS"), tables)
    ]


def _size_tables(trees: dict[str, ast.Module]) -> list[str]:
    return [path for path, tree in trees.items() if set(SIZE_TABLES) & set(_assigned(tree))]


def _tool_only(graph: dict[str, set[str]], package: str) -> dict[str, list[str]]:
    """Modules of ``package`` that some module imports, all of whose importers are in
    ``NOT_PRODUCT``: each with its importers."""
    importers: dict[str, set[str]] = {}
    for name, targets in graph.items():
        for target in targets:
            importers.setdefault(target, set()).add(name)
    return {
        module: sorted(by)
        for module, by in sorted(importers.items())
        if module.split(".")[0] == package and all(b.split(".")[0] in NOT_PRODUCT for b in by)
    }


def _named(path: Path, modules: Iterable[str]) -> set[str]:
    """The modules a string constant of ``path`` names to be loaded: ``"pkg.mod:Attr"``."""
    known = set(modules)
    return {
        node.value.partition(":")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"[\w.]+:\w+", node.value)
        and node.value.partition(":")[0] in known
    }


def _import_graph() -> dict[str, set[str]]:
    """Every product, benchmark and test module -> the product modules it imports."""
    modules = _product_modules()
    graph = {name: _imports(name, path, modules) | _named(path, modules)
             for name, path in modules.items()}  # fmt: skip
    for path in sorted((REPO / "tests").rglob("*.py")):
        graph.setdefault(_module_name(path), _imports(_module_name(path), path, modules))
    return graph


def test_benchmarks_have_one_size_table_registry_context_and_report() -> None:
    """One ``Sizes`` (and no ``*Sizes``), one ``Context``, ``Report``, ``SectionResult`` and
    ``Section`` in benchmarks/; ``FULL`` / ``QUICK`` / ``DRY`` in one module; one registry."""
    trees = _trees()
    classes = _classes(trees, HARNESS_CLASSES)
    assert all(len(where) == 1 for where in classes.values()), classes
    assert _size_tables(trees) == ["benchmarks/harness/sizes.py"]
    assert _registries(trees) == ["benchmarks/harness/registry.py"]


def test_model_runner_holds_no_tool_of_the_tests_and_benchmarks() -> None:
    """No model_runner module is imported by tests/ and benchmarks/ alone."""
    graph = _import_graph()
    assert "benchmarks.tools.reference" in graph and "tests.test_structure" in graph
    assert _tool_only(graph, "model_runner") == {}


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """A second size class, a second written-out registry or size table, and a runner module
    only tests and benchmarks import are each found; a derived ``SECTIONS`` is not a registry,
    and a module named in a table to be loaded by name is imported."""
    trees = {
        "a.py": ast.parse("class Sizes: ...\nFULL = Sizes()\nSECTIONS = {'x': 1}\n"),
        "b.py": ast.parse("class GpuSizes: ...\nSECTIONS: tuple = ('probes',)\nDRY = 1\n"),
        "c.py": ast.parse("SECTIONS = registry.names('cpu')\n"),
    }
    assert _classes(trees, ["Sizes"]) == {"Sizes": ["a.py:Sizes", "b.py:GpuSizes"]}
    assert _registries(trees) == ["a.py", "b.py"]
    assert _size_tables(trees) == ["a.py", "b.py"]
    graph = {
        "model_runner.kquants": set(),
        "model_runner.quant": {"model_runner.kquants"},
        "model_runner.reference": set(),
        "benchmarks.bench_x": {"model_runner.reference", "model_runner.quant"},
        "tests.test_x": {"model_runner.reference"},
        "server.build": {"model_runner.quant"},
    }
    assert _tool_only(graph, "model_runner") == {
        "model_runner.reference": ["benchmarks.bench_x", "tests.test_x"]
    }
    table = tmp_path / "table.py"
    table.write_text('BACKENDS = {"t": "model_runner.quant:Q", "x": "not.a.module:X"}\n')
    assert _named(table, ["model_runner.quant", "server.build"]) == {"model_runner.quant"}
