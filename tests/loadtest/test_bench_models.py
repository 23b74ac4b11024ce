"""`python -m benchmarks.run_all --quick` over the model sections (kvcache, sinks, kernels,
models, kvtier, lora) on the real model; the serving sections run in test_bench.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.loadtest.test_bench import MODEL_SECTIONS, run_quick


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_run_all_quick_model_sections_print_their_tables_and_write_json(tmp_path: Path) -> None:
    """Each model section's figures in the JSON and its table in the output; no serving row."""
    done, doc = run_quick(MODEL_SECTIONS, tmp_path)
    assert doc["rows"] == []
    # lora (quick: the embedded model, rank 4, llama.cpp off): base and 8 adapters on one
    # server interleaved, then one adapter against llama-server (not measured).
    lora = doc["lora"]
    assert [r["kind"] for r in lora["runs"]] == [
        "kvserve-base", "kvserve-8-adapters", "kvserve-8-adapters", "kvserve-base",
        "kvserve-1-adapter", "llama.cpp-lora", "llama.cpp-lora", "kvserve-1-adapter",
    ]  # fmt: skip
    assert all(r["ok"] and r["output_tok_s"] > 0 for r in lora["runs"] if "kvserve" in r["kind"])
    assert all(r["error"].startswith("not measured") for r in lora["runs"] if "llama" in r["kind"])
    assert "LoRA adapters (lora)" in done.stdout
    # models (quick: the embedded file only, llama.cpp off): kvserve's rows, the peers'
    # reasons, a bandwidth probe.
    # kvtier (quick: the embedded model, llama.cpp off): the three kvserve configurations
    # measured, the peer's reason.
    kvtier = {r["config"]: r for r in doc["kvtier"]["runs"]}
    assert list(kvtier) == [
        "kvserve, pool holds all", "kvserve, tier on", "kvserve, tier off",
        "llama.cpp --cache-ram",
    ]  # fmt: skip
    assert all(kvtier[c]["ttft_p50_s"] > 0 for c in list(kvtier)[:3])
    assert kvtier["llama.cpp --cache-ram"]["note"] == "not measured: no llama-server build"
    # kernels (quick: two types at n = 1 and 8, llama.cpp off): kvserve's timings at both
    # activation precisions, ggml's reason.
    kern = doc["kernels"]
    assert kern["ggml"].startswith("not measured")
    assert [t["type"] for t in kern["types"]] == ["q4_0", "q4_K"]
    for t in kern["types"]:
        assert set(t["kv16_us"]) == set(t["kv8_us"]) == {"1", "8"}
        assert all(us > 0 for us in [*t["kv16_us"].values(), *t["kv8_us"].values()])
    assert "Quantized matmul against ggml (kernels)" in done.stdout
    # the real shapes' row (quick: one shape), rotated over copies, beside the read probe
    (shape,) = kern["shapes"]["rows"][:1]
    assert (shape["matrix"], shape["m"], shape["k"], shape["threads"]) == ("o", 2048, 2048, 1)
    assert shape["copies"] * shape["weight_bytes"] >= kern["shapes"]["rotation_bytes"]
    assert shape["kernel_gb_s"] > 0 and shape["read_gb_s"] > 0
    assert shape["load_avg"] >= 0 and kern["shapes"]["cpu"]  # beside every figure
    assert "M = 1 at the real models' shapes" in done.stdout
    assert kern["shapes"]["tuning"] and kern["shapes"]["tuning_source"]  # the knobs it ran
    # the tuning candidates (quick: one shape, M = 1, one thread), each timed, the fastest named
    tuning = kern["tuning"]
    assert set(tuning["candidates"]) == {
        "defaults", "table", "one group, no prefetch", "pairs, no prefetch"
    }  # fmt: skip
    (trow,) = tuning["rows"]
    assert (trow["matrix"], trow["threads"], trow["rows"]) == ("o", 1, 1)
    assert set(trow["us"]) == set(tuning["candidates"]) and all(v > 0 for v in trow["us"].values())
    assert "Kernel tuning on this machine" in done.stdout
    (model,) = doc["models"]
    assert model["model"] == "embedded" and model["read_gbs"] > 0
    assert model["kv_prefill_tok_s"] > 0 and model["kv_decode_tok_s"] > 0
    assert model["llama_bench"] == "not measured: no llama-bench build"
    assert list(model["chat128"]) == ["1", "2"]
    assert all(p["kvserve"]["ok"] == int(u) for u, p in model["chat128"].items())
    assert all(p["llama.cpp"].startswith("not measured") for p in model["chat128"].values())
    assert "Real GGUF files (models)" in done.stdout
    points = doc["kvcache"]["points"]
    assert [(p["strategy"], p["length"]) for p in points] == [
        (s, n) for n in (64, 128, 256) for s in ("always", "disabled")
    ]
    assert all(len(p["samples_ms"]) == 2 and p["ms_per_token"] > 0 for p in points)
    assert all(len(p["token_ids"]) == 3 for p in points)
    assert Path(doc["kvcache"]["png"]).stat().st_size > 10_000
    assert "| Sequence length (tokens) |" in done.stdout
    sinks = {r["name"]: r for r in doc["sinks"]}
    assert list(sinks) == ["sinks 4 + window 124", "window 128 alone", "full attention"]
    assert all(r["num_scored"] == 511 and r["perplexity"] > 1 for r in sinks.values())
    # The window holds at most 124 + a 64-token chunk + a block; sinks add their block.
    assert sinks["window 128 alone"]["peak_kv_slots"] <= 128 + 64 + 16
    assert sinks["sinks 4 + window 124"]["peak_kv_slots"] <= 16 + 124 + 64 + 16


