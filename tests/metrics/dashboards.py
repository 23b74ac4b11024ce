"""Reading the Grafana dashboards: their queries, variables and the metrics they name."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.metrics.helpers import DASHBOARDS, GRAFANA

METRIC_RE = re.compile(r"\bkvserve_[a-z0-9_]+")


@dataclass(frozen=True, slots=True)
class Query:
    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def where(self) -> str:
        return f"{self.dashboard} / {self.panel!r} / {self.ref_id}"


def load_dashboards() -> dict[str, dict[str, Any]]:
    """File name -> parsed JSON of every dashboard under grafana/dashboards/."""
    paths = sorted(DASHBOARDS.glob("*.json"))
    assert paths, f"no dashboards in {DASHBOARDS}"
    return {p.name: json.loads(p.read_text(encoding="utf-8")) for p in paths}


def iter_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including panels nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def queries(dashboards: dict[str, dict[str, Any]]) -> list[Query]:
    out: list[Query] = []
    for name, dash in dashboards.items():
        for panel in iter_panels(dash):
            for tgt in panel.get("targets", []):
                out.append(Query(name, panel.get("title", "?"), tgt.get("refId", "?"), tgt["expr"]))
    return out


def variable_queries(dashboards: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Template variable name -> its label_values() query (query variables only)."""
    out: dict[str, str] = {}
    for dash in dashboards.values():
        for var in dash["templating"]["list"]:
            if var["type"] == "query":
                query = var["query"]
                out[var["name"]] = query["query"] if isinstance(query, dict) else query
    return out


def resolve(expr: str, variables: dict[str, str]) -> str:
    """Substitute Grafana's ``$name`` / ``${name}`` / ``[[name]]`` variables with values."""
    for name, val in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", val).replace("[[" + name + "]]", val)
        expr = re.sub(r"\$" + re.escape(name) + r"\b", lambda _m, v=val: v, expr)
    leftover = re.findall(r"\$\{?\w+", expr)
    assert not leftover, f"unresolved variables {leftover} in {expr}"
    return expr


def metric_names(expr: str) -> set[str]:
    return set(METRIC_RE.findall(expr))


def load_generator() -> ModuleType:
    """grafana/generate_dashboards.py as a module (grafana/ is not a package)."""
    path: Path = GRAFANA / "generate_dashboards.py"
    spec = importlib.util.spec_from_file_location("kvserve_generate_dashboards", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
