"""Mixtral (``MixtralForCausalLM``: Mixtral-8x7B, 8x22B): Mistral's block with every layer's MLP
a mixture of ``num_local_experts`` SiLU-gated MLPs of ``intermediate_size``. The router takes
the softmax over all experts and keeps the ``num_experts_per_tok`` highest, renormalized to
sum to 1 (the softmax over the chosen experts' logits).

Its checkpoints spell the MLP ``block_sparse_moe``: ``block_sparse_moe.gate.weight`` (the
router) and ``block_sparse_moe.experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), renamed at
load onto ``Experts``' spellings.

llama.cpp's converter (``LlamaModel``) writes it as a ``llama`` file with experts:
``llama.expert_count`` / ``llama.expert_used_count``, ``feed_forward_length`` = the experts'
size, Q/K rows permuted as Llama's, the router ``blk.{i}.ffn_gate_inp.weight`` and the experts
stacked into ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps``; the family table tells
it from a dense Llama by those experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_runner.families.base import Experts, Family


def _hf_experts(cfg: Mapping[str, Any], num_layers: int) -> Experts | None:
    num = int(cfg.get("num_local_experts") or 0)
    if num == 0:
        return None
    return Experts(
        num_experts=num,
        num_used=int(cfg.get("num_experts_per_tok", 2)),
        intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,
        layers=tuple(range(num_layers)),
    )


def _hf_expert_kwargs(experts: Experts, num_layers: int) -> dict[str, Any]:
    return {"num_local_experts": experts.num_experts, "num_experts_per_tok": experts.num_used}


MIXTRAL = Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    hf_classes=("MixtralConfig", "MixtralForCausalLM"),
    gguf_archs=("llama",),
    gguf_qk_permuted=True,
    hf_experts=_hf_experts,
    gguf_norm_topk_prob=True,
    hf_expert_kwargs=_hf_expert_kwargs,
    hf_tensor_renames=(
        (r"\.block_sparse_moe\.", ".mlp."),
        (r"\.experts\.(\d+)\.w1\.", r".experts.\1.gate_proj."),
        (r"\.experts\.(\d+)\.w3\.", r".experts.\1.up_proj."),
        (r"\.experts\.(\d+)\.w2\.", r".experts.\1.down_proj."),
    ),
)