def test_a_kv8_row_is_named_so_in_every_table() -> None:
    """`--activation-bits 8` rows say so beside the model's name (the runner, one-thread and
    chat128 tables); the default's rows keep the bare name."""
    from benchmarks import bench_models

    rows = [
        bench_models.ModelRow("random-1b-q4km", 1, "llama-quantize", activation_bits=bits)
        for bits in (16, 8)
    ]
    for row in rows:
        row.read_gbs_1t, row.kv_decode_tok_s_1t = 30.0, 20.0
        row.chat128 = {"8": {"kvserve": "x", "llama.cpp": "y"}}
    table = bench_models.format_table(rows)
    assert table.count("| random-1b-q4km (kv8) |") == 3
    assert table.count("| random-1b-q4km |") == 3


def test_llama_benchs_decode_runs_at_the_context_kvserves_decodes_from(tmp_path: Path) -> None:
    """kvserve's batch-1 decode steps read a 512-token KV (128 on one thread), so llama-bench's
    tg runs at that depth (`-d`): the pp and tg rates come from two runs, merged, and a run
    that fails gives its reason."""
    import stat

    from benchmarks import bench_models

    log = tmp_path / "args"
    fake = tmp_path / "llama-bench"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
        "a = sys.argv; p = int(a[a.index('-p') + 1]); n = int(a[a.index('-n') + 1])\n"
        "d = int(a[a.index('-d') + 1])\n"
        "out = [{'n_prompt': p, 'n_gen': 0, 'avg_ts': 100.0}] if p else []\n"
        "out += [{'n_prompt': 0, 'n_gen': n, 'avg_ts': 40.0 - d / 128}] if n else []\n"
        "print(json.dumps(out))\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    model = tmp_path / "m.gguf"
    pp = bench_models.llama_bench(fake, model, 2, bench_models.DECODE_FROM, 0)
    tg = bench_models.llama_bench(fake, model, 2, 0, 128, depth=bench_models.DECODE_FROM)
    assert bench_models._both(pp, tg) == {"pp512": 100.0, "tg128": 36.0}
    runs = log.read_text().splitlines()
    assert "-p 512 -n 0 -d 0" in runs[0] and "-p 0 -n 128 -d 512" in runs[1]
    assert bench_models._both("not measured: x", tg) == "not measured: x"
    assert bench_models._both(pp, "not measured: y") == "not measured: y"
