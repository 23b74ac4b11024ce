"""A step's adapters for the fused CPU kernels (``kernels/lora.h``): the ctypes view.

Each adapter's pairs are described once, when it is first used on this path (``pair_table``:
``[num_layers * len(TARGETS)]`` ``LoraPair``, pointers into its fp16 tensors, cached on its
``LoraWeights``); a step then passes each row's slot and scale and one pointer per slot.
"""

from __future__ import annotations

import ctypes

import torch

from model_runner import kernels
from model_runner.lora.layout import LoraWeights
from model_runner.lora.plan import LoraStep
from model_runner.lora.targets import TARGETS


def pair_table(weights: LoraWeights) -> ctypes.Array[kernels.LoraPair]:
    """``weights``' pairs as the kernels read them (made once; the tensors stay owned by
    ``weights``, which holds the table)."""
    if weights.native is not None:
        return weights.native
    if weights.dtype != torch.float16:
        raise ValueError(f"the kernels take fp16 adapters, not {weights.dtype}")
    table = (kernels.LoraPair * (len(weights.layers) * len(TARGETS)))()
    for layer, pairs in enumerate(weights.layers):
        for t, target in enumerate(TARGETS):  # the kernels' order (checked at load)
            pair = pairs.get(target.name)
            if pair is None:
                continue
            a, bt = pair
            if a.device.type != "cpu" or not (a.is_contiguous() and bt.is_contiguous()):
                raise ValueError("the kernels take contiguous adapters in CPU memory")
            table[layer * len(TARGETS) + t] = kernels.LoraPair(
                a.data_ptr(), bt.data_ptr(), a.shape[0], 0
            )
    weights.native = table
    return table


class NativeLora:
    """One step's ``LoraRows`` (keep this object alive while the kernels run)."""

    def __init__(self, lora: LoraStep) -> None:
        self.row_slot = torch.tensor(lora.row_slot, dtype=torch.int32)
        self.row_scale = torch.tensor(lora.row_scale, dtype=torch.float32)
        tables = [pair_table(w) for w in lora.slots]
        pointer = ctypes.POINTER(kernels.LoraPair)
        self.slots = (pointer * len(tables))(*[ctypes.cast(t, pointer) for t in tables])
        self.rows = kernels.LoraRows(
            self.row_slot.data_ptr(),
            self.row_scale.data_ptr(),
            self.slots,
            len(tables),
            lora.max_rank,
        )
        self.pointer = ctypes.pointer(self.rows)
