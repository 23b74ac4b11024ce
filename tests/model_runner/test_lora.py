"""LoRA adapters on the torch path against transformers + PEFT, and their loading: PEFT
directories and GGUF files, the layout mapping, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model_runner.lora.files import read_adapter
from model_runner.lora.info import (
    AdapterConflictError,
    AdapterCounts,
    AdapterError,
    AdapterNotFoundError,
)
from model_runner.runner import TorchRunner
from scheduler.request import LoraRef
from tests.model_runner.lora_oracle import gguf_lora, peft_adapter, with_lora
from tests.model_runner.oracle import (
    assert_close,
    hf_logits,
    make_runner,
    plan,
    random_ids,
    seq,
    tiny_hf,
)


def logits_with(runner: TorchRunner, ids: list[int], ref: LoraRef | None) -> torch.Tensor:
    """Every position's logits of a fresh prompt, in one prefill, with ``ref``'s adapter."""
    table = list(range(1, 1 + -(-len(ids) // runner.block_size)))
    chunk = with_lora(seq("a", ids, 0, len(ids), table), ref)
    return runner.step_logits(plan(0, prefill=[chunk]))["a"]


@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "qwen2", "mistral", "qwen3", "gemma3"])
def test_peft_adapter_gives_transformers_peft_logits(kind: str, tmp_path: Path) -> None:
    """A random PEFT adapter on every projection (B not zero), loaded from PEFT's own files:
    every position's logits equal transformers + PEFT's within 1e-4, and differ from the base
    model's by far more (the update is applied, Q and K rows mapped to our RoPE layout; on
    Gemma 3, o's and down's before their output norms, gate's before the GELU)."""
    hf = tiny_hf(kind)
    reference = peft_adapter(hf, tmp_path / "a", r=4, alpha=8)
    runner = make_runner(hf)
    info = runner.lora.load("a", tmp_path / "a")
    assert info.rank == 4 and info.kind == "peft" and len(info.target_modules) == 7
    ids = random_ids(13, seed=1)
    ours = logits_with(runner, ids, runner.lora.resolve("a"))
    assert_close(ours, hf_logits(reference, ids))
    base = logits_with(runner, ids, None)
    assert_close(base, hf_logits(hf, ids))
    assert (ours - base).abs().max() > 0.1


def test_rslora_patterns_and_some_modules(tmp_path: Path) -> None:
    """rsLoRA's scaling (alpha / sqrt(r)), per-module ranks and alphas (rank_pattern,
    alpha_pattern) and an adapter on q and v only (PEFT's default) match PEFT."""
    hf = tiny_hf("llama-gqa")
    reference = peft_adapter(
        hf, tmp_path / "a", r=4, alpha=16, targets=["q_proj", "v_proj", "down_proj"],
        use_rslora=True, rank_pattern={"down_proj": 2}, alpha_pattern={"v_proj": 3},
    )  # fmt: skip
    runner = make_runner(hf)
    info = runner.lora.load("a", tmp_path / "a")
    assert info.target_modules == ("q_proj", "v_proj", "down_proj")
    ids = random_ids(9, seed=2)
    assert_close(logits_with(runner, ids, runner.lora.resolve("a")), hf_logits(reference, ids))


@pytest.mark.parametrize("tensor_type", ["F32", "F16"])
def test_gguf_adapter_equals_its_peft_source(tensor_type: str, tmp_path: Path) -> None:
    """A GGUF LoRA written as llama.cpp's converter writes it (Q / K lora_b rows permuted for
    the llama architecture, alpha in adapter.lora.alpha) gives PEFT's logits (an F16 file:
    PEFT's with the same fp16 values): the rows are put back before the mapping to our
    layout."""
    hf = tiny_hf("llama-gqa")
    reference = peft_adapter(hf, tmp_path / "a", r=4, alpha=8)
    path = gguf_lora(
        tmp_path / "a", tmp_path / "a.gguf", num_heads=4, num_kv_heads=2, tensor_type=tensor_type
    )
    adapter = read_adapter(path)
    assert adapter.kind == "gguf" and adapter.qk_layout == "gguf" and adapter.alpha == 8
    runner = make_runner(hf)
    runner.lora.load("g", path)
    if tensor_type == "F16":  # the file holds fp16 values: so does the reference
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if "lora_" in name:
                    p.copy_(p.half().float())
    ids = random_ids(11, seed=3)
    assert_close(logits_with(runner, ids, runner.lora.resolve("g")), hf_logits(reference, ids))


