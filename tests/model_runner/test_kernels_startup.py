"""Start-up never touches kvserve's CPU kernels unless a CPU model with quantized weights
needs them: building them is minutes of g++, and a CUDA runner has no use for them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from model_runner import kernels
from model_runner.attention_backends import AttentionSpec, make_attention_backend
from model_runner.config import RunnerOptions
from model_runner.fused_step import FusedStep
from model_runner.kv_pool import KVPool
from model_runner.model import LlamaModel
from model_runner.paths import make_paths
from model_runner.quant import resolve_weights_mode
from model_runner.runner import TorchRunner
from tests.model_runner.oracle import our_config, plan, seq, tiny_hf


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``kernels.build`` / ``kernels.load`` replaced by stand-ins that record the call and
    raise: a test using this fixture fails where start-up reaches for the kernels."""
    calls: list[str] = []

    def refuse(name: str) -> Any:
        def call(*args: object, **kwargs: object) -> None:
            calls.append(name)
            raise AssertionError(f"kernels.{name} called")

        return call

    monkeypatch.setattr(kernels, "build", refuse("build"))
    monkeypatch.setattr(kernels, "load", refuse("load"))
    return calls


def _meta_model(backend: str) -> tuple[LlamaModel, KVPool]:
    """A real ``LlamaModel`` and pool in bf16 on the ``meta`` device (a non-CPU model
    without a GPU): tensors with shapes and no storage."""
    hf = tiny_hf("llama-gqa")
    config = our_config(hf)
    device = torch.device("meta")
    spec = AttentionSpec(
        config.num_heads, config.num_kv_heads, config.head_dim, 4, torch.bfloat16,
        torch.bfloat16, device,
    )  # fmt: skip
    attention = make_attention_backend(backend, spec)
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    model = LlamaModel(config, state, torch.bfloat16, device, attention)
    pool = KVPool.from_config(config, 8, 4, torch.bfloat16, device, torch.bfloat16)
    return model, pool


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_non_cpu_model_builds_its_paths_without_the_kernels(
    backend: str, no_kernels: list[str]
) -> None:
    """A bf16 model on a non-CPU device (``meta``) through both attention backends: the
    fused check says why not (device and dtype, or the backend) and ``make_paths`` builds
    the eager path alone, with ``kernels.build`` / ``kernels.load`` never called."""
    model, pool = _meta_model(backend)
    assert FusedStep.unsupported(model, pool) == "needs fp32 compute on CPU"
    paths = make_paths(
        model, pool, fused_step=None, fused_max_rows=1 << 30, graph_sizes=(),
        max_model_len=256, scratch_slot=0,
    )  # fmt: skip
    assert paths.fused is None and paths.graphs is None
    with pytest.raises(ValueError, match="fused_step=True but"):
        make_paths(
            model, pool, fused_step=True, fused_max_rows=1, graph_sizes=(),
            max_model_len=256, scratch_slot=0,
        )  # fmt: skip
    assert no_kernels == []


def test_a_model_that_says_cuda_is_refused_before_the_kernels(no_kernels: list[str]) -> None:
    """The fused check of a model object on ``cuda`` (fp32 or bf16) answers from its
    device alone."""
    for dtype in (torch.float32, torch.bfloat16):
        model: Any = SimpleNamespace(
            device=torch.device("cuda"), dtype=dtype, rope_cis=torch.zeros(1), layers=[]
        )
        assert FusedStep.unsupported(model, SimpleNamespace()) == "needs fp32 compute on CPU"
    assert no_kernels == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cpu_runner_with_float_weights_never_loads_the_kernels(
    dtype: str, no_kernels: list[str]
) -> None:
    """A whole ``TorchRunner`` on CPU with float weights (fp32 and bf16 compute) starts,
    has no fused path, names its linear backend and runs a step, without the kernels."""
    hf = tiny_hf("llama-gqa")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    options = RunnerOptions(num_blocks=16, block_size=4, dtype=dtype, device="cpu")
    runner = TorchRunner(our_config(hf), state, options)
    assert runner.paths.fused is None
    assert not runner.info.linear_backend.startswith("kvserve")
    out = runner.execute(plan(0, prefill=[seq("a", [5, 6, 7], 0, 3, [0])]))
    assert set(out.sampled_token_ids) == {"a"}
    assert no_kernels == []


def test_weights_modes_off_the_kernels_answer_without_them(
    no_kernels: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``auto`` for a GGUF dequantizes for bf16 or a CUDA device and ``float32`` is kept,
    without asking for the kernels; ``native`` on CUDA is refused before them."""
    assert resolve_weights_mode("auto", True, "cpu", torch.bfloat16) == "float32"
    assert resolve_weights_mode("float32", True, "cpu", torch.float32) == "float32"
    assert resolve_weights_mode("auto", False, "cpu", torch.float32) == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_weights_mode("auto", True, "cuda", torch.bfloat16) == "float32"
    with pytest.raises(ValueError, match="--weights native runs on the CPU kernels"):
        resolve_weights_mode("native", True, "cuda", torch.bfloat16)
    assert no_kernels == []
