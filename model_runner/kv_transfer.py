"""Block bytes in and out of the KV pool, for tier 2 (``server.kv_tier``).

A block's payload is its KV in every layer and head, in the pool's dtype (plus an int8
pool's scales): ``data[:, :, block]`` as raw bytes, ``block_bytes`` long. Both directions
are one indexed copy for all the listed blocks; no per-layer loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from model_runner.kv_pool import KVPool


class PoolBlockIO:
    """Reads and writes whole blocks of a ``KVPool`` as bytes."""

    def __init__(self, pool: KVPool) -> None:
        if pool.window_data is not None:
            raise ValueError(
                "moving blocks between pools and stores does not run with the sliding layers' "
                "own blocks (Gemma 3): serve with --sliding-layer-blocks off"
            )
        self.pool = pool
        data = pool.data
        self._data_bytes = data[:, :, 0].numel() * data.element_size()
        self._scale_bytes = 0
        if pool.scales is not None:
            self._scale_bytes = pool.scales[:, :, 0].numel() * pool.scales.element_size()
        self.block_bytes = self._data_bytes + self._scale_bytes

    def read_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """The payload of each block, in order (copied: the pool may overwrite the block)."""
        if not block_ids:
            return []
        pool = self.pool
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=pool.device)
        # [n, L, rows, bs, hd]: one contiguous payload per block.
        data = pool.data.index_select(2, index).movedim(2, 0).contiguous().cpu()
        raw = data.view(torch.uint8).view(len(block_ids), -1).numpy()
        if pool.scales is None:
            return [row.tobytes() for row in raw]
        scales = pool.scales.index_select(2, index).movedim(2, 0).contiguous().cpu()
        sraw = scales.view(torch.uint8).view(len(block_ids), -1).numpy()
        return [row.tobytes() + srow.tobytes() for row, srow in zip(raw, sraw, strict=True)]

    def write_blocks(
        self, block_ids: Sequence[int], payloads: Sequence[bytes | memoryview]
    ) -> None:
        """Each block's KV becomes its payload (from ``read_blocks`` of the same layout)."""
        if not block_ids:
            return
        pool = self.pool
        n = len(block_ids)
        size = self.block_bytes
        buf = bytearray(n * size)  # one copy of the payloads, then one indexed write
        for i, payload in enumerate(payloads):
            if len(payload) != size:
                raise ValueError(f"payload of {len(payload)} bytes for a block of {size}")
            buf[i * size : (i + 1) * size] = payload
        flat = torch.frombuffer(buf, dtype=torch.uint8).view(n, size)
        index = torch.tensor(list(block_ids), dtype=torch.int64, device=pool.device)
        shape = (n, *pool.data[:, :, 0].shape)
        data = flat[:, : self._data_bytes].contiguous().view(pool.data.dtype).view(shape)
        pool.data.index_copy_(2, index, data.movedim(0, 2).to(pool.device))
        if pool.scales is not None:
            sshape = (n, *pool.scales[:, :, 0].shape)
            scales = flat[:, self._data_bytes :].contiguous().view(pool.scales.dtype).view(sshape)
            pool.scales.index_copy_(2, index, scales.movedim(0, 2).to(pool.device))
