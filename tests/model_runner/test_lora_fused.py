"""LoRA on the fused CPU kernels (``kernels/lora.h``): the same updates as the torch path, and
each row's numbers independent of its batch, bit for bit, with rows of other adapters and of
the base model beside it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model_runner import kernels
from scheduler.request import LoraRef
from tests.model_runner.lora_oracle import peft_adapter, with_lora
from tests.model_runner.oracle import plan, random_ids, seq
from tests.model_runner.test_quant import assert_close, quantized_pair

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")


@pytest.fixture(params=kernels.supported_isas() or ["portable"])
def isa(request: pytest.FixtureRequest) -> str:
    """Every ISA family this CPU has (the lora products are compiled in each)."""
    previous = kernels.isa()
    kernels.use_isa(request.param)
    yield request.param
    kernels.use_isa(previous)


def load_adapters(runners: list[object], hf: torch.nn.Module, folder: Path) -> dict[str, LoraRef]:
    """Three adapters of ``hf`` (ranks 2, 4, 8; the second on q and v only, Phi-3: on its
    fused qkv_proj only) in every runner."""
    phi3 = hf.config.model_type == "phi3"
    every = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"] if phi3 else None
    refs = {}
    for name, r, seed, targets in (
        ("x", 2, 1, every),
        ("y", 4, 2, ["qkv_proj"] if phi3 else ["q_proj", "v_proj"]),
        ("z", 8, 3, every),
    ):
        peft_adapter(hf, folder / name, r=r, seed=seed, targets=targets)
        for runner in runners:
            runner.lora.load(name, folder / name)  # type: ignore[attr-defined]
        refs[name] = runners[0].lora.resolve(name)  # type: ignore[attr-defined]
    return refs


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "phi4-mini"])
def test_fused_lora_equals_the_torch_path(tmp_path: Path, isa: str, kind: str) -> None:
    """A step with three adapters' prefill chunks and the base model's, then decodes: the
    fused kernel's logits equal the torch path's (same quantized GEMMs, fp16 adapters
    against the torch path's fp32 ones) within 5e-2 of max|logit|, as the fused step without
    adapters does; the updates change the logits by far more than that. Qwen3: the
    adapters' Q and K updates land before the kernel's QK-norm; Phi-4-mini: adapters on its
    fused projections, Q and K rows in its partial-rotary pair order."""
    fused, hf = quantized_pair(kind, "q4", fused_step=True)
    plain, _ = quantized_pair(kind, "q4", fused_step=False)
    assert fused.paths.fused is not None
    assert fused.lora_dtype == torch.float16 and plain.lora_dtype == torch.float32
    refs = load_adapters([fused, plain], hf, tmp_path)
    names = ["x", "y", "z", "base"]
    prompts = {n: random_ids(5 + 4 * i, seed=20 + i) for i, n in enumerate(names)}
    tables = {"x": [1, 2], "y": [3, 4, 5], "z": [6, 7, 8, 9], "base": [10, 11, 12, 13, 14]}
    chunks = [
        with_lora(seq(n, prompts[n], 0, len(prompts[n]), tables[n]), refs.get(n)) for n in names
    ]
    got = fused.step_logits(plan(0, prefill=chunks))
    want = plain.step_logits(plan(0, prefill=chunks))
    base = plain.step_logits(
        plan(0, prefill=[seq(n, prompts[n], 0, len(prompts[n]), tables[n]) for n in names])
    )
    for n in names:
        assert_close(got[n], want[n], 5e-2)
        if n != "base":
            assert (want[n] - base[n]).abs().max() > 0.1 * want[n].abs().max()


def test_a_rows_numbers_do_not_depend_on_its_batch_with_adapters(tmp_path: Path, isa: str) -> None:
    """Three adapters and the base model in one step (prefill chunks, then decodes, one of
    them at scale 0.5): every request's logits are bit-identical to the same request run
    alone, and so are its greedy tokens over 6 steps."""
    runner, hf = quantized_pair("llama-gqa", "q4", fused_step=True)
    alone, _ = quantized_pair("llama-gqa", "q4", fused_step=True)
    refs = load_adapters([runner, alone], hf, tmp_path)
    refs["x"] = LoraRef("x", refs["x"].key, 0.5)
    names = ["x", "y", "z", "base"]
    prompts = {n: random_ids(6 + 5 * i, seed=30 + i) for i, n in enumerate(names)}
    tables = {n: list(range(1 + 10 * i, 11 + 10 * i)) for i, n in enumerate(names)}

    def rows(step: int, which: list[str], decode: bool) -> object:
        seqs = []
        for n in which:
            ids = prompts[n]
            start = len(ids) - 1 if decode else 0
            seqs.append(with_lora(seq(n, ids, start, len(ids), tables[n]), refs.get(n)))
        return plan(step, decode=seqs) if decode else plan(step, prefill=seqs)

    for step in range(6):
        together = runner.step_logits(rows(step, names, decode=step > 0))
        for n in names:
            single = alone.step_logits(rows(step, [n], decode=step > 0))[n]
            assert torch.equal(together[n], single), (n, step)
            prompts[n] = [*prompts[n], int(together[n][-1].argmax())]
