"""Llama (1, 2, 3.x), SmolLM and Mistral: the base block every family starts from.

Mistral's checkpoints are their own ``model_type`` in config.json (with a sliding window)
but convert to the ``llama`` GGUF architecture.
"""

from __future__ import annotations

from model_runner.families.base import Family

LLAMA = Family(name="llama", hf_model_types=("llama",), gguf_archs=("llama",),
               gguf_qk_permuted=True)  # fmt: skip
MISTRAL = Family(name="mistral", hf_model_types=("mistral",), converts_to="llama",
                 gguf_qk_permuted=True,
                 hf_classes=("MistralConfig", "MistralForCausalLM"))  # fmt: skip
