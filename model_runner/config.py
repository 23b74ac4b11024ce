"""The runner's configs, plain data and no torch (the CLI reads them without importing it):

- ``ModelConfig``: the shape and hyper-parameters of a model of a family in
  ``families.FAMILIES`` (Llama, Mistral, Qwen2, Qwen3, Phi-3, Qwen3-MoE, Mixtral, Gemma 3), from a
  Hugging Face ``config.json`` dict or from GGUF metadata;
- ``RunnerOptions``: how a ``TorchRunner`` runs it (device, dtypes, KV pool, attention
  backend, paths), built once by the server and ``dataclasses.replace``'d by benchmarks;
- the tables the CLI's choices come from: dtypes, attention backends, weights modes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cache_manager.sizing import ModelShape
from model_runner.families import Experts, for_hf_config

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One element type kvserve computes or stores KV in; torch-free (``device`` maps the
    names to ``torch.dtype``)."""

    name: str  # canonical: a key of DTYPES and torch's attribute name
    num_bytes: int
    aliases: tuple[str, ...] = ()
    kv_only: bool = False  # a KV cache precision only, never a model dtype
    # Bytes of the quantization scale a quantized KV cache stores per (token, KV head), K and
    # V each (``kv_pool.KV_SCALE_DTYPE``, fp32); 0 for a plain float cache.
    scale_bytes: int = 0