def test_llama_cpps_converter_output_equals_its_peft_source(tmp_path: Path) -> None:
    """A PEFT adapter converted by llama.cpp's own convert_lora_to_gguf.py (f32; from the
    build the benchmarks use, skipped without it) lays out exactly as the PEFT directory:
    the converter's Q / K permutation is undone, its alpha read."""
    import os
    import subprocess
    import sys

    from benchmarks.bench_llama_cpp import default_cache_dir
    from benchmarks.bench_lora import converter_path
    from benchmarks.tools.make_random_lora import write_base_config
    from model_runner.lora.layout import lay_out
    from tests.model_runner.oracle import our_config

    converter = converter_path(default_cache_dir(os.environ))
    if converter is None:
        pytest.skip("no llama.cpp source with convert_lora_to_gguf.py")
    hf = tiny_hf("llama-gqa")
    peft_adapter(hf, tmp_path / "a", r=4, alpha=8)
    config = our_config(hf)
    base = write_base_config(tmp_path / "base", config)
    env = {**os.environ, "PYTHONPATH": str(converter.parent / "gguf-py")}
    out = tmp_path / "a.gguf"
    cmd = [sys.executable, str(converter), str(tmp_path / "a"), "--base", str(base),
           "--outtype", "f32", "--outfile", str(out)]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=600)
    cpu = torch.device("cpu")
    ours = lay_out(read_adapter(tmp_path / "a"), config, torch.float32, cpu)
    theirs = lay_out(read_adapter(out), config, torch.float32, cpu)
    for layer, pairs in enumerate(ours.layers):
        assert pairs.keys() == theirs.layers[layer].keys()
        for target, (a, bt) in pairs.items():
            torch.testing.assert_close(theirs.layers[layer][target][0], a, rtol=0, atol=0)
            torch.testing.assert_close(theirs.layers[layer][target][1], bt, rtol=1e-6, atol=1e-7)


def test_rows_of_different_adapters_and_the_base_in_one_step(tmp_path: Path) -> None:
    """Three adapters and the base model in one step (two prefill chunks, one of them over a
    cached prefix, and decodes): each request's logits equal its own adapter's reference."""
    hf = tiny_hf("llama-gqa")
    refs = {
        name: peft_adapter(hf, tmp_path / name, r=r, seed=seed)
        for name, r, seed in (("x", 2, 1), ("y", 4, 2), ("z", 8, 3))
    }
    runner = make_runner(hf)
    for name in refs:
        runner.lora.load(name, tmp_path / name)
    models = {"x": refs["x"], "y": refs["y"], "z": refs["z"], "base": hf}
    prompts = {name: random_ids(6 + 3 * i, seed=10 + i) for i, name in enumerate(models)}
    tables = {
        "x": [1, 2, 3, 4, 5],
        "y": [6, 7, 8, 9],
        "z": [10, 11, 12, 13, 14],
        "base": [15, 16, 17, 18],
    }

    def ref(name: str) -> LoraRef | None:
        return None if name == "base" else runner.lora.resolve(name)

    # Step 0: x and y prefill their prompts but the last token; z and base their first 4.
    first = [
        with_lora(seq(n, prompts[n], 0, len(prompts[n]) - 1 if n in "xy" else 4, tables[n]), ref(n))
        for n in models
    ]
    runner.step_logits(plan(0, prefill=first))
    # Step 1: z and base finish their prompts (chunks over a cached prefix), x and y decode.
    second_p = [
        with_lora(seq(n, prompts[n], 4, len(prompts[n]), tables[n]), ref(n)) for n in ("z", "base")
    ]
    second_d = [
        with_lora(seq(n, prompts[n], len(prompts[n]) - 1, len(prompts[n]), tables[n]), ref(n))
        for n in "xy"
    ]
    got = runner.step_logits(plan(1, prefill=second_p, decode=second_d))
    for name, model in models.items():
        want = hf_logits(model, prompts[name])
        rows = got[name]
        assert_close(rows, want[len(want) - len(rows) :])


