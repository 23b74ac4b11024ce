"""Two habits the product code keeps: a caller never asks which router it holds (no
``isinstance`` on a router class outside cluster/routing.py: the routers say what they offer
through their hooks), and no ``unittest.mock`` stands in for a real part."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.test_import_cycles import PACKAGES, REPO

ROUTING = REPO / "cluster" / "routing.py"


def _product_files() -> list[Path]:
    return [path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))]


def _router_classes() -> set[str]:
    """``Router`` and ``Score`` and every class of cluster/routing.py derived from them."""
    classes = {
        node.name: {b.id for b in node.bases if isinstance(b, ast.Name)}
        for node in ast.walk(ast.parse(ROUTING.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    found = {"Router", "Score"}
    while grown := {name for name, bases in classes.items() if bases & found} - found:
        found |= grown
    return found


def _isinstance_targets(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every name an ``isinstance`` / ``issubclass`` call tests against."""
    out = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
        ):
            for part in ast.walk(node.args[1]):
                if isinstance(part, ast.Name):
                    out.append((node.lineno, part.id))
                elif isinstance(part, ast.Attribute):
                    out.append((node.lineno, part.attr))
    return out


def test_no_isinstance_on_a_router_class_outside_routing() -> None:
    """Product code outside cluster/routing.py never tests a value against a router or score
    class (GuardedRouter, CostScore, ...)."""
    routers = _router_classes()
    assert {"Router", "GuardedRouter", "PrefixScore", "CostScore", "RoundRobinRouter"} <= routers
    found = [
        f"{path.relative_to(REPO)}:{line} isinstance(..., {name})"
        for path in _product_files()
        if path != ROUTING
        for line, name in _isinstance_targets(ast.parse(path.read_text(), str(path)))
        if name in routers
    ]
    assert found == []


def test_no_unittest_mock_in_product_code() -> None:
    """No product module imports unittest.mock (a stand-in belongs in a test)."""
    found = []
    for path in _product_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            if any(n == "unittest.mock" or n.startswith("unittest.mock.") for n in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
