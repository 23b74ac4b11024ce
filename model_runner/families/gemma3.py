"""Gemma 3, text (``Gemma3ForCausalLM``, config ``gemma3_text``: Gemma 3 1B / 270M, and the
text model of the 4B / 12B / 27B). Its block differs from Llama's by:

- the token embedding times ``sqrt(hidden_size)`` (in the embedding's dtype);
- RMSNorm as ``x * (1 + w)`` in fp32, four per layer: before attention, on the attention's
  output (``post_attention_layernorm``), before the MLP (``pre_feedforward_layernorm``) and
  on the MLP's output (``post_feedforward_layernorm``), each output normed before its
  residual add; QK-norm (per head, ``1 + w`` too) before RoPE;
- a GeGLU MLP (``gelu_pytorch_tanh``);
- the softmax scale ``query_pre_attn_scalar ** -0.5``, ``head_dim`` of its own;
- interleaved layers: ``layer_types`` (transformers 5; older configs: every
  ``sliding_window_pattern``-th layer global, default 6) says which attend within
  ``sliding_window`` tokens and rotate by the local base (``rope_local_base_freq``, or
  ``rope_parameters.sliding_attention``, 10000, unscaled) and which see every position and
  rotate by ``rope_theta`` with ``rope_scaling`` (linear 8 on 4B and up);
- tied embeddings; no soft-capping (Gemma 2's ``final_logit_softcapping`` is read anyway).

An image-text checkpoint (``Gemma3ForConditionalGeneration``, config ``gemma3``) serves its
text model: ``text_config`` (Gemma3TextConfig's defaults where it is silent, as the 4B-27B's
are) and the ``language_model`` weights; the vision tower is not loaded.

llama.cpp's converter (``Gemma3Model``) writes the ``gemma3`` architecture: ``gemma3.*`` keys
(``attention.key_length`` = head_dim, ``rope.freq_base`` = the global layers' theta, their
linear scaling, ``attention.sliding_window``), Q/K unpermuted, the norms ``attn_norm``,
``post_attention_norm``, ``ffn_norm`` (before the MLP), ``post_ffw_norm``, ``attn_q_norm`` /
``attn_k_norm`` and ``output_norm`` each with 1 ADDED (ggml multiplies by the weight), no
``output.weight``. It writes neither the layer pattern, the local base nor the softmax
scale: llama.cpp's ``gemma3`` hparams hard-code them (``set_swa_pattern(6)``, base 10000,
scale ``1 / sqrt(head_dim)``, but ``1 / sqrt(hidden / heads)`` for the 62-layer 27B), and
``_gguf_overrides`` derives the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_runner.families.base import Family, window_fields

_SLIDING, _FULL = "sliding_attention", "full_attention"
_GELU_SPELLINGS = ("gelu_pytorch_tanh", "gelu_tanh")
# llama.cpp's gemma3 hparams: every 6th layer global, the sliding ones at base 10000, and
# the softmax scale by hidden / heads for its 27B (identified by its 62 layers).
_GGUF_PATTERN = 6
_GGUF_LOCAL_THETA = 10000.0
_GGUF_27B_LAYERS = 62

# Gemma3TextConfig's defaults, for config.json files that leave them out (the diffs older
# transformers saved, e.g. the text_config of the 4B and up).
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}


def _layer_types(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        types = [_SLIDING if (i + 1) % pattern else _FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {_SLIDING, _FULL}:
        raise ValueError(f"layer_types must be {num_layers} of {_SLIDING} / {_FULL}, got {types}")
    return list(types)


def _local_theta(cfg: Mapping[str, Any]) -> float:
    params = cfg.get("rope_parameters")
    local = params.get(_SLIDING) if isinstance(params, Mapping) else None
    if isinstance(local, Mapping):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"RoPE scaling {kind!r} on Gemma 3's sliding layers is not supported")
        return float(local.get("rope_theta", 10000.0))
    return float(cfg.get("rope_local_base_freq", 10000.0))


def _hf_overrides(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not supported")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_SPELLINGS:
        raise ValueError(f"hidden_activation {act!r}: Gemma 3 runs gelu_pytorch_tanh")
    num_layers = int(cfg["num_hidden_layers"])
    max_positions = int(cfg["max_position_embeddings"])
    # A sliding layer without a window still rotates by the local base: a window over
    # every position keeps it a windowed layer.
    window = int(cfg.get("sliding_window") or max_positions)
    windows = [window if t == _SLIDING else None for t in _layer_types(cfg, num_layers)]
    return {
        **window_fields(windows, max_positions),
        "local_rope_theta": _local_theta(cfg),
        "query_pre_attn_scalar": float(cfg["query_pre_attn_scalar"]),
    }


def _gguf_overrides(metadata: Mapping[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    arch, num_layers = metadata["general.architecture"], fields["num_layers"]
    context = fields["max_position_embeddings"]
    window = int(metadata.get(f"{arch}.attention.sliding_window") or context)
    windows = [window if (i + 1) % _GGUF_PATTERN else None for i in range(num_layers)]
    scalar = fields["head_dim"]
    if num_layers == _GGUF_27B_LAYERS:
        scalar = fields["hidden_size"] // fields["num_heads"]
    return {
        **window_fields(windows, context),
        "local_rope_theta": _GGUF_LOCAL_THETA,
        "query_pre_attn_scalar": float(scalar),
    }


GEMMA3 = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    hf_classes=("Gemma3TextConfig", "Gemma3ForCausalLM"),
    gguf_archs=("gemma3",),
    qk_norm=True,
    hf_defaults=_HF_DEFAULTS,
    hf_overrides=_hf_overrides,
    gguf_overrides=_gguf_overrides,
    gguf_layer_tensors={
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    norm_offset=1.0,
    sandwich_norms=True,
    mlp_activation="gelu_tanh",
    scaled_embedding=True,
    gguf_stop_tokens=("<end_of_turn>",),
    # Gemma3ForConditionalGeneration: language_model.model.* (as saved; prefixed ``model.``
    # by the loader) or model.language_model.* (transformers' in-memory names).
    hf_image_text_types=("gemma3",),
    hf_tensor_renames=(
        (r"^model\.language_model\.lm_head\.", "lm_head."),
        (r"^model\.language_model\.(model\.)?", "model."),
    ),
    hf_skipped_tensors=(r"^(model\.)?(vision_tower|multi_modal_projector)\.",),
)