def test_an_adapter_that_is_not_loaded_fails_its_request_alone(tmp_path: Path) -> None:
    """A seq whose adapter is not resident (unloaded under it) fails with a clear error; the
    other seqs of the step run."""
    hf = tiny_hf("llama")
    peft_adapter(hf, tmp_path / "a")
    runner = make_runner(hf)
    runner.lora.load("a", tmp_path / "a")
    stale = runner.lora.resolve("a")
    runner.lora.unload("a")
    ids = random_ids(5, seed=4)
    step = plan(
        0, prefill=[with_lora(seq("r1", ids, 0, 5, [1, 2]), stale), seq("r2", ids, 0, 5, [3, 4])]
    )
    out = runner.execute(step)
    assert "not loaded" in out.failed["r1"]
    assert set(out.sampled_token_ids) == {"r2"}


# ---------------------------------------------------------------------- refusals


def _runner() -> tuple[torch.nn.Module, TorchRunner]:
    hf = tiny_hf("llama-gqa")
    return hf, make_runner(hf, max_lora_rank=8)


def test_an_adapter_for_another_model_is_refused(tmp_path: Path) -> None:
    """An adapter trained on a model of other shapes is refused with the file, the layer, the
    module and both shapes in the message; the registry stays as it was."""
    other = tiny_hf("llama-gqa", hidden_size=32, intermediate_size=64)
    peft_adapter(other, tmp_path / "other")
    _, runner = _runner()
    with pytest.raises(
        AdapterError,
        match=(
            r"other': layer 0 q_proj updates a 32 x 32 matrix; the base model's is 64 x 64: it "
            "was made for another model"
        ),
    ):
        runner.lora.load("o", tmp_path / "other")
    assert runner.lora.names() == []


def test_rank_over_the_limit_is_refused(tmp_path: Path) -> None:
    """A rank over --max-lora-rank is refused, naming both numbers."""
    hf, runner = _runner()
    peft_adapter(hf, tmp_path / "big", r=16)
    with pytest.raises(AdapterError, match=r"rank 16, over --max-lora-rank 8"):
        runner.lora.load("big", tmp_path / "big")


@pytest.mark.parametrize(
    "damage, reason",
    [
        ("truncate", r"cannot be read.*corrupt or truncated"),
        ("config", r"adapter_config.json is not valid JSON"),
        ("dora", r"DoRA"),
        ("embedding", r"not a LoRA pair"),
        ("no weights", r"no adapter_model.safetensors"),
        ("nan", r"non-finite"),
    ],
)
def test_bad_files_are_refused_with_the_reason(damage: str, reason: str, tmp_path: Path) -> None:
    """A truncated weights file, broken JSON, a DoRA adapter, a tensor that is not a
    projection's pair, a missing weights file and NaN weights: each an AdapterError naming
    the file and why."""
    from safetensors.torch import load_file, save_file

    hf, runner = _runner()
    folder = tmp_path / "a"
    peft_adapter(hf, folder)
    weights = folder / "adapter_model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:200])
    elif damage == "config":
        (folder / "adapter_config.json").write_text("{not json")
    elif damage == "dora":
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    elif damage == "embedding":
        tensors = load_file(str(weights))
        tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)
        save_file(tensors, str(weights))
    elif damage == "no weights":
        weights.unlink()
    elif damage == "nan":
        tensors = load_file(str(weights))
        key = next(iter(tensors))
        tensors[key][0, 0] = float("nan")
        save_file(tensors, str(weights))
    with pytest.raises(AdapterError, match=reason) as info:
        runner.lora.load("a", folder)
    assert str(folder) in str(info.value)


