"""The Hugging Face transformers twin of a kvserve model: the correctness oracle and the
benchmark baseline. transformers is a dev dependency, imported only when a twin is built."""

from __future__ import annotations

from typing import Any

import torch

from model_runner.config import ModelConfig
from model_runner.families import family
from model_runner.moe import stacked


def hf_config_fields(config: ModelConfig) -> dict[str, Any]:
    """The shape fields of ``config`` under their Hugging Face ``config.json`` names."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
    }


def build_hf_model(
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    with_eos: bool = True,
) -> Any:
    """transformers' ``*ForCausalLM`` for ``config`` holding ``state_dict`` (eval mode).

    ``with_eos=False`` leaves the EOS id out of the model's generation config, so
    ``generate()`` runs a fixed number of tokens (as ``ignore_eos`` does on our side).
    Raises if the weights do not fit the model exactly (tied ``lm_head`` excepted) or if
    transformers did not take the checkpoint's RoPE theta.
    """
    import transformers

    fam = family(config.architecture)
    config_name, model_name = fam.hf_classes
    eos = list(config.eos_token_ids) if with_eos and config.eos_token_ids else None
    kwargs: dict[str, Any] = {
        **hf_config_fields(config),
        "rope_scaling": config.rope_scaling,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": (config.eos_token_ids or (0,))[0],
    }
    if not fam.hf_attention_bias:  # a family whose bias is optional (always on for Qwen2)
        kwargs["attention_bias"] = config.attention_bias
    if config.rotary_dim is not None:
        kwargs["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    original = (config.rope_scaling or {}).get("original_max_position_embeddings")
    if original is not None:  # Phi3Config's own field outranks rope_scaling's
        kwargs["original_max_position_embeddings"] = original
    if config.layer_windows:
        kwargs.update(_layer_kwargs(config))
    elif config.sliding_window is not None:
        kwargs["sliding_window"] = config.sliding_window
        kwargs["use_sliding_window"] = True  # Qwen's switch; the others have no such field
    scalar = config.query_pre_attn_scalar
    if scalar is not None:  # an int to transformers
        if not scalar.is_integer():
            raise ValueError(f"transformers takes an integer query_pre_attn_scalar, not {scalar}")
        kwargs["query_pre_attn_scalar"] = int(scalar)
    if config.final_logit_softcapping is not None:
        kwargs["final_logit_softcapping"] = config.final_logit_softcapping
    if config.experts is not None and fam.hf_expert_kwargs is not None:
        kwargs.update(fam.hf_expert_kwargs(config.experts, config.num_layers))
        state_dict = stacked(state_dict, config.experts)  # transformers 5's fused experts
    hf_config = getattr(transformers, config_name)(**kwargs)
    # transformers 5 folds rope_theta / rope_scaling into rope_parameters; check it took them.
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # one dict per layer type (Gemma 3)
    theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta != config.rope_theta:
        raise RuntimeError(
            f"{config_name} has rope_theta {theta}, the checkpoint {config.rope_theta}"
        )
    model = getattr(transformers, model_name)(hf_config)
    missing, unexpected = model.load_state_dict(
        {k: v.to(torch.float32) for k, v in state_dict.items()}, strict=False
    )
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise RuntimeError(
            f"weights do not fit {model_name}: missing {missing}, unexpected {unexpected}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    if not with_eos:
        model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def _layer_kwargs(config: ModelConfig) -> dict[str, Any]:
    """transformers' spelling of per-layer windows (Gemma 3's ``layer_types``: a layer with
    a window slides, at ``rope_local_base_freq``; the others are global)."""
    windows = {w for w in config.layer_windows if w is not None}
    if len(windows) > 1:
        raise ValueError(f"transformers has one sliding window, the config {sorted(windows)}")
    kwargs: dict[str, Any] = {
        "layer_types": [
            "sliding_attention" if w is not None else "full_attention" for w in config.layer_windows
        ],
        "sliding_window": windows.pop() if windows else None,
    }
    if config.local_rope_theta is not None:
        kwargs["rope_local_base_freq"] = config.local_rope_theta
    return kwargs
