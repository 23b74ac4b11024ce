"""KV memory arithmetic: bytes per block, blocks per budget, memory per (context, batch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The parts of a model's shape that size its KV cache.

    With grouped-query attention ``num_kv_heads`` is smaller than the number of query heads;
    only KV heads occupy cache. ``dtype_bytes`` is the size of one stored KV element (1 for
    int8); a quantized cache also stores ``scale_bytes`` per token per KV head (K and V each).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    name: str = ""
    scale_bytes: int = 0

    def __post_init__(self) -> None:
        for attr in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            if getattr(self, attr) < 1:
                raise ValueError(f"ModelShape.{attr} must be >= 1, got {getattr(self, attr)}")
        if self.scale_bytes < 0:
            raise ValueError(f"ModelShape.scale_bytes must be >= 0, got {self.scale_bytes}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token across all layers, with their scales if quantized:
        ``2 * layers * kv_heads * (head_dim * dtype_bytes + scale_bytes)``."""
        per_head = self.head_dim * self.dtype_bytes + self.scale_bytes
        return 2 * self.num_layers * self.num_kv_heads * per_head


def block_bytes(shape: ModelShape, block_size: int) -> int:
    """Bytes one block of ``block_size`` tokens occupies across all layers (K and V)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return shape.kv_bytes_per_token * block_size


def num_blocks_for_budget(shape: ModelShape, block_size: int, budget_bytes: int) -> int:
    """How many whole blocks fit in ``budget_bytes``. Raises if not even one fits."""
    per_block = block_bytes(shape, block_size)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens "
            f"needs {per_block} bytes for {shape.name or 'this model'}"
        )
    return num_blocks


def kv_memory_bytes(shape: ModelShape, context_len: int, batch_size: int = 1) -> int:
    """Exact KV bytes of ``batch_size`` sequences of ``context_len`` tokens (no block rounding)."""
    if context_len < 0 or batch_size < 0:
        raise ValueError(
            f"context_len and batch_size must be >= 0, got {context_len}, {batch_size}"
        )
    return shape.kv_bytes_per_token * context_len * batch_size


def kv_memory_bytes_paged(
    shape: ModelShape, context_len: int, batch_size: int, block_size: int
) -> int:
    """KV bytes when each sequence rounds up to whole blocks of ``block_size`` tokens."""
    blocks_per_seq = -(-context_len // block_size)
    return block_bytes(shape, block_size) * blocks_per_seq * batch_size
