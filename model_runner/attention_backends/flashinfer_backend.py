"""The FlashInfer backend: ``flashinfer-python``'s batch prefill and decode wrappers over the
step's page tables, on CUDA when installed.

FlashInfer reads the pool in place in its ``HND`` layout (``[pages, kv heads, page size,
head_dim]``): a layer's K is ``KVPool.data[layer, :kvh]`` with its first two axes swapped
(a strided view, no copy), V the same from ``kvh``. ``plan`` runs once per step (host-side
scheduling shared by every layer), ``run`` once per layer. The arguments of both plans come
from ``flashinfer_plan_args``, pure and tested exactly on CPU.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from model_runner.attention_backends.base import AttentionSpec
from model_runner.attention_backends.page_table import PagedMetadata, PageTable
from model_runner.attention_backends.paged import PagedAttentionBackend
from model_runner.kv_pool import KVPool

# FlashInfer's split-KV scheduler workspace (its examples use 128 MiB).
WORKSPACE_BYTES = 128 << 20


@dataclass(frozen=True, slots=True)
class FlashInferPlan:
    """``wrapper.plan(*args, **kwargs)``; lists become int32 tensors at the call."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's ``window_left`` for kvserve's window W (a query at p sees p - W < k <= p,
    so W - 1 keys to its left); -1 means no window."""
    return -1 if sliding_window is None else sliding_window - 1


def flashinfer_plan_args(table: PageTable, spec: AttentionSpec, *, decode: bool) -> FlashInferPlan:
    """The plan of ``BatchDecodeWithPagedKVCacheWrapper`` (``decode``) or of
    ``BatchPrefillWithPagedKVCacheWrapper`` (causal) for ``table`` under ``spec``. The
    positional arguments are the ones every FlashInfer 0.2+ release takes in this order;
    ``sm_scale`` is 1 because Q carries the softmax scale (folded in at load time)."""
    kwargs: dict[str, Any] = {
        "window_left": window_left(spec.sliding_window),
        "sm_scale": 1.0,
        "q_data_type": spec.dtype,
        "kv_data_type": spec.kv_dtype,
    }
    pages = (table.kv_indptr, table.kv_indices, table.kv_last_page_len)
    shape = (spec.num_heads, spec.num_kv_heads, spec.head_dim, table.block_size)
    if decode:
        return FlashInferPlan((*pages, *shape), kwargs)
    return FlashInferPlan((table.qo_indptr, *pages, *shape), {"causal": True, **kwargs})


class FlashInferAttention(PagedAttentionBackend):
    name = "flashinfer"

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return f"runs on CUDA, not {device}"
        if importlib.util.find_spec("flashinfer") is None:
            return "needs flashinfer-python installed"
        return None

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        if spec.layered:  # one window_left per plan, and one plan per step
            return (
                "the flashinfer backend plans one window per step, not per-layer windows "
                "(use --attention-backend triton or torch)"
            )
        return super().unsupported(spec)

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        import flashinfer  # flashinfer-python, CUDA only

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=spec.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND")

    def plan(self, meta: PagedMetadata) -> None:
        for table, wrapper, decode in (
            (meta.prefill_table, self._prefill, False),
            (meta.decode_table, self._decode, True),
        ):
            if table is None:
                continue
            plan = flashinfer_plan_args(table, self.spec, decode=decode)
            # Index lists: indptr and last-page lengths on the host (FlashInfer schedules on
            # the CPU), page ids on the device (the kernels read them).
            args = [
                a
                if not isinstance(a, list)
                else torch.tensor(
                    a,
                    dtype=torch.int32,
                    device=self.spec.device if a is table.kv_indices else "cpu",
                )
                for a in plan.args
            ]
            wrapper.plan(*args, **plan.kwargs)

    def attend(
        self, layer: int, qkv: torch.Tensor, meta: PagedMetadata, pool: KVPool, out: torch.Tensor
    ) -> None:
        num_heads, num_kv_heads = self.spec.num_heads, self.spec.num_kv_heads
        data = pool.data[layer]
        kv = (data[:num_kv_heads].transpose(0, 1), data[num_kv_heads:].transpose(0, 1))
        o = out.view(out.shape[0], num_heads, self.spec.head_dim)
        q = qkv[:, :num_heads]
        r = meta.num_prefill_rows
        if meta.prefill_table is not None:
            o[:r] = self._prefill.run(q[:r].contiguous(), kv)
        if meta.decode_table is not None:
            o[r:] = self._decode.run(q[r:].contiguous(), kv)
