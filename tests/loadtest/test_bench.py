"""The benchmark suite's pieces: the paged-KV comparison, the table, and the --quick smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_kv_cache import Point, _integrated_s
from benchmarks.bench_kv_cache import format_table as kv_cache_table
from benchmarks.bench_paged_kv import make_lengths, run_layout
from benchmarks.harness.report import Row, format_table
from benchmarks.run_all import SECTIONS
from loadtest.launch import REPO_ROOT
from loadtest.workload import CHAT128_PROMPTS


def test_paged_kv_concurrency_follows_the_memory_layout() -> None:
    """4096 slots, 32 requests of 128+128 tokens: a 1024-token contiguous region per sequence
    fits 4 at once; paged blocks reserved at full length (16 blocks each) fit 16."""
    lengths = make_lengths("chat128", 32, max_model_len=1024)
    kw = {"workload": "chat128", "budget_tokens": 4096, "max_model_len": 1024}
    contiguous = run_layout("contiguous", lengths, **kw)  # type: ignore[arg-type]
    reserve = run_layout("paged-reserve", lengths, **kw)  # type: ignore[arg-type]
    optimistic = run_layout("paged-optimistic", lengths, **kw)  # type: ignore[arg-type]
    assert contiguous.peak_concurrent == 4
    assert reserve.peak_concurrent == 16
    assert optimistic.peak_concurrent >= reserve.peak_concurrent
    assert contiguous.preemptions == reserve.preemptions == 0
    # A sequence never holds more than 256 tokens of its 1024-slot region.
    assert 0 < contiguous.mean_cache_efficiency <= 0.25
    assert reserve.mean_cache_efficiency > contiguous.mean_cache_efficiency
    assert all(r.num_requests == 32 for r in (contiguous, reserve, optimistic))


def test_mixed_lengths_fit_the_model_length() -> None:
    """Every (prompt, output) pair of the mixed paged-KV workload fits max_model_len."""
    for max_model_len in (512, 2048):
        lengths = make_lengths("mixed", 200, max_model_len=max_model_len)
        assert all(p >= 1 and o >= 4 and p + o <= max_model_len for p, o in lengths)


def test_format_table_is_markdown_with_dashes_for_missing() -> None:
    """One header, one separator, one line per row; None cells print as '-'."""
    rows = [
        Row("paged", "s", "contiguous", requests=4, peak_concurrent=4, cache_efficiency=0.125),
        Row("chat128", "1 user", "kvserve", requests=4, out_tok_s=21.25, vs_baseline="1.20x"),
    ]
    lines = format_table(rows).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("| Section") and "| llama.cpp tok/s |" in lines[0]
    assert "quoted" not in lines[0] and "| kvserve / llama.cpp |" in lines[0]
    assert set(lines[1]) == {"|", "-"}
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:5] == ["paged", "s", "contiguous", "4", "-"]
    assert cells[8:10] == ["4", "0.12"]
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    assert cells[4] == "21.2" and cells[10] == "1.20x"


SERVING_SECTIONS = "chat128,policy,slo,prefix,paged,spec"
MODEL_SECTIONS = "kvcache,sinks,kernels,models,kvtier,lora"


def run_quick(sections: str, out_dir: Path) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`python -m benchmarks.run_all --quick --sections ...` on the real model and server
    (llama.cpp off): its output, and the JSON it wrote. The timeout is only the safety net
    against a hang, far above what a machine whose cores are busy needs."""
    assert CHAT128_PROMPTS.is_file(), f"the reference workload is missing: {CHAT128_PROMPTS}"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run_all", "--quick", "--no-progress",
         "--llama-cpp", "off", "--sections", sections, "--out-dir", str(out_dir)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=3000, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("| Section ") == 1
    (path,) = out_dir.glob("bench-quick-*.json")
    doc = json.loads(path.read_text())
    assert doc["schema"] == "kvserve.bench/v1" and doc["quick"] is True
    # the CPU and the load average beside the figures (a figure taken under load is void)
    machine = doc["machine"]
    assert machine["cpu"] and machine["load_avg_start"] >= 0 and machine["load_avg_end"] >= 0
    assert f", load average {machine['load_avg_start']:.2f} at the start" in done.stdout
    return done, doc


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_run_all_quick_serving_sections_print_one_table_and_write_json(tmp_path: Path) -> None:
    """`run_all --quick` runs the serving sections (the table's rows) on the real model and
    server; the model sections run in test_bench_models.py (two files: two test workers)."""
    _, doc = run_quick(SERVING_SECTIONS, tmp_path)
    rows = doc["rows"]
    assert [r["section"] for r in rows] == (
        ["chat128"] * 6
        + ["policy"] * 2
        + ["slo"] * 4
        + ["prefix"] * 2
        + ["paged"] * 6
        + ["spec"] * 8  # edit128 and chat128 off / k = 3 / k = 4, edit128 on fp32 off / k = 3
    )
    assert list(SECTIONS) == [
        "chat128", "policy", "slo", "prefix", "paged", "spec", "kvcache", "sinks", "kernels",
        "models", "kvtier", "lora",
    ]  # fmt: skip
    assert ",".join(SECTIONS) == f"{SERVING_SECTIONS},{MODEL_SECTIONS}"
    spec = [r for r in rows if r["section"] == "spec"]
    off, k3, k4 = (f"kvserve speculation {c}" for c in ("off", "on k=3", "on k=4"))
    assert [r["system"] for r in spec] == [off, k3, k4, off, k3, k4, off, k3]
    for r in spec:
        (report,) = r["raw"]["rounds"]
        assert report["requests"]["ok"] == r["requests"] == 1
        assert report["output_tokens_total"] == 8 and r["out_tok_s"] > 0
    assert [r["notes"] == "no drafts" for r in spec] == [r["system"] == off for r in spec]
    # slo: mixed traffic, then the loose-target case; stall-free then slo, one round each.
    slo = [r for r in rows if r["section"] == "slo"]
    assert [r["system"] for r in slo] == ["kvserve stall-free", "kvserve slo"] * 2
    for r, planned in zip(slo, (4, 4, 4, 4), strict=True):
        (report,) = r["raw"]["rounds"]
        assert report["requests"]["ok"] == r["requests"] == planned
        assert report["requests"]["failed"] == 0 and r["out_tok_s"] > 0
        assert r["raw"]["goodput"]["sent"] == planned
        assert r["notes"].startswith("goodput ") and f" of {planned}, ITL max " in r["notes"]
    assert [r["raw"]["rounds"][0]["goodput"]["slo_ttft_s"] for r in slo] == [2.0] * 2 + [3.0] * 2
    assert slo[1]["vs_baseline"].endswith("x tok/s") and "goodput" in slo[1]["vs_baseline"]
    served = [r for r in rows if r["system"].startswith("kvserve")]
    served = [r for r in served if r["section"] not in ("spec", "slo")]
    assert len(served) == 6  # chat128, policy and prefix: 2 each
    for r in served:
        assert r["raw"]["requests"]["failed"] == 0, r["system"]
        assert r["raw"]["requests"]["ok"] == r["requests"] > 0
        assert r["out_tok_s"] > 0
    kv_chat = [r for r in served if r["section"] == "chat128"]
    assert [r["raw"]["output_tokens_total"] for r in kv_chat] == [1 * 8, 2 * 8]
    assert [r["llama_cpp_tok_s"] for r in kv_chat] == ["not measured: --llama-cpp off"] * 2
    assert doc["llama_cpp"]["reports_by_users"] == {"1": "--llama-cpp off", "2": "--llama-cpp off"}


def test_kv_cache_table_and_integration() -> None:
    """The kvcache table pairs both strategies per length with their ratio; the whole-
    sequence time integrates the per-token times with the trapezoid rule (a flat curve of
    2 ms gives 2 ms x L)."""
    points = [
        Point("always", 64, 5.0, (5.0,), (7, 8)),
        Point("disabled", 64, 50.0, (50.0,), (7, 8)),
        Point("always", 128, 6.0, (6.0,), (7, 8)),
        Point("disabled", 128, 110.0, (110.0,), (7, 9)),
    ]
    lines = kv_cache_table(points).splitlines()
    assert lines[2:] == [
        "| 64 | 5.0 | 50.0 | 10.0x | yes |",
        "| 128 | 6.0 | 110.0 | 18.3x | no |",
    ]
    assert _integrated_s([64, 128, 256], [2.0, 2.0, 2.0]) == [0.128, 0.256, 0.512]
    assert _integrated_s([64, 128], [5.0, 6.0]) == pytest.approx([0.32, 0.32 + 5.5 * 64 / 1e3])
