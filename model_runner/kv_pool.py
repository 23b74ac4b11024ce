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

Precision (``dtype``; attention always computes in ``compute_dtype``, the model's):

- float32 / bfloat16 / float16 stored as is; a pool below the compute dtype converts on write
  and converts the gathered blocks back in one copy per gather (all heads at once). On this
  project's CPU (Zen3, AVX2 + F16C, no AVX-512-FP16) fp16 matmuls are 2-5x slower than
  fp32 ones, so attention reads fp32 copies rather than fp16 operands.
- int8: symmetric, one fp32 scale per (layer, head, token slot) beside the pool::

      scales[layer, head, block, offset]    [L, 2 * kvh, num_blocks, block_size]  fp32

  Per token and head, not per block: decode writes one token at a time into a partly
  filled block, so a per-block scale would either clip later, larger tokens or requantize
  the block on every write. A per-token scale depends on that token alone, and costs
  4 bytes per ``head_dim`` bytes (6 % at head_dim 64). A write quantizes with a handful of
  ops for all heads; a gather dequantizes with one ``int8 * fp32`` multiply.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch

from cache_manager.sizing import block_bytes, num_blocks_for_budget
from model_runner.config import ModelConfig
from model_runner.device import dtype_name

# int8 pools keep one scale per (layer, head, token slot) in this dtype; its size is
# ``DType.scale_bytes`` in ``model_runner.config.DTYPES`` for the sizing arithmetic.
KV_SCALE_DTYPE = torch.float32


class KVPool:
    """Keys and values of ``num_blocks`` blocks of ``block_size`` tokens for every layer.

    ``dtype`` is how the pool stores KV; ``compute_dtype`` (default: ``dtype``, or float32
    for int8) is what ``gather`` hands to attention. ``write`` takes the compute dtype.

    ``window_layers`` (Gemma 3's sliding layers, ``cache_manager.hybrid``) live in a pool of
    their own, ``num_window_blocks`` blocks whose ids follow the others': block id
    ``num_blocks + j`` is that pool's block j. ``data`` / ``scales`` then hold the other
    layers only; ``layer_data[i]`` / ``layer_scales[i]`` is layer i's wherever it lives, and
    ``write``, ``gather``, ``copy_blocks`` and ``scrub_blocks`` take the step's ids.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype | None = None,
        window_layers: Sequence[int] = (),
        num_window_blocks: int = 0,
    ) -> None:
        if bool(window_layers) != (num_window_blocks > 0):
            raise ValueError("KVPool: window_layers and num_window_blocks come together")
        for name, value in (
            ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
        ):
            if value < 1:
                raise ValueError(f"KVPool {name} must be >= 1, got {value}")
        dtype_name(dtype)  # raises for a dtype the pool cannot store
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.compute_dtype = compute_dtype or (torch.float32 if dtype == torch.int8 else dtype)
        self.device = torch.device(device)
        rows = 2 * num_kv_heads
        self.window_layers = tuple(sorted(set(window_layers)))
        self.num_window_blocks = num_window_blocks
        self._allocate(num_layers, rows, dtype)
        self._workspace = torch.empty(0, dtype=dtype, device=self.device)
        self._scale_workspace = torch.empty(0, dtype=KV_SCALE_DTYPE, device=self.device)
        self._read_workspace = torch.empty(0, dtype=self.compute_dtype, device=self.device)

    def _allocate(self, num_layers: int, rows: int, dtype: torch.dtype) -> None:
        """The zeroed tensors (``data`` and, with sliding layers of their own, ``window_data``;
        an int8 pool's scales beside) and each layer's views into them."""
        num_blocks, block_size, head_dim = self.num_blocks, self.block_size, self.head_dim
        num_window_blocks = self.num_window_blocks
        windowed = set(self.window_layers)
        # Each layer's pool (0: this one's, 1: the sliding layers') and index in it.
        where = [(int(i in windowed), 0) for i in range(num_layers)]
        counts = [0, 0]
        for i, (side, _) in enumerate(where):
            where[i] = (side, counts[side])
            counts[side] += 1
        blocks_of = (num_blocks, num_window_blocks)
        self.data = _zeros((counts[0], rows, num_blocks, block_size, head_dim), dtype, self.device)
        self.window_data: torch.Tensor | None = None
        if windowed:
            shape = (counts[1], rows, num_window_blocks, block_size, head_dim)
            self.window_data = _zeros(shape, dtype, self.device)
        datas = [self.data, self.window_data]
        self.layer_data: list[torch.Tensor] = [datas[s][j] for s, j in where]  # type: ignore[index]
        # Per-layer views, built once: [2*kvh, blocks, block_size * head_dim] for gathers
        # and [2*kvh, blocks * block_size, head_dim] for slot writes.
        self._blocks = [
            d.view(rows, blocks_of[s], -1) for d, (s, _) in zip(self.layer_data, where, strict=True)
        ]
        self._slots = [b.view(rows, -1, head_dim) for b in self._blocks]
        # The step's ids of a sliding layer's blocks start past this pool's.
        self._offsets = [num_blocks * s for s, _ in where]
        # int8: one fp32 scale per (layer, head, slot), the slot's absmax / 127.
        self.scales: torch.Tensor | None = None
        self.window_scales: torch.Tensor | None = None
        self.layer_scales: list[torch.Tensor] = []
        self._scale_slots: list[torch.Tensor] = []
        if dtype == torch.int8:
            self.scales = _zeros(
                (counts[0], rows, num_blocks, block_size), KV_SCALE_DTYPE, self.device
            )
            if windowed:
                shape = (counts[1], rows, num_window_blocks, block_size)
                self.window_scales = _zeros(shape, KV_SCALE_DTYPE, self.device)
            scales = [self.scales, self.window_scales]
            self.layer_scales = [scales[s][j] for s, j in where]  # type: ignore[index]
            self._scale_slots = [s.view(rows, -1) for s in self.layer_scales]

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        compute_dtype: torch.dtype | None = None,
        window_layers: Sequence[int] = (),
        num_window_blocks: int = 0,
    ) -> KVPool:
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            num_blocks,
            block_size,
            dtype,
            device,
            compute_dtype,
            window_layers,
            num_window_blocks,
        )

    # ------------------------------------------------------------------ sizes

    @property
    def num_bytes(self) -> int:
        """Bytes of the pool: KV, plus the scales of an int8 pool (the sliding layers' too)."""
        parts = (self.data, self.scales, self.window_data, self.window_scales)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across the layers of ``data``, K and V (equals
        ``sizing.block_bytes`` without sliding layers of their own)."""
        parts = (self.data, self.scales)
        return sum(t.numel() * t.element_size() for t in parts if t is not None) // self.num_blocks

    def _split(self, block_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """``block_ids`` as this pool's and the sliding layers' pool's own ids."""
        n = self.num_blocks
        return [b for b in block_ids if b < n], [b - n for b in block_ids if b >= n]

    # ------------------------------------------------------------------ access

    def write(self, layer: int, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store the keys and values of T tokens: ``kv`` is ``[T, 2 * kvh, head_dim]`` (K heads
        then V heads), token t goes to flat slot ``slot_mapping[t]``
        (= ``block_id * block_size + offset``). Converts to the pool's dtype; int8 quantizes
        each (token, head) vector symmetrically by its own absmax."""
        offset = self._offsets[layer]
        if offset:
            slot_mapping = slot_mapping - offset * self.block_size
        if self.scales is not None:
            # 8 ops for all heads and tokens; amax is clamped so an all-zero vector stays 0.
            amax = torch.linalg.vector_norm(kv, float("inf"), dim=-1, keepdim=True)
            scale = amax.clamp_min_(1e-30).mul_(1.0 / 127.0)
            q = torch.div(kv, scale).round_().to(torch.int8)
            self._slots[layer].index_copy_(1, slot_mapping, q.transpose(0, 1))
            self._scale_slots[layer].index_copy_(1, slot_mapping, scale.view(kv.shape[:2]).t())
            return
        if kv.dtype != self.dtype:
            kv = kv.to(self.dtype)
        self._slots[layer].index_copy_(1, slot_mapping, kv.transpose(0, 1))

    def gather(self, layer: int, block_index: torch.Tensor) -> torch.Tensor:
        """Keys and values of the listed blocks, in order, in the compute dtype:
        ``[2 * kvh, N * block_size, head_dim]`` for N block ids (the caller views the middle
        axis as ``[B, context]`` for batches).

        The result lives in a workspace reused by the next ``gather``: use it before gathering
        again. (A fresh multi-MB tensor per layer costs more in page faults than the copy.)
        A pool stored below the compute dtype converts (fp16) or dequantizes (int8) the
        gathered blocks in one op for all heads.
        """
        rows = 2 * self.num_kv_heads
        if self._offsets[layer]:
            block_index = block_index - self._offsets[layer]
        n = block_index.shape[0]
        per_block = self.block_size * self.head_dim
        needed = rows * n * per_block
        if self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=self.dtype, device=self.device)
        raw = self._workspace[:needed].view(rows, n, per_block)
        torch.index_select(self._blocks[layer], 1, block_index, out=raw)
        if self.dtype == self.compute_dtype:
            return raw.view(rows, n * self.block_size, self.head_dim)
        if self._read_workspace.numel() < needed:
            self._read_workspace = torch.empty(needed, dtype=self.compute_dtype, device=self.device)
        out = self._read_workspace[:needed].view(rows, n * self.block_size, self.head_dim)
        if self.scales is None:
            return out.copy_(raw.view_as(out))
        n_slots = n * self.block_size
        if self._scale_workspace.numel() < rows * n_slots:
            self._scale_workspace = torch.empty(
                rows * n_slots, dtype=KV_SCALE_DTYPE, device=self.device
            )
        scale = self._scale_workspace[: rows * n_slots].view(rows, n, self.block_size)
        torch.index_select(self.layer_scales[layer], 1, block_index, out=scale)
        return torch.mul(raw.view_as(out), scale.view(rows, n_slots, 1), out=out)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: block ``dst`` becomes a copy of block ``src`` in every layer.

        All copies happen at once, reading before writing, so a ``dst`` must not also be a
        ``src`` in the same call (the cache manager only copies into fresh blocks).
        """
        if not copies:
            return
        n = self.num_blocks
        sides = ((self.data, self.scales, 0), (self.window_data, self.window_scales, n))
        for data, scales, offset in sides:
            pairs = [(s - offset, d - offset) for s, d in copies if (s >= n) == bool(offset)]
            if not pairs or data is None:
                continue
            src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
            data[:, :, dst] = data[:, :, src]
            if scales is not None:
                scales[:, :, dst] = scales[:, :, src]

    def scrub_blocks(self, block_ids: Sequence[int]) -> list[int]:
        """Zero every listed block that holds a NaN or an infinity; returns their ids.

        Attention reads masked slots too (padding, the unwritten tail of a block) and relies on
        0 * value == 0, which fails for non-finite values. A request that produced them must
        not leave them behind for whoever gets its blocks next. (An int8 pool's values are
        always finite; a non-finite key or value leaves a non-finite scale.)
        """
        ours, theirs = self._split(block_ids)
        found = _scrub(self.data, self.scales, ours, self.device)
        if self.window_data is not None:
            window = _scrub(self.window_data, self.window_scales, theirs, self.device)
            found += [b + self.num_blocks for b in window]
        return found


def _scrub(
    data: torch.Tensor, scales: torch.Tensor | None, block_ids: Sequence[int], device: torch.device
) -> list[int]:
    """``KVPool.scrub_blocks`` on one pool's tensors and own ids."""
    if not block_ids:
        return []
    index = torch.tensor(sorted(set(block_ids)), dtype=torch.int64, device=device)
    values = data if scales is None else scales
    finite = torch.isfinite(values.index_select(2, index)).transpose(0, 2)
    bad = index[~finite.reshape(index.shape[0], -1).all(dim=1)]
    if bad.numel():
        data[:, :, bad] = 0
        if scales is not None:
            scales[:, :, bad] = 0
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


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU pages become resident only when written.

    ``torch.zeros`` on CPU writes every byte, so an idle server would hold its whole KV budget
    resident; numpy's ``calloc`` asks for transparent huge pages, so one write per (layer,
    head) slab makes 2 MiB resident. A private anonymous ``mmap`` of 4 KiB pages grows with
    the blocks that sequences write (reads of never-written blocks, such as decode padding,
    map the kernel's shared zero page). The tensor keeps the mapping alive.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # also where THP is "always"
        buffer.madvise(mmap.MADV_NOHUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
