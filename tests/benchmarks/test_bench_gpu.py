"""bench_gpu: its model arithmetic, and the --dry-run that runs every section on CPU."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bench_gpu import (
    LLAMA3_8B,
    decode_step_bytes,
    kv_bytes_per_token,
    linear_params_per_token,
    main,
    prefill_flops,
)
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


def test_dry_run_runs_every_section(tmp_path: Path) -> None:
    """``--dry-run`` (tiny model, CPU) reports decode at batch 1/32/128/256, a prefill, and
    serving at three user counts against transformers, with positive figures."""
    out = tmp_path / "report.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    assert [d["batch"] for d in report["decode"]] == [1, 32, 128, 256]
    assert all(d["step_ms"] > 0 and d["of_hbm_roofline"] > 0 for d in report["decode"])
    assert report["prefill"]["of_matmul_peak"] > 0
    assert [s["users"] for s in report["serving"]] == [1, 4, 8]
    assert all(s["ratio"] > 0 for s in report["serving"])
    assert report["copy_bandwidth_gb_s"] > 0 and report["matmul_peak_tflop_s"] > 0