def test_a_model_gguf_is_not_an_adapter(tmp_path: Path) -> None:
    """The embedded model's GGUF given as an adapter: refused as a model, not an adapter."""
    from model_runner.gguf_loader import default_model_path

    with pytest.raises(AdapterError, match="is a model, not an adapter"):
        read_adapter(default_model_path())
    (tmp_path / "x.bin").write_bytes(b"nothing")
    with pytest.raises(AdapterError, match="neither a PEFT directory"):
        read_adapter(tmp_path / "x.bin")


# ---------------------------------------------------------------------- the registry


def test_names_conflicts_and_unknown_adapters(tmp_path: Path) -> None:
    """A taken name, the base model's name and a malformed name are refused; an unknown
    adapter is an AdapterNotFoundError that lists the loaded ones."""
    hf, runner = _runner()
    peft_adapter(hf, tmp_path / "a")
    runner.lora.load("a", tmp_path / "a")
    with pytest.raises(AdapterConflictError, match="already loaded"):
        runner.lora.load("a", tmp_path / "a")
    for taken in (runner.info.name, "base"):
        with pytest.raises(AdapterError, match="is taken: the base model's name"):
            runner.lora.load(taken, tmp_path / "a")
    with pytest.raises(AdapterError, match="adapter name"):
        runner.lora.load("bad name", tmp_path / "a")
    with pytest.raises(AdapterNotFoundError, match=r"no adapter named 'b'.*loaded adapters: 'a'"):
        runner.lora.resolve("b")


def test_unload_waits_for_the_requests_using_it(tmp_path: Path) -> None:
    """Unloading an adapter in use refuses new requests at once and keeps its weights until
    the last request releases it; loading the name again meanwhile is a conflict."""
    hf, runner = _runner()
    peft_adapter(hf, tmp_path / "a")
    runner.lora.load("a", tmp_path / "a")
    ref = runner.lora.resolve("a")
    runner.lora.acquire(ref)
    runner.lora.unload("a")
    with pytest.raises(AdapterNotFoundError):
        runner.lora.resolve("a")
    assert runner.lora.weights(ref) is not None  # the request in flight still runs
    with pytest.raises(AdapterConflictError, match="still unloading"):
        runner.lora.load("a", tmp_path / "a")
    runner.lora.release(ref)
    assert runner.lora.weights(ref) is None
    runner.lora.load("a", tmp_path / "a")


def test_lru_budget_evicts_unpinned_adapters_and_reads_them_back(tmp_path: Path) -> None:
    """With a budget of 2 resident adapters, loading a third drops the least recently used
    one that no request pins; acquiring it reads it back from disk (same digest, same
    logits). A changed file is refused on read-back."""
    hf = tiny_hf("llama-gqa")
    runner = make_runner(hf, max_cpu_loras=2)
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        peft_adapter(hf, tmp_path / name, seed=seed)
    runner.lora.load("a", tmp_path / "a")
    ids = random_ids(7, seed=5)
    before = logits_with(runner, ids, runner.lora.resolve("a"))
    runner.lora.load("b", tmp_path / "b")
    ref_b = runner.lora.resolve("b")
    runner.lora.acquire(ref_b)  # b pinned
    runner.lora.load("c", tmp_path / "c")
    resident = {i.name: i.resident for i in runner.lora.infos()}
    assert resident == {"a": False, "b": True, "c": True}
    assert runner.lora.counts() == AdapterCounts(resident=2, loads_total=3, evictions_total=1)
    ref_a = runner.lora.resolve("a")
    assert runner.lora.needs_read(ref_a)
    runner.lora.acquire(ref_a)  # read back; c (unpinned, least recent) goes
    resident = {i.name: i.resident for i in runner.lora.infos()}
    assert resident == {"a": True, "b": True, "c": False}
    assert runner.lora.counts() == AdapterCounts(resident=2, loads_total=4, evictions_total=2)
    torch.testing.assert_close(logits_with(runner, ids, ref_a), before, rtol=0, atol=0)
    runner.lora.release(ref_a)
    # c's file changes on disk: reading it back is refused.
    peft_adapter(hf, tmp_path / "c", seed=9)
    with pytest.raises(AdapterError, match="changed on disk"):
        runner.lora.acquire(runner.lora.resolve("c"))
    assert runner.lora.pins("c") == 0
