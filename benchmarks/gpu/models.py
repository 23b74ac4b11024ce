"""What the GPU sections measure against: the probes (copy bandwidth, matmul peak), the model
arithmetic (bytes and FLOPs a step needs at least), and the model itself: transformers' Llama
with random weights in the run's dtype and kvserve's runner over the same weights
(``GpuModels``, built when a section first needs them)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness.sizes import Sizes
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.hf_loader import normalize_hf_config
from model_runner.runner import TorchRunner

# ---------------------------------------------------------------------------- probes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls (after one warm-up call)."""
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_s(lambda: dst.copy_(src), device, repeats)


def matmul_peak(device: torch.device, n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of an ``n x n x n`` matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / best_s(lambda: a @ b, device, repeats)


# ---------------------------------------------------------------------------- model arithmetic


def linear_params_per_token(config: ModelConfig) -> int:
    """Weights every token multiplies by in the layers (QKV, O, gate, up, down)."""
    h, kvh, d = config.num_heads, config.num_kv_heads, config.head_dim
    hidden = config.hidden_size
    per_layer = hidden * (h + 2 * kvh) * d + h * d * hidden + 3 * hidden * config.intermediate_size
    return config.num_layers * per_layer


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


def decode_step_bytes(config: ModelConfig, batch: int, context: int, dtype_bytes: int) -> int:
    """Bytes a decode step must read at least: the layers' and the head's weights once, and
    every request's KV."""
    weights = (linear_params_per_token(config) + config.vocab_size * config.hidden_size) * (
        dtype_bytes
    )
    return weights + batch * context * kv_bytes_per_token(config, dtype_bytes)


def attention_flops(config: ModelConfig, num_pairs: int) -> int:
    """QK^T and PV over ``num_pairs`` (query, key) pairs, every layer and head."""
    return 4 * config.num_layers * config.num_heads * config.head_dim * num_pairs


def decode_step_flops(config: ModelConfig, batch: int, context: int) -> int:
    per_token = 2 * (linear_params_per_token(config) + config.vocab_size * config.hidden_size)
    return batch * per_token + attention_flops(config, batch * context)


def prefill_flops(config: ModelConfig, num_seqs: int, length: int) -> int:
    """Layers over every token, causal attention, the head on each prompt's last token."""
    layers = 2 * linear_params_per_token(config) * num_seqs * length
    head = 2 * config.vocab_size * config.hidden_size * num_seqs
    return layers + head + attention_flops(config, num_seqs * length * (length + 1) // 2)


# ---------------------------------------------------------------------------- models


def shape_config(sizes: Sizes, name: str = "shape") -> ModelConfig:
    """kvserve's config of the sizes' model shape (no weights)."""
    from transformers import LlamaConfig

    hf_config = LlamaConfig(**sizes.model).to_dict()
    return ModelConfig.from_hf_config(normalize_hf_config(hf_config), name=name)


def make_models(sizes: Sizes, device: torch.device) -> tuple[Any, ModelConfig]:
    """The transformers model with random weights (normal, std 0.02; norms 1) in the run's
    dtype on ``device``, and kvserve's config of it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(**sizes.model)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, sizes.dtype))
    try:
        with torch.device(device):
            hf = LlamaForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    config = ModelConfig.from_hf_config(normalize_hf_config(hf.config.to_dict()), name="llama3-8b")
    return hf.eval(), config


def make_runner(
    hf: Any, config: ModelConfig, sizes: Sizes, device: torch.device, backend: str
) -> TorchRunner:
    dtype = getattr(torch, sizes.dtype)
    options = RunnerOptions(
        block_size=sizes.block_size,
        dtype=dtype,
        device=device,
        kv_budget_bytes=sizes.kv_budget_bytes,
        kv_dtype=dtype,
        attention_backend=backend,
    )
    return TorchRunner(config, dict(hf.state_dict()), options)


class GpuModels:
    """The run's transformers model and kvserve runner, each built on first use;
    ``on_runner(runner)`` hears of each runner built (the report names its backend)."""

    def __init__(
        self,
        sizes: Sizes,
        device: torch.device,
        backend: str,
        on_runner: Callable[[TorchRunner], None] = lambda _: None,
    ) -> None:
        self.sizes = sizes
        self.device = device
        self.backend = backend
        self.on_runner = on_runner
        self.dtype = getattr(torch, sizes.dtype)
        self.dtype_bytes = torch.empty(0, dtype=self.dtype).element_size()
        self._models: tuple[Any, ModelConfig] | None = None
        self._runner: TorchRunner | None = None

    @property
    def models(self) -> tuple[Any, ModelConfig]:
        if self._models is None:
            self._models = make_models(self.sizes, self.device)
        return self._models

    @property
    def config(self) -> ModelConfig:
        return self.models[1]

    @property
    def runner(self) -> TorchRunner:
        if self._runner is None:
            hf, config = self.models
            self._runner = make_runner(hf, config, self.sizes, self.device, self.backend)
            self.on_runner(self._runner)
        return self._runner

    def drop_runner(self) -> None:
        """Free the runner (its pool): what transformers or the server needs next."""
        self._runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_all(self) -> None:
        """Free the runner and the models (the caller drops its own references)."""
        self._runner = self._models = None
