"""The Triton backend: ``triton_kernels``' paged prefill and decode over the step's page tables.

Runs on CUDA; on a CPU only under ``TRITON_INTERPRET=1`` (the CI tests)."""

from __future__ import annotations

import torch

from model_runner.attention import ForwardBatch
from model_runner.attention_backends.base import PagedAttentionBackend
from model_runner.kv_pool import KVPool


class TritonAttention(PagedAttentionBackend):
    name = "triton"

    def __init__(self, sliding_window: int | None = None) -> None:
        from model_runner.attention_backends import triton_kernels  # needs triton

        self._kernels = triton_kernels
        self.sliding_window = sliding_window

    def forward(
        self,
        layer: int,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        pool: KVPool,
        out: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        paged = batch.paged
        assert paged is not None, "a Triton step is built by build_paged_batch"
        pool.write(layer, qkv[:, num_heads:], batch.slot_mapping)
        kv = pool.data[layer]
        head_dim = qkv.shape[-1]
        q = qkv[:, :num_heads]
        o = out.view(out.shape[0], num_heads, head_dim)
        r = paged.num_prefill_rows
        if paged.prefill is not None:
            t = paged.prefill
            self._kernels.paged_prefill(
                q[:r], kv, o[:r], t.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_lens,
                t.max_qo_len, self.sliding_window,
            )  # fmt: skip
        if paged.decode is not None:
            t = paged.decode
            self._kernels.paged_decode(
                q[r:], kv, o[r:], t.kv_indptr, t.kv_indices, t.kv_lens, self.sliding_window
            )
