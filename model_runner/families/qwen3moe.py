"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's block (QK-norm,
``head_dim`` of its own) with a mixture-of-experts MLP and no shared expert. Its router takes
the softmax over all ``num_experts``, keeps the ``num_experts_per_tok`` highest and, with
``norm_topk_prob`` (transformers' default: off; the released models: on), renormalizes them;
each expert is a SiLU-gated MLP of ``moe_intermediate_size``. A layer ``i`` has experts when
``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``; the others
keep a dense MLP of ``intermediate_size``.

llama.cpp's converter (``Qwen3MoeModel``, a ``Qwen2MoeModel``) writes the ``qwen3moe``
architecture: ``qwen3moe.expert_count``, ``expert_used_count``,
``expert_feed_forward_length`` (= ``moe_intermediate_size``), the router as
``blk.{i}.ffn_gate_inp.weight`` (F32) and the experts stacked, ``blk.{i}.ffn_gate_exps`` /
``ffn_up_exps`` ``[E, moe_inter, hidden]`` and ``ffn_down_exps`` ``[E, hidden, moe_inter]``
(numpy order); a dense layer's ``ffn_gate`` / ``ffn_up`` / ``ffn_down`` as Qwen3's. llama.cpp
renormalizes the chosen experts' weights for ``qwen3moe`` (``norm_w`` true), so a file without
``qwen3moe.expert_weights_norm`` runs with ``norm_topk_prob`` on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from model_runner.families.base import Experts, Family
from model_runner.families.qwen3 import QWEN3


def _hf_experts(cfg: Mapping[str, Any], num_layers: int) -> Experts | None:
    # The released configs say num_experts; transformers 5 writes num_local_experts.
    num = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if num == 0:
        return None
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return Experts(
        num_experts=num,
        num_used=int(cfg.get("num_experts_per_tok", 8)),
        intermediate_size=int(cfg.get("moe_intermediate_size", cfg["intermediate_size"])),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        layers=tuple(i for i in range(num_layers) if (i + 1) % step == 0 and i not in dense),
    )


def _hf_expert_kwargs(experts: Experts, num_layers: int) -> dict[str, Any]:
    return {
        "num_experts": experts.num_experts,
        "num_experts_per_tok": experts.num_used,
        "moe_intermediate_size": experts.intermediate_size,
        "norm_topk_prob": experts.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(num_layers) if i not in experts.layers],
    }


QWEN3_MOE = Family(
    name="qwen3moe",
    hf_model_types=("qwen3_moe",),
    hf_classes=("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    gguf_archs=("qwen3moe",),
    qk_norm=True,
    hf_overrides=QWEN3.hf_overrides,
    gguf_layer_tensors=QWEN3.gguf_layer_tensors,
    hf_experts=_hf_experts,
    gguf_norm_topk_prob=True,
    hf_expert_kwargs=_hf_expert_kwargs,
)
