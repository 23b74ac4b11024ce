"""The Triton backend: ``triton_kernels``' paged prefill and decode over the step's page tables.

Runs on CUDA; on a CPU only under ``TRITON_INTERPRET=1`` (the CI tests). Its decode reads the
page table from device tensors alone, so decode steps may be captured as CUDA graphs."""

from __future__ import annotations

import importlib.util

import torch

from model_runner.attention_backends.base import AttentionSpec
from model_runner.attention_backends.page_table import PagedMetadata
from model_runner.attention_backends.paged import PagedAttentionBackend
from model_runner.kv_pool import KVPool


def triton_interpreted() -> bool:
    """Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, read by Triton)."""
    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret)


class TritonAttention(PagedAttentionBackend):
    name = "triton"
    graphs = True

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "needs triton installed"
        if device.type != "cuda" and not triton_interpreted():
            return (
                f"runs on CUDA, or on {device} in Triton's interpreter only "
                "(TRITON_INTERPRET=1, for tests)"
            )
        return None

    def __init__(self, spec: AttentionSpec) -> None:
        super().__init__(spec)
        from model_runner.attention_backends import triton_kernels  # needs triton

        self._kernels = triton_kernels

    def attend(
        self, layer: int, qkv: torch.Tensor, meta: PagedMetadata, pool: KVPool, out: torch.Tensor
    ) -> None:
        # The page tables start at sliding_window's first block; a layer's own window is
        # masked within them (the kernel works in positions relative to the table).
        num_heads, window = self.spec.num_heads, self.spec.window(layer)
        kv = pool.data[layer]
        q = qkv[:, :num_heads]
        o = out.view(out.shape[0], num_heads, self.spec.head_dim)
        r = meta.num_prefill_rows
        if meta.prefill is not None:
            t = meta.prefill
            self._kernels.paged_prefill(
                q[:r], kv, o[:r], t.qo_indptr, t.kv_indptr, t.kv_indices, t.kv_lens,
                t.max_qo_len, window,
            )  # fmt: skip
        if meta.decode is not None:
            t = meta.decode
            self._kernels.paged_decode(
                q[r:], kv, o[r:], t.kv_indptr, t.kv_indices, t.kv_lens, window
            )
