"""What a model family is to kvserve: plain data, no torch (the CLI and config read it).

A ``Family`` names the architecture (``ModelConfig.architecture``), where its checkpoints
say so (Hugging Face ``model_type`` values, GGUF ``general.architecture`` values), how
llama.cpp's converter laid its tensors out, and the few layer parts where it differs from
the Llama block (QK-norm, QKV bias, fused projections, a mixture-of-experts MLP, Gemma's
offset norms around attention and MLP, GeGLU and scaled embedding). The
loaders, ``ModelConfig``, the weights and the model read these fields; none of them compares
an architecture name.

A mixture-of-experts MLP (``Experts``) holds its weights under one spelling whatever the
checkpoint's: the router ``mlp.gate.weight`` ``[E, hidden]`` and one gated MLP per expert,
``mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` / ``down_proj`` (Qwen3-MoE's
config.json names; a family renames its own with ``hf_tensor_renames``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def _no_hf_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _no_gguf_overrides(metadata: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def window_fields(windows: list[int | None], max_positions: int) -> dict[str, Any]:
    """``ModelConfig``'s ``sliding_window`` and ``layer_windows`` for per-layer windows: a
    window every layer has (and not over every position) is also the model's
    ``sliding_window``, whose blocks the cache manager may release; with one global layer
    there is none."""
    shared = windows[0] if len(set(windows)) == 1 else None
    if shared is not None and shared >= max_positions:
        shared = None  # a window over every position is none (Phi-3-128k's 262144)
    return {"sliding_window": shared, "layer_windows": tuple(windows)}


@dataclass(frozen=True, slots=True)
class Experts:
    """A mixture-of-experts MLP (``ModelConfig.experts``): ``num_experts`` SiLU-gated MLPs of
    ``intermediate_size``; each row goes to the ``num_used`` experts its router's softmax
    (over all experts) ranks highest, weighted by those probabilities, renormalized to sum to
    1 over the chosen when ``norm_topk_prob`` (Mixtral always; Qwen3-MoE as its config says).
    ``layers``: the layers whose MLP this is; the others keep the dense MLP of the config's
    ``intermediate_size`` (Qwen3-MoE's ``decoder_sparse_step`` / ``mlp_only_layers``)."""

    num_experts: int
    num_used: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 < self.num_used <= self.num_experts:
            raise ValueError(
                f"experts used per token must be in 1..{self.num_experts}, got {self.num_used}"
            )
        if self.intermediate_size < 1:
            raise ValueError(f"expert intermediate size must be >= 1, got {self.intermediate_size}")

    def layer_names(self) -> tuple[str, ...]:
        """HF parameter names (after ``model.layers.{i}.``) of one such MLP."""
        experts = (
            f"mlp.experts.{e}.{n}_proj.weight"
            for e in range(self.num_experts)
            for n in ("gate", "up", "down")
        )
        return ("mlp.gate.weight", *experts)


@dataclass(frozen=True, slots=True)
class Family:
    """One architecture kvserve runs: a Llama-style decoder with these differences."""

    name: str  # ModelConfig.architecture
    hf_model_types: tuple[str, ...]  # config.json "model_type" values
    # transformers' config and model classes (the oracle, ``benchmarks.tools.reference``).
    hf_classes: tuple[str, str] = ("LlamaConfig", "LlamaForCausalLM")
    gguf_archs: tuple[str, ...] = ()  # GGUF "general.architecture" values it loads from
    # The architecture llama.cpp's converter writes for it, when not its own (Mistral: llama).
    converts_to: str | None = None
    # llama.cpp's converter permuted the Q/K rows (Llama's adjacent-pair rotation); families
    # it runs with the NeoX rotation (Qwen) are written unpermuted.
    gguf_qk_permuted: bool = False
    # Per-head RMSNorm on Q and K before RoPE (Qwen3, Gemma 3): the layer holds
    # ``self_attn.q_norm.weight`` / ``self_attn.k_norm.weight`` ([head_dim] each).
    qk_norm: bool = False
    # The HF config's default for ``attention_bias`` when it does not say (Qwen2: True).
    hf_attention_bias: bool = False
    # ``ModelConfig`` fields from config.json that this family spells its own way (e.g.
    # Qwen2's sliding window, off unless ``use_sliding_window``).
    hf_overrides: Callable[[Mapping[str, Any]], dict[str, Any]] = _no_hf_overrides
    # config.json fields this family's transformers config defaults, for files that leave
    # them out (older transformers saved only the fields that differ from the defaults).
    hf_defaults: Mapping[str, Any] = field(default_factory=dict)
    # Q, K and V in one checkpoint matrix, rows in that order (Phi-3): HF
    # ``self_attn.qkv_proj.weight``; ``weights`` splits it at load.
    fused_qkv: bool = False
    # Gate and up in one checkpoint matrix, gate rows first (Phi-3): HF
    # ``mlp.gate_up_proj.weight``; ``weights`` splits it at load.
    fused_gate_up: bool = False
    # GGUF per-layer tensor suffix -> HF per-layer name, beyond (or instead of) the Llama
    # block's; ``gguf_absent_tensors``: the Llama block's suffixes this family's files lack.
    gguf_layer_tensors: Mapping[str, str] = field(default_factory=dict)
    gguf_absent_tensors: tuple[str, ...] = ()
    # Mixture of experts: the ``Experts`` of a config.json dict and its layer count, for a
    # family whose MLP is one (None: a dense family; a config or GGUF with experts is refused).
    hf_experts: Callable[[Mapping[str, Any], int], Experts | None] | None = None
    # Its GGUF files' ``norm_topk_prob`` when ``{arch}.expert_weights_norm`` is absent (as
    # llama.cpp's graph for the architecture has it).
    gguf_norm_topk_prob: bool = True
    # transformers' config arguments for ``Experts`` (the oracle, ``benchmarks.tools.reference``).
    hf_expert_kwargs: Callable[[Experts, int], dict[str, Any]] | None = None
    # (regex, replacement) on checkpoint tensor names, in order, onto the spellings above
    # (Mixtral's ``block_sparse_moe.experts.{e}.w1`` -> ``mlp.experts.{e}.gate_proj``).
    hf_tensor_renames: tuple[tuple[str, str], ...] = ()
    # config.json model_types of image-text checkpoints whose text model is this family
    # (Gemma 3's ``gemma3``): their ``text_config`` is read as the config, the weights under
    # ``language_model`` as the model's (``hf_tensor_renames``), and the checkpoint tensors
    # ``hf_skipped_tensors`` matches (regexes on the names: the vision tower) are not loaded.
    hf_image_text_types: tuple[str, ...] = ()
    hf_skipped_tensors: tuple[str, ...] = ()
    # ``ModelConfig`` fields from a GGUF's metadata and the fields the loader read from it
    # that this family derives its own way: what llama.cpp hard-codes for it (Gemma 3's
    # layer pattern, local RoPE base and softmax scale, which its converter does not write).
    gguf_overrides: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] = (
        _no_gguf_overrides
    )
    # RMSNorm multiplies by ``norm_offset + w`` (Gemma: ``1 + w``, computed in fp32); the
    # checkpoints store ``w``. llama.cpp's converter adds the offset to every
    # ``*norm.weight`` (ggml multiplies by the weight), and the GGUF loader takes it off
    # again, so a state dict always holds the checkpoint's ``w``.
    norm_offset: float = 0.0
    # Norms on the attention and MLP outputs before each residual add (Gemma 2 / 3): the
    # layer holds ``post_attention_layernorm`` (after attention), ``pre_feedforward_layernorm``
    # (the MLP's input norm) and ``post_feedforward_layernorm`` (after the MLP).
    sandwich_norms: bool = False
    # The gated MLP's activation on the gate: ``silu`` or ``gelu_tanh`` (GeGLU, Gemma).
    mlp_activation: str = "silu"
    # The token embedding is multiplied by ``sqrt(hidden_size)`` in its dtype (Gemma).
    scaled_embedding: bool = False
    # Token texts that end a turn, read as stop ids from a GGUF's vocabulary as llama.cpp's
    # marks them (Gemma's ``<end_of_turn>``, which the converter does not name eot).
    gguf_stop_tokens: tuple[str, ...] = ()

    @property
    def moe(self) -> bool:
        """Whether this family's MLP is a mixture of experts (on some layers at least)."""
        return self.hf_experts is not None

    @property
    def gguf_arch(self) -> str:
        """The GGUF architecture llama.cpp's converter writes for this family."""
        return self.converts_to or (self.gguf_archs[0] if self.gguf_archs else self.name)

    def layer_weights(
        self, attention_bias: bool = False, experts: Experts | None = None
    ) -> tuple[str, ...]:
        """HF per-layer parameter names (after ``model.layers.{i}.``) of this family's
        block, every one required; ``experts``: of a layer whose MLP is that."""
        attn = ("qkv",) if self.fused_qkv else ("q", "k", "v")
        mlp = ("gate_up",) if self.fused_gate_up else ("gate", "up")
        dense = tuple(f"mlp.{n}_proj.weight" for n in (*mlp, "down"))
        names = (
            *(f"self_attn.{n}_proj.weight" for n in (*attn, "o")),
            *(experts.layer_names() if experts is not None else dense),
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        )
        if self.sandwich_norms:
            names += ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
        if attention_bias:
            names += tuple(f"self_attn.{n}_proj.bias" for n in attn)
        if self.qk_norm:
            names += ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
        return names
