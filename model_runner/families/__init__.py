"""The family table: the one place an architecture name is read.

``FAMILIES`` maps ``ModelConfig.architecture`` to its ``Family`` (``families.base``), one
module per family. The loaders find a checkpoint's family here (``for_hf_config``,
``for_gguf``: a GGUF architecture may name a dense family and a mixture-of-experts one, as
``llama`` names Llama and Mixtral, told apart by the file's experts), which refuse, in one
line naming what is not supported and what is, a family or a feature kvserve does not run;
``ModelConfig``, ``weights`` and ``model`` read the family's fields through ``family``.

Adding a family: a module beside ``qwen3.py`` with its ``Family``, one row in ``FAMILIES``,
and its layer part in ``weights`` / ``model`` when it has one the table does not describe
yet (see docs/models.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from model_runner.families.base import Experts, Family
from model_runner.families.gemma3 import GEMMA3
from model_runner.families.llama import LLAMA, MISTRAL
from model_runner.families.mixtral import MIXTRAL
from model_runner.families.phi3 import PHI3
from model_runner.families.qwen2 import QWEN2
from model_runner.families.qwen3 import QWEN3
from model_runner.families.qwen3moe import QWEN3_MOE

__all__ = [
    "FAMILIES",
    "Experts",
    "Family",
    "family",
    "for_gguf",
    "for_hf_config",
    "supported",
    "text_config",
]

FAMILIES: dict[str, Family] = {
    f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, QWEN3_MOE, MIXTRAL, GEMMA3)
}

_BY_HF_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_model_types}
_BY_IMAGE_TEXT_TYPE = {t: f for f in FAMILIES.values() for t in f.hf_image_text_types}
# (architecture, has experts) -> family: a ``llama`` file with experts is Mixtral's.
_BY_GGUF_ARCH = {(a, f.moe): f for f in FAMILIES.values() for a in f.gguf_archs}

# Families users bring that kvserve does not run yet, and what sets them apart (the refusal
# says so, rather than a list of tensors it could not find).
_NOT_YET = {
    "qwen2_moe": "Qwen2-MoE's shared expert",
    "qwen2moe": "Qwen2-MoE's shared expert",
    "deepseek_v2": "DeepSeek's latent attention and shared experts",
    "deepseek2": "DeepSeek's latent attention and shared experts",
    "gemma": "Gemma's (1 + w) norms and GeGLU",
    "gemma2": "Gemma 2's soft-capping and sliding layers",
    "phi3small": "Phi-3-small's block-sparse attention and GEGLU",
    "phimoe": "Phi-3.5-MoE's sparsemixer router",  # config.json and GGUF alike
}
_MOE = "mixture-of-experts"


def supported(gguf: bool = False) -> str:
    """The families kvserve runs, for messages: ``llama, mistral, qwen2, qwen3, phi3, qwen3moe,
    mixtral, gemma3``, or as GGUF architectures."""
    if gguf:
        archs = dict.fromkeys(a for a, _ in _BY_GGUF_ARCH)
        return (
            ", ".join(archs)
            + " GGUFs (Mistral converts to 'llama', Mixtral to 'llama' with experts)"
        )
    return ", ".join(FAMILIES)


def family(architecture: str) -> Family:
    """The ``Family`` of a ``ModelConfig.architecture``; ValueError naming the supported
    ones for any other."""
    found = FAMILIES.get(architecture)
    if found is None:
        raise ValueError(f"unsupported architecture {architecture!r}: kvserve runs {supported()}")
    return found


def _refusal(what: str, kind: str | None, gguf: bool = False) -> str:
    runs = supported(gguf)
    if kind == _MOE:
        moe = ", ".join(f.name for f in FAMILIES.values() if f.moe)
        return (
            f"{what} is a mixture-of-experts model: kvserve runs mixture-of-experts only as "
            f"{moe}; it runs {runs}"
        )
    if kind is not None:
        return f"{what} is not supported yet ({kind}); kvserve runs {runs}"
    return f"{what} is not supported; kvserve runs {runs}"


def for_hf_config(cfg: Mapping[str, Any]) -> Family:
    """The family of a config.json dict; ValueError with a one-line refusal otherwise."""
    model_type = str(cfg.get("model_type", "llama"))
    what = f"model_type {model_type!r}"
    found = _BY_HF_TYPE.get(model_type)
    if found is None:
        raise ValueError(_refusal(what, _NOT_YET.get(model_type)))
    experts = any(int(cfg.get(key) or 0) > 0 for key in ("num_local_experts", "num_experts"))
    if experts and not found.moe:  # a dense family's config with experts is not that family
        raise ValueError(_refusal(what, _MOE))
    return found


def text_config(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The text model's config.json dict of an image-text checkpoint whose text model is a
    family's (``Family.hf_image_text_types``): its ``text_config``, with the top-level token
    ids and tying where it has none; None for any other config."""
    if str(cfg.get("model_type")) not in _BY_IMAGE_TEXT_TYPE:
        return None
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"model_type {cfg['model_type']!r} config has no text_config")
    inherited = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
    return {**{k: cfg[k] for k in inherited if k in cfg}, **text}


def for_gguf(arch: str, metadata: Mapping[str, Any], tensor_names: Collection[str]) -> Family:
    """The family of a GGUF file's architecture, metadata and tensor names; ValueError with
    a one-line refusal otherwise (a Mixtral file is a ``llama`` one with experts)."""
    what = f"a {arch!r} GGUF"
    count = metadata.get(f"{arch}.expert_count") or 0
    experts = (isinstance(count, int) and count > 0) or any(
        n.endswith("_exps.weight") for n in tensor_names
    )
    found = _BY_GGUF_ARCH.get((arch, experts))
    if found is not None:
        return found
    if experts and (arch, False) in _BY_GGUF_ARCH:
        raise ValueError(_refusal(what, _MOE, gguf=True))
    if not experts and (arch, True) in _BY_GGUF_ARCH:
        raise ValueError(f"{what} has no experts ({arch}.expert_count, ffn_*_exps tensors)")
    raise ValueError(_refusal(what, _NOT_YET.get(arch), gguf=True))
