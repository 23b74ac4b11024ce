"""The mixture-of-experts MLP (``families.base.Experts``: Qwen3-MoE, Mixtral) as the model runs
it: a router and one gated MLP per expert, each expert's matrices a layer made by
``weights.Linears`` (so a quantized expert runs on the kernels' ``QLinear``, a dense one as
``Linear``, as any other matrix).

A step's rows are grouped by expert: the router picks each row's experts, the (row, expert)
pairs are sorted by expert, and each chosen expert runs once, on all the rows routed to it, so
its weights are read once per step and an expert no row chose is not touched (a decode at one
user reads ``num_used`` experts' bytes per layer). The weighted outputs are summed into each row
expert by expert in ascending order, as transformers' loop does.

The experts' weights come in three spellings, all read here: one matrix per expert
(``mlp.experts.{e}.gate_proj.weight``: config.json checkpoints, and the GGUF loader's slices of
a stacked ``ffn_*_exps`` tensor), transformers 5's fused stacks in memory
(``mlp.experts.gate_up_proj`` ``[E, 2 * inter, hidden]`` and ``mlp.experts.down_proj``
``[E, hidden, inter]``), and ``stacked`` below, which gives the latter from the former for the
transformers oracle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from model_runner.families import Experts

_PARTS = ("gate", "up", "down")


class MoeMlp:
    """``sum over the row's chosen experts e of p_e * down_e(silu(gate_e x) * up_e x)``.

    ``router``: ``[E, hidden]`` fp32 (the routing is a discrete choice: in half precision a
    rounding would flip near-tied experts more often); ``gate_up[e]`` / ``down[e]``: expert
    ``e``'s layers (``silu_mul`` and ``__call__`` as the dense MLP's)."""

    __slots__ = ("down", "gate_up", "norm_topk_prob", "num_used", "router")

    def __init__(
        self, router: torch.Tensor, gate_up: list[Any], down: list[Any], experts: Experts
    ) -> None:
        if router.device.type != "cpu":
            raise ValueError(
                f"mixture-of-experts layers run on CPU only, not {router.device} (the expert "
                "grouping reads the routing on the host)"
            )
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.num_used = experts.num_used
        self.norm_topk_prob = experts.norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts [T, k] (highest probability first) and their weights
        [T, k] (fp32): the softmax over all experts' logits, top-k, renormalized over the
        chosen when ``norm_topk_prob``."""
        probs = torch.softmax(F.linear(x.float(), self.router), dim=-1)
        weights, chosen = torch.topk(probs, self.num_used, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output [T, hidden] for its input rows ``x`` [T, hidden]."""
        chosen, weights = self.route(x)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.down)).tolist()
        rows = order // self.num_used
        scale = weights.flatten()[order].to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = rows[start : start + n]
            y = self.down[e](self.gate_up[e].silu_mul(x.index_select(0, sel)))
            out.index_add_(0, sel, y.mul_(scale[start : start + n]))
            start += n
        return out

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` (a new tensor; ``residual`` is not modified)."""
        return residual + self(x)

    def tensors(self) -> list[torch.Tensor]:
        layers = [*self.gate_up, *self.down]
        return [self.router, *(t for layer in layers for t in layer.tensors())]


def expert_matrices(read: Callable[[str], Any], state: Mapping[str, Any], prefix: str,
                    experts: Experts) -> list[tuple[Any, Any, Any]]:  # fmt: skip
    """Each expert's (gate, up, down) matrices of the layer at ``prefix``
    (``model.layers.{i}.``), read with ``read`` from one matrix per expert, or sliced from
    transformers 5's fused stacks."""
    p = f"{prefix}mlp.experts."
    if has_fused_experts(state, prefix):
        gate_up, down = read(f"{p}gate_up_proj"), read(f"{p}down_proj")
        inter = experts.intermediate_size
        return [(gate_up[e, :inter], gate_up[e, inter:], down[e]) for e in range(len(down))]
    return [
        tuple(read(f"{p}{e}.{part}_proj.weight") for part in _PARTS)
        for e in range(experts.num_experts)
    ]


def has_fused_experts(state: Mapping[str, Any], prefix: str) -> bool:
    """Whether the layer at ``prefix`` holds transformers 5's fused expert stacks."""
    p = f"{prefix}mlp.experts."
    return f"{p}gate_up_proj" in state and f"{p}down_proj" in state


def stacked(state: Mapping[str, torch.Tensor], experts: Experts) -> dict[str, torch.Tensor]:
    """``state`` with each MoE layer's per-expert matrices stacked as transformers 5 holds
    them (``mlp.experts.gate_up_proj`` / ``down_proj``), for loading into its model."""
    out = dict(state)
    for i in experts.layers:
        p = f"model.layers.{i}.mlp.experts."
        names = [[f"{p}{e}.{part}_proj.weight" for part in _PARTS]
                 for e in range(experts.num_experts)]  # fmt: skip
        if not all(n in out for row in names for n in row):
            continue
        gates, ups, downs = ([out.pop(row[k]) for row in names] for k in range(3))
        out[f"{p}gate_up_proj"] = torch.stack(
            [torch.cat(gu) for gu in zip(gates, ups, strict=True)]
        )
        out[f"{p}down_proj"] = torch.stack(downs)
    return out
