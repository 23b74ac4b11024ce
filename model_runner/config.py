"""ModelConfig: the shape and hyper-parameters of a LLaMA-family model (LLaMA, Mistral, Qwen2).

Built from a Hugging Face ``config.json`` dict or from GGUF metadata; plain data, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cache_manager.sizing import ModelShape


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


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str  # "llama", "mistral" or "qwen2"
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
        """From a Hugging Face ``config.json`` dict (LlamaConfig / MistralConfig / Qwen2Config)."""
        model_type = str(cfg.get("model_type", "llama"))
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(
                f"unsupported model_type {model_type!r}: kvserve runs llama, mistral and qwen2"
            )
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
        sliding = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None
        return cls(
            architecture=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )
