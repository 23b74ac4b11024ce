"""bench_gpu: its model arithmetic, and the --dry-run that runs every GPU section on CPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from benchmarks.bench_gpu import SECTIONS, main, parse_sections
from benchmarks.gpu.models import (
    decode_step_bytes,
    kv_bytes_per_token,
    linear_params_per_token,
    prefill_flops,
)
from benchmarks.harness import registry
from benchmarks.harness.context import Context
from benchmarks.harness.report import Report
from benchmarks.harness.sizes import DRY, FULL, LLAMA3_8B, QUICK
from model_runner.config import ModelConfig
from model_runner.hf_loader import normalize_hf_config


def _llama3_8b() -> ModelConfig:
    from transformers import LlamaConfig

    hf = LlamaConfig(**LLAMA3_8B).to_dict()
    return ModelConfig.from_hf_config(normalize_hf_config(hf), name="llama3-8b")


def test_llama3_8b_shape_has_its_published_parameter_count() -> None:
    """Layers' linear weights + LM head = 8,030,261,248 (Llama-3-8B) minus the embedding
    (128256 x 4096) and the 65 norms of 4096; KV is 128 KiB per token in bf16."""
    config = _llama3_8b()
    head = config.vocab_size * config.hidden_size
    norms = (2 * config.num_layers + 1) * config.hidden_size
    assert linear_params_per_token(config) + head == 8_030_261_248 - head - norms
    assert kv_bytes_per_token(config, 2) == 128 * 1024


def test_decode_bytes_and_prefill_flops_count_what_a_step_reads_and_does() -> None:
    """A decode step reads the weights once plus each request's KV; prefill FLOPs are 2 per
    weight per token, the head on the last token, and causal attention pairs."""
    config = _llama3_8b()
    weights = (linear_params_per_token(config) + config.vocab_size * config.hidden_size) * 2
    assert decode_step_bytes(config, 1, 0, 2) == weights
    assert decode_step_bytes(config, 4, 100, 2) == weights + 4 * 100 * 128 * 1024
    one_token = prefill_flops(config, 1, 1)
    assert one_token == 2 * (weights // 2) + 4 * 32 * 32 * 128
    assert prefill_flops(config, 2, 1) == 2 * one_token


def test_dry_run_runs_every_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--dry-run`` (tiny model, CPU, the kernel interpreted, the server on CPU) reports the
    decode kernel at every (batch, keys) and the sweep, each within 1e-4 of the reference,
    decode at batch 1/32/128/256, a prefill, a profile of each profiled batch (top ops with
    their share of the step), serving at three user counts with the busy fraction and
    against transformers, and the server over HTTP at the same user counts against the
    closed loop, every request served; each section's table printed in order."""
    out = tmp_path / "report.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert report["sections"] == list(SECTIONS)
    cases = [(r["batch"], r["keys"], r["config"]) for r in report["attention"]]
    assert cases == [
        *((b, k, "default") for k in DRY.attention.keys for b in DRY.attention.batches),
        *((3, 20, f"{n}/{w}/{s}") for n, w, s in DRY.attention.configs),
    ]
    assert all(r["gb_s"] > 0 and r["max_abs_err"] < 1e-4 for r in report["attention"])
    assert [d["batch"] for d in report["decode"]] == [1, 32, 128, 256]
    assert all(d["step_ms"] > 0 and d["of_hbm_roofline"] > 0 for d in report["decode"])
    assert report["prefill"]["of_matmul_peak"] > 0
    assert [p["batch"] for p in report["profile"]] == list(DRY.profile_batches)
    for p in report["profile"]:
        assert p["kernels_ms"] > 0 and p["step_ms"] > 0 and p["top"]
        shares = [k["of_step"] for k in p["top"]]
        assert shares == sorted(shares, reverse=True) and shares[-1] > 0
        assert any("linear" in k["name"] or "mm" in k["name"] for k in p["top"])
    assert [s["users"] for s in report["serving"]] == [1, 4, 8]
    assert all(s["ratio"] > 0 and 0 < s["gpu_busy"] <= 1 for s in report["serving"])
    assert all(s["steps"] >= DRY.output_len for s in report["serving"])
    server = report["server"]
    assert [s["users"] for s in server] == [1, 4, 8]
    for row, loop in zip(server, report["serving"], strict=True):
        assert row["ok"] == row["requests"] == loop["requests"] and row["failed"] == 0
        assert row["output_tokens"] == row["requests"] * DRY.output_len
        assert row["closed_loop_tok_s"] == loop["kvserve_tok_s"]
        assert row["of_closed_loop"] == pytest.approx(row["tok_s"] / loop["kvserve_tok_s"])
    probes = report["probes"]
    assert probes["copy_bandwidth_gb_s"] > 0 and probes["matmul_peak_tflop_s"] > 0
    printed = capsys.readouterr().out
    marks = ["copy bandwidth", "| decode kernel", "| decode batch", "prefill 2 x 32",
             "| kernel | us / step", "| users | requests | steps", "serve over HTTP"]  # fmt: skip
    assert [printed.index(m) for m in marks] == sorted(printed.index(m) for m in marks)


def test_quick_sizes_keep_every_headline_shape() -> None:
    """``--quick``: the full model and context, the decode kernel at 1 x 8,192 keys (the
    sweep there too), decode and the profile at batch 1 and 256, serving and the server at
    256 users with 2 requests each; transformers only when asked (``--transformers``),
    always in the dry run."""
    assert QUICK.model == FULL.model and QUICK.dtype == FULL.dtype
    assert QUICK.decode_context == FULL.decode_context == 512
    assert QUICK.decode_batches == QUICK.profile_batches == (1, 256)
    assert (1, 8192) in QUICK.attention.sweep and 8192 in QUICK.attention.keys
    assert 1 in QUICK.attention.batches and 256 in QUICK.attention.batches
    assert QUICK.users == (256,) and QUICK.requests_per_user == 2
    assert not QUICK.transformers and not FULL.transformers and DRY.transformers
    assert QUICK.decode_steps > QUICK.profile_steps


def test_sections_pick_some_and_each_is_saved_as_measured(tmp_path: Path) -> None:
    """``--sections attention`` measures the probes (the denominators) and the kernel only;
    the JSON is written after each section, so it holds the probes before the kernel runs."""
    out = tmp_path / "report.json"
    seen: list[list[str]] = []

    def save(report: Report) -> None:
        seen.append(list(report.sections))

    ctx = Context("gpu", "dry", DRY, emit=lambda _: None, save=save, device="cpu")
    report = registry.run(ctx, ["attention"])
    assert seen == [["probes"], ["probes", "attention"]]
    assert report.sections == ["probes", "attention"] and report.extra("decode") is None
    assert main(["--dry-run", "--sections", "probes", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["sections"] == ["probes"]


def test_sections_argument_names_known_sections() -> None:
    """``all`` is every section; an unknown name is refused with the known ones."""
    assert parse_sections("all") == list(SECTIONS)
    assert parse_sections("decode, attention") == ["decode", "attention"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown sections"):
        parse_sections("decode,bogus")