# The one dtype table: names, sizes, aliases, and which may hold a model or only KV.
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("float32", 4, ("fp32", "float")),
        DType("float16", 2, ("fp16", "half")),
        DType("bfloat16", 2, ("bf16",)),
        DType("int8", 1, kv_only=True, scale_bytes=4),
    )
}
MODEL_DTYPES = tuple(name for name, d in DTYPES.items() if not d.kv_only)
KV_DTYPE_CHOICES = ("auto", *DTYPES)
# The one table of attention backends (``model_runner.attention_backends``): name -> its class,
# as "module:Class" so the CLI reads the names without importing torch. The CLI's choices,
# ``resolve_attention_backend`` and ``auto`` read it; each class says where it runs
# (``available``) and what it serves (``unsupported``). ``auto``: on CUDA, the fastest of those
# that can run that matches the torch reference on a probe step; elsewhere torch.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "model_runner.attention_backends.torch_backend:TorchAttention",
    "triton": "model_runner.attention_backends.triton_backend:TritonAttention",
    "flashinfer": "model_runner.attention_backends.flashinfer_backend:FlashInferAttention",
}
ATTENTION_BACKEND_CHOICES = ("auto", *ATTENTION_BACKENDS)
# How the loader holds a checkpoint's matrices (``loader.load_model(weights=...)``): here, not
# in ``quant``, so the CLI reads the choices without importing torch.
WEIGHT_MODES: tuple[str, ...] = ("auto", "float32", "native", "int8")
# Activation precision of the quantized kernels (``--activation-bits``): 16 = int8 plus a
# residual byte (~15 bits, two vpdpbusd per weight vector; the dequantized model's answers),
# 8 = int8 alone (ggml's q8_0 precision).
ACTIVATION_BITS = (16, 8)


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """How a ``TorchRunner`` runs its model; fixed for the runner's life, validated here.

    The KV pool: ``num_blocks`` blocks of ``block_size`` tokens (None: as many as
    ``kv_budget_bytes`` holds, default ``kv_pool.default_kv_budget_bytes``, measured after the
    weights are on the device), stored in ``kv_dtype`` (``device.resolve_kv_dtype``; None =
    auto: float16 on CPU for a float32 model, else the model's dtype), while attention
    computes in ``dtype`` (None: the device's best). ``max_model_len`` (default and cap: the
    config's ``max_position_embeddings``) bounds positions and sizes the RoPE table;
    ``sliding_window`` (tokens) overrides the config's window; ``attention_sinks`` (tokens,
    needs a window) keeps the first tokens visible and lets positions run past
    ``max_model_len`` (see ``attention_backends.torch_backend``).

    The computation: ``attention_backend`` (``model_runner.attention_backends``; auto: torch
    on CPU); ``use_onednn`` (None: oneDNN-packed dense layers on CPU when they pass a
    self-check); ``activation_bits`` (``ACTIVATION_BITS``). ``fuse_batches`` runs prefill and
    decode rows in one forward pass. The paths a step may take (``model_runner.paths``):
    ``fused_step`` runs steps of up to ``fused_max_rows`` rows in one CPU kernel call (None =
    when supported); ``cuda_graphs`` replays decode steps from CUDA graphs captured up to
    ``max_decode_rows`` rows (``max_num_seqs``, times 1 + k with speculation; None: the
    largest graph size), None = on CUDA with a backend that has graphs. ``name``: the
    model's name in ``ModelInfo`` (default: the config's). ``max_lora_rank`` and
    ``max_cpu_loras``: the LoRA adapters the runner accepts, and how many it keeps laid out
    while unused (``lora.registry``). ``sliding_layer_blocks``: a model whose layers attend
    within different windows (Gemma 3) keeps its sliding layers' KV in a pool of that many
    blocks of its own, read through each seq's ``window_block_ids``
    (``cache_manager.hybrid``); 0: one pool and one table for every layer."""

    num_blocks: int | None = None
    block_size: int = 16
    kv_budget_bytes: int | None = None
    kv_dtype: torch.dtype | str | None = None
    dtype: torch.dtype | str | None = None
    device: torch.device | str | None = None
    max_model_len: int | None = None
    sliding_window: int | None = None
    attention_sinks: int = 0
    attention_backend: str = "auto"
    use_onednn: bool | None = None
    activation_bits: int = 16
    fuse_batches: bool = True
    fused_step: bool | None = None
    fused_max_rows: int = 1 << 30
    cuda_graphs: bool | None = None
    max_decode_rows: int | None = None
    name: str | None = None
    max_lora_rank: int = 64
    max_cpu_loras: int = 8
    sliding_layer_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        for key in ("num_blocks", "kv_budget_bytes", "max_model_len", "sliding_window",
                    "max_decode_rows", "fused_max_rows", "max_lora_rank",
                    "max_cpu_loras"):  # fmt: skip
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{key} must be >= 1, got {value}")
        if self.attention_sinks < 0:
            raise ValueError(f"attention_sinks must be >= 0, got {self.attention_sinks}")
        if self.sliding_layer_blocks and (self.sliding_window or self.attention_sinks):
            raise ValueError(
                "sliding_layer_blocks: the sliding layers' own pool takes no window over "
                "every layer (sliding_window) nor attention sinks"
            )
        if self.attention_backend not in ATTENTION_BACKEND_CHOICES:
            raise ValueError(
                f"unknown attention backend {self.attention_backend!r}: use one of "
                f"{', '.join(ATTENTION_BACKEND_CHOICES)}"
            )
        if self.activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits {self.activation_bits}: use 16 or 8")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # a key of families.FAMILIES: "llama", "qwen3", "phi3", ...
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF-style, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # QKV bias (Qwen2)
    sliding_window: int | None = None  # Mistral
    # Dimensions of each head RoPE rotates (the first ones; Phi-4-mini: 3/4), None = all.
    rotary_dim: int | None = None
    # The mixture-of-experts MLP and the layers that have it (Qwen3-MoE, Mixtral), else None.
    experts: Experts | None = None
    # Each layer's attention window in tokens, None = every position (Gemma 3: its sliding
    # layers' window, None on the global ones); empty = every layer has ``sliding_window``.
    # ``sliding_window`` stays the window of EVERY layer, the one the cache manager releases
    # blocks outside of: a model with a global layer has none and keeps every block.
    layer_windows: tuple[int | None, ...] = ()
    # RoPE base of the layers with a window in ``layer_windows``, unscaled (Gemma 3's
    # ``rope_local_base_freq``); None = every layer rotates by rope_theta / rope_scaling.
    local_rope_theta: float | None = None
    # Softmax scale ``query_pre_attn_scalar ** -0.5`` (Gemma); None = ``head_dim ** -0.5``.
    query_pre_attn_scalar: float | None = None
    # Logits become ``cap * tanh(logits / cap)`` (Gemma 2); None = as they are.
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim")  # fmt: skip
        for key in sizes:  # make fuzz: a GGUF's head_count_kv of 0 was a ZeroDivisionError
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        r = self.rotary_dim
        if r is not None and not (0 < r <= self.head_dim and r % 2 == 0):
            raise ValueError(f"rotary_dim must be even and in 1..{self.head_dim}, got {r}")
        if self.experts is not None and not set(self.experts.layers) <= set(range(self.num_layers)):
            raise ValueError(f"expert layers {self.experts.layers} past {self.num_layers} layers")
        self._check_layer_windows()
        for key in ("query_pre_attn_scalar", "final_logit_softcapping", "local_rope_theta"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"{key} must be > 0, got {value}")

    def _check_layer_windows(self) -> None:
        windows = self.layer_windows
        if not windows:
            return
        if len(windows) != self.num_layers:
            raise ValueError(f"{len(windows)} layer windows for {self.num_layers} layers")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError(f"layer windows must be >= 1 tokens, got {windows}")
        if self.sliding_window is not None and set(windows) != {self.sliding_window}:
            raise ValueError(
                f"sliding_window {self.sliding_window} is every layer's window, but the "
                f"layers have {sorted(set(windows), key=str)}"
            )

    @property
    def softmax_scale(self) -> float:
        """The attention's softmax scale (folded into Q at load)."""
        scalar = float(self.query_pre_attn_scalar or self.head_dim)
        return 1.0 / math.sqrt(scalar)

    def layer_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends within (tokens; None = every position)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` rotates by ``local_rope_theta`` (a windowed layer)."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def kv_shape(self, dtype: str = "float32") -> ModelShape:
        """The KV cache's shape with KV stored in ``dtype`` (a ``DTYPES`` key)."""
        stored = DTYPES[dtype]
        return ModelShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=stored.num_bytes,
            name=self.name,
            scale_bytes=stored.scale_bytes,
        )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "") -> ModelConfig:
        """From a Hugging Face ``config.json`` dict of a family in ``families.FAMILIES``;
        ValueError with a one-line refusal for any other (mixture-of-experts, say)."""
        fam = for_hf_config(cfg)
        cfg = {**fam.hf_defaults, **cfg}
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...] = (
            ()
            if eos is None
            else tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else (int(eos),)
        )
        overrides = fam.hf_overrides(cfg)
        sliding = overrides.get("sliding_window", cfg.get("sliding_window"))
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        if sliding and int(sliding) >= max_positions:
            sliding = None  # a window over every position (Phi-3-128k's 262144) is none
        extra_fields = {k: overrides[k] for k in _FAMILY_FIELDS if k in overrides}
        if cfg.get("attn_logit_softcapping"):
            raise ValueError(
                f"attention logit soft-capping (attn_logit_softcapping="
                f"{cfg['attn_logit_softcapping']}) is not supported"
            )
        cap = cfg.get("final_logit_softcapping")
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        # transformers' partial_rotary_factor: int(head_dim * factor) dimensions rotate.
        rotary = int(head_dim * float(cfg.get("partial_rotary_factor") or 1.0))
        num_layers = int(cfg["num_hidden_layers"])
        experts = fam.hf_experts(cfg, num_layers) if fam.hf_experts is not None else None
        return cls(
            architecture=fam.name,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=overrides.get("rope_scaling", cfg.get("rope_scaling")),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", fam.hf_attention_bias)),
            sliding_window=int(sliding) if sliding else None,
            rotary_dim=rotary if rotary != head_dim else None,
            experts=experts,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            final_logit_softcapping=float(cap) if cap else None,
            name=name,
            **extra_fields,
        )


# ``ModelConfig`` fields only a family's ``hf_overrides`` sets (their config.json spellings
# are the family's own: Gemma 3's ``layer_types``, ``rope_local_base_freq``, ...).
_FAMILY_FIELDS = ("layer_windows", "local_rope_theta", "query_pre_attn_scalar")
