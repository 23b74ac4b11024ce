"""The paged KV tensor pool: every layer's keys and values, allocated once at start-up.

Layout, one tensor for the whole pool::

    data[layer, head, block, offset, dim]    [L, 2 * kv_heads, num_blocks, block_size, head_dim]
                ^ K heads 0..kvh-1, then V heads 0..kvh-1

Head-major, K and V stacked on the head axis. Why this order (measured on CPU, and the same
reasoning holds for a GPU without a custom kernel):

- Decode gathers a batch's blocks with ONE ``index_select`` along the block axis, which
  yields ``[2 * kvh, B * max_blocks, block_size, head_dim]`` and is already, as a view,
  ``[2 * kvh, B, context, head_dim]``: contiguous per (head, request), so the batched matmuls
  of attention read it without another copy. A token-major layout
  (``[block, offset, head, dim]``) needs a transpose copy of the gathered keys per layer.
- Writing the step's new keys and values is ONE ``index_copy_`` along the flattened slot axis
  for K and V of every head.
- Copy-on-write of blocks is ONE indexed copy over all layers.

A block's payload for one head is ``block_size * head_dim`` contiguous elements (4 KiB for
16 x 64 fp32), large enough that gathers stream. The pool is zero-filled: padding slots of a
batched gather read blocks that may never have been written, and masked-out garbage must
still be finite (0 * NaN is NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cache_manager.sizing import block_bytes, num_blocks_for_budget
from model_runner.config import ModelConfig
from model_runner.device import dtype_name


class KVPool:
    """Keys and values of ``num_blocks`` blocks of ``block_size`` tokens for every layer."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"KVPool {name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.data = torch.zeros(
            num_layers,
            2 * num_kv_heads,
            num_blocks,
            block_size,
            head_dim,
            dtype=dtype,
            device=self.device,
        )
        # Per-layer views, built once: [2*kvh, num_blocks, block_size * head_dim] for gathers
        # and [2*kvh, num_blocks * block_size, head_dim] for slot writes.
        self._blocks = [
            self.data[i].view(2 * num_kv_heads, num_blocks, -1) for i in range(num_layers)
        ]
        self._workspace = torch.empty(0, dtype=dtype, device=self.device)
        self._slots = [
            self.data[i].view(2 * num_kv_heads, num_blocks * block_size, head_dim)
            for i in range(num_layers)
        ]

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVPool:
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            num_blocks,
            block_size,
            dtype,
            device,
        )

    # ------------------------------------------------------------------ sizes

    @property
    def num_bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across all layers, K and V (equals ``sizing.block_bytes``)."""
        return self.num_bytes // self.num_blocks

    # ------------------------------------------------------------------ access

    def write(self, layer: int, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the keys and values of T tokens: ``kv`` is ``[T, 2 * kvh, head_dim]`` (K heads
        then V heads), token t goes to flat slot ``slot_mapping[t]``
        (= ``block_id * block_size + offset``)."""
        self._slots[layer].index_copy_(1, slot_mapping, kv.transpose(0, 1))

    def gather(self, layer: int, block_index: torch.Tensor) -> torch.Tensor:
        """Keys and values of the listed blocks, in order: ``[2 * kvh, N * block_size, head_dim]``
        for N block ids (the caller views the middle axis as ``[B, context]`` for batches).

        The result lives in a workspace reused by the next ``gather``: use it before gathering
        again. (A fresh multi-MB tensor per layer costs more in page faults than the copy.)
        """
        rows = 2 * self.num_kv_heads
        n = block_index.shape[0]
        per_block = self.block_size * self.head_dim
        needed = rows * n * per_block
        if self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
        out = self._workspace[:needed].view(rows, n, per_block)
        torch.index_select(self._blocks[layer], 1, block_index, out=out)
        return out.view(rows, n * self.block_size, self.head_dim)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer.

        All copies happen at once, reading before writing, so a ``dst`` must not also be a
        ``src`` in the same call (the cache manager only copies into fresh blocks).
        """
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.device)
        self.data[:, :, dst] = self.data[:, :, src]

    def scrub_blocks(self, block_ids: Sequence[int]) -> list[int]:
        """Zero every listed block that holds a NaN or an infinity; returns their ids.

        Attention reads masked slots too (padding, the unwritten tail of a block) and relies on
        0 * value == 0, which fails for non-finite values. A request that produced them must
        not leave them behind for whoever gets its blocks next.
        """
        if not block_ids:
            return []
        index = torch.tensor(sorted(set(block_ids)), dtype=torch.int64, device=self.device)
        finite = torch.isfinite(self.data.index_select(2, index)).transpose(0, 2)
        bad = index[~finite.reshape(index.shape[0], -1).all(dim=1)]
        if bad.numel():
            self.data[:, :, bad] = 0
        return [int(b) for b in bad.tolist()]


def num_blocks_for_memory(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """How many blocks of ``block_size`` tokens a KV budget of ``budget_bytes`` holds for this
    model in ``dtype`` (the cache manager's sizing; raises if not even one block fits)."""
    return num_blocks_for_budget(config.kv_shape(dtype_name(dtype)), block_size, budget_bytes)


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block for this model in ``dtype`` (K and V, all layers)."""
    return block_bytes(config.kv_shape(dtype_name(dtype)), block_size)


def default_kv_budget_bytes(
    device: torch.device,
    gpu_memory_utilization: float = 0.9,
    activation_reserve_bytes: int = 1 << 30,
    cpu_budget_bytes: int = 1 << 30,
) -> int:
    """A KV budget for a device, asked for AFTER the weights are loaded.

    CUDA: ``gpu_memory_utilization`` of the device's memory, minus what torch has allocated
    (the weights) and ``activation_reserve_bytes`` for one step's activations.
    CPU: ``cpu_budget_bytes`` (default 1 GiB; host memory is shared with everything else).
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        used = torch.cuda.memory_allocated(device)
        budget = int(total * gpu_memory_utilization) - used - activation_reserve_bytes
        if budget <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {total} bytes x {gpu_memory_utilization} "
                f"utilization - {used} allocated - {activation_reserve_bytes} activation reserve"
            )
        return budget
    return cpu_budget_bytes
