"""Grafana dashboards and provisioning: valid schema, datasource by variable, nothing hard-coded."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest
import yaml

from tests.metrics.dashboards import (
    iter_panels,
    load_dashboards,
    load_generator,
    metric_names,
    queries,
    resolve,
)
from tests.metrics.helpers import (
    DASHBOARDS,
    GRAFANA,
    documented_families,
    require_binary,
)

DS_VAR = {"type": "prometheus", "uid": "${datasource}"}
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "table", "bargauge", "heatmap", "text"}
EXPECTED_TITLES = {"kvserve overview", "kvserve scheduler & KV cache"}


def test_committed_json_is_what_the_generator_writes() -> None:
    """grafana/dashboards/*.json equal `python grafana/generate_dashboards.py` output."""
    rendered = load_generator().render()
    committed = {p.name: p.read_text(encoding="utf-8") for p in DASHBOARDS.glob("*.json")}
    assert sorted(rendered) == sorted(committed)
    for name, text in rendered.items():
        assert committed[name] == text, (
            f"{name} is stale: run python grafana/generate_dashboards.py"
        )


def test_dashboards_have_a_valid_schema() -> None:
    """uid, title, schemaVersion, templating, and panels with ids and non-overlapping gridPos."""
    dashboards = load_dashboards()
    assert {d["title"] for d in dashboards.values()} == EXPECTED_TITLES
    uids = [d["uid"] for d in dashboards.values()]
    assert len(set(uids)) == len(uids)
    for name, dash in dashboards.items():
        assert re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", dash["uid"]), name
        assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36, name
        assert isinstance(dash["version"], int), name
        assert dash.get("id") is None, f"{name}: a provisioned dashboard must not carry an id"
        assert isinstance(dash["templating"]["list"], list), name
        ids = [p["id"] for p in iter_panels(dash)]
        assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids), name
        occupied: set[tuple[int, int]] = set()
        for panel in iter_panels(dash):
            where = f"{name} / {panel.get('title')!r}"
            assert panel["type"] in PANEL_TYPES, where
            assert panel.get("title"), where
            pos = panel["gridPos"]
            assert set(pos) == {"h", "w", "x", "y"}, where
            assert all(isinstance(v, int) and v >= 0 for v in pos.values()), where
            assert pos["h"] >= 1 and pos["w"] >= 1 and pos["x"] + pos["w"] <= 24, where
            cells = {
                (x, y)
                for x in range(pos["x"], pos["x"] + pos["w"])
                for y in range(pos["y"], pos["y"] + pos["h"])
            }
            assert not cells & occupied, f"{where} overlaps another panel"
            occupied |= cells
            if panel["type"] == "row":
                continue
            assert panel["targets"], where
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert len(set(ref_ids)) == len(ref_ids), where
            for tgt in panel["targets"]:
                assert tgt["expr"].strip(), where
                assert re.fullmatch(r"[A-Z]", tgt["refId"]), where


def test_datasource_comes_from_a_variable() -> None:
    """A `datasource` variable of type prometheus feeds every panel, target and variable."""
    for name, dash in load_dashboards().items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus", name
        for var in variables.values():
            if var["type"] == "query":
                assert var["datasource"] == DS_VAR, f"{name}: variable {var['name']}"
        for panel in iter_panels(dash):
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == DS_VAR, f"{name} / {panel['title']!r}"
            for tgt in panel["targets"]:
                assert tgt["datasource"] == DS_VAR, f"{name} / {panel['title']!r}"


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def test_no_hard_coded_instance_job_or_host() -> None:
    """Selectors filter only on the $instance and $replica variables; no job, host, port or
    datasource uid."""
    dashboards = load_dashboards()
    for query in queries(dashboards):
        for selector in re.findall(r"kvserve_[a-z0-9_]+(\{[^}]*\})?", query.expr):
            assert 'instance=~"$instance"' in selector, f"{query.where}: {query.expr}"
            assert 'replica=~"$replica"' in selector, f"{query.where}: {query.expr}"
        matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', query.expr)
        for label, _op, val in matchers:
            assert label in {"instance", "replica", "code", "target"}, (
                f"{query.where}: matcher on {label}"
            )
            if label in ("instance", "replica"):
                assert val == f"${label}", f"{query.where}: hard-coded {label} {val!r}"
    for name, dash in dashboards.items():
        for text in _strings(dash):
            assert not re.search(r"localhost|127\.0\.0\.1|:\d{4,5}\b|job\s*=", text), (
                f"{name}: hard-coded address or job in {text!r}"
            )
        assert "__inputs" not in dash or all(
            i.get("type") == "datasource" for i in dash["__inputs"]
        ), name


def test_dashboards_cover_the_issue() -> None:
    """The panels the operators asked for exist and use the metrics meant for them."""
    dashboards = load_dashboards()
    exprs = {d["title"]: " ".join(q.expr for q in queries({n: d})) for n, d in dashboards.items()}
    overview = exprs["kvserve overview"]
    for needle in (
        'code!="OK"',
        "kvserve_request_time_to_first_token_seconds_bucket",
        "kvserve_request_inter_token_latency_seconds_bucket",
        "kvserve_request_e2e_latency_seconds_bucket",
        "kvserve_generation_tokens_total",
        "kvserve_requests_waiting",
        "histogram_quantile(0.99",
    ):
        assert needle in overview, needle
    sched = exprs["kvserve scheduler & KV cache"]
    for needle in (
        "kvserve_scheduler_batches_total",
        "kvserve_step_duration_seconds_bucket",
        "kvserve_step_prefill_tokens_sum",
        "kvserve_step_decode_requests_sum",
        "sum by (state) (kvserve_kv_cache_blocks",
        "kvserve_kv_cache_evictions_total",
        "kvserve_preemptions_total",
        "kvserve_kv_cache_sequences",
        "kvserve_kv_cache_memory_bytes",
        "kvserve_kv_cache_average_sequence_length_tokens",
        "kvserve_kv_cache_efficiency_ratio",
    ):
        assert needle in sched, needle
    # The hit rate is computed from the counters with rate(), not read from the gauge only.
    assert re.search(
        r"rate\(kvserve_prefix_cache_hits_tokens_total[^)]*\)\) /\s*"
        r"sum\(rate\(kvserve_prefix_cache_queries_tokens_total",
        sched,
    )


def test_dashboards_name_only_documented_metrics() -> None:
    """Every metric a query names is documented (its _bucket/_sum/_count for histograms)."""
    documented = documented_families()
    allowed = set()
    for name, spec in documented.items():
        allowed.add(name)
        if spec.type == "histogram":
            allowed |= {name + "_bucket", name + "_sum", name + "_count"}
    for query in queries(load_dashboards()):
        unknown = metric_names(query.expr) - allowed
        assert not unknown, f"{query.where}: undocumented metrics {sorted(unknown)}"


def test_resolve_substitutes_grafana_variables() -> None:
    """The e2e test's variable substitution handles $x, ${x} and [[x]] and leaves none."""
    out = resolve('rate(a{i=~"$instance"}[$__rate_interval]) ${x} [[x]]', {
        "instance": "h:1", "__rate_interval": "15s", "x": "y"})  # fmt: skip
    assert out == 'rate(a{i=~"h:1"}[15s]) y y'
    with pytest.raises(AssertionError, match="unresolved"):
        resolve("rate(a[$__range])", {})


def _yaml(path: str) -> Any:
    return yaml.safe_load((GRAFANA / path).read_text(encoding="utf-8"))


def test_provisioning_files() -> None:
    """Datasource + dashboard providers are valid and point where compose mounts them."""
    datasources = _yaml("provisioning/datasources/prometheus.yml")
    assert datasources["apiVersion"] == 1
    (ds,) = datasources["datasources"]
    assert ds["type"] == "prometheus" and ds["access"] == "proxy" and ds["isDefault"] is True
    assert ds["url"] == "http://prometheus:9090"
    providers = _yaml("provisioning/dashboards/kvserve.yml")
    assert providers["apiVersion"] == 1
    (provider,) = providers["providers"]
    assert provider["type"] == "file"
    compose = _yaml("docker-compose.yml")
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in grafana["volumes"]}
    assert mounts["./provisioning"] == "/etc/grafana/provisioning"
    assert mounts["./dashboards"] == provider["options"]["path"]


def test_compose_and_prometheus_config_agree() -> None:
    """prometheus.yml scrapes the kvserve service on the metrics port compose starts it with."""
    compose = _yaml("docker-compose.yml")
    services = compose["services"]
    assert set(services) == {"kvserve", "prometheus", "grafana"}
    command = services["kvserve"]["command"]
    text = " ".join(command) if isinstance(command, list) else command
    port = re.search(r"--metrics-port[ =](\d+)", text)
    assert port is not None, text
    assert re.search(r"--metrics-host[ =]0\.0\.0\.0", text), text
    prom = _yaml("prometheus.yml")
    (job,) = prom["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"kvserve:{port.group(1)}"]
    mounts = [v.split(":")[:2] for v in services["prometheus"]["volumes"]]
    assert ["./prometheus.yml", "/etc/prometheus/prometheus.yml"] in mounts
    build = services["kvserve"]["build"]
    assert (GRAFANA / build["context"] / build["dockerfile"]).is_file()


def test_promtool_accepts_prometheus_yml() -> None:
    """`promtool check config grafana/prometheus.yml` passes."""
    promtool = require_binary("promtool")
    proc = subprocess.run(
        [promtool, "check", "config", str(GRAFANA / "prometheus.yml")],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()
