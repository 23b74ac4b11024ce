"""The building blocks of kvserve's dashboards: PromQL helpers, panels, layout, the
template variables and the dashboard frame. ``generate_dashboards.py`` composes them."""

from __future__ import annotations

from typing import Any

SCHEMA_VERSION = 39
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'instance=~"$instance", replica=~"$replica"'  # every selector filters on both variables
RATE = "$__rate_interval"
NOT_OK = 'code!="OK"'
BOTH_MET, TTFT_MET, ITL_MET = (f'target="{t}"' for t in ("both", "ttft", "itl"))

Panel = dict[str, Any]


def rate(metric: str, extra: str = "") -> str:
    sel = SEL + (", " + extra if extra else "")
    return f"rate({metric}{{{sel}}}[{RATE}])"


def quantile(q: float, histogram: str, by: str = "") -> str:
    group = f"{by}, le" if by else "le"
    return f"histogram_quantile({q}, sum by ({group}) ({rate(histogram + '_bucket')}))"


def mean(histogram: str, by: str = "") -> str:
    agg = f"sum by ({by})" if by else "sum"
    return f"{agg} ({rate(histogram + '_sum')}) / {agg} ({rate(histogram + '_count')})"


def target(expr: str, legend: str, ref: str, **extra: Any) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, **extra}


def targets(*pairs: tuple[str, str]) -> list[dict[str, Any]]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(pairs)]


def timeseries(
    title: str,
    description: str,
    pairs: list[tuple[str, str]],
    unit: str = "short",
    stack: bool = False,
    overrides: list[dict[str, Any]] | None = None,
    min_zero: bool = True,
) -> Panel:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10}
    if stack:
        custom.update({"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 40})
    defaults: dict[str, Any] = {"unit": unit, "custom": custom}
    if min_zero:
        defaults["min"] = 0
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets(*pairs),
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
    }


def stat(title: str, description: str, expr: str, unit: str = "short") -> Panel:
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets((expr, title)),
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
    }


def percentiles(title: str, description: str, histogram: str) -> Panel:
    return timeseries(
        title,
        description,
        [
            (quantile(0.5, histogram), "p50"),
            (quantile(0.9, histogram), "p90"),
            (quantile(0.99, histogram), "p99"),
            (mean(histogram), "mean"),
        ],
        unit="s",
    )


def row(title: str) -> Panel:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def layout(items: list[Panel | list[Panel]]) -> list[Panel]:
    """Rows span the width; a list of panels shares one line (24 grid units wide)."""
    panels: list[Panel] = []
    y = 0
    for item in items:
        if isinstance(item, dict):
            item["gridPos"] = {"h": 1, "w": 24, "x": 0, "y": y}
            panels.append(item)
            y += 1
            continue
        height = 4 if all(p["type"] == "stat" for p in item) else 8
        width = 24 // len(item)
        for i, panel in enumerate(item):
            panel["gridPos"] = {"h": height, "w": width, "x": i * width, "y": y}
            panels.append(panel)
        y += height
    for panel_id, panel in enumerate(panels, start=1):
        panel["id"] = panel_id
    return panels


def _query_variable(name: str, label: str) -> dict[str, Any]:
    query = f"label_values(kvserve_model_info, {name})"
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,
        "sort": 1,
        "hide": 0,
        "regex": "",
        "options": [],
    }


def templating() -> dict[str, Any]:
    return {
        "list": [
            {
                "name": "datasource",
                "label": "Data source",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
                "options": [],
            },
            _query_variable("instance", "Instance"),
            _query_variable("replica", "Replica"),
        ]
    }


def dashboard(uid: str, title: str, description: str, panels: list[Panel]) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["kvserve"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "timezone": "browser",
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "weekStart": "",
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "links": [
            {
                "title": "kvserve dashboards",
                "type": "dashboards",
                "tags": ["kvserve"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "templating": templating(),
        "panels": panels,
    }
