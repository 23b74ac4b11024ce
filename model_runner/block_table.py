"""Block-table arithmetic shared by the attention paths (torch, the paged backends, the
runner's checks): which table position holds the first key a query can see."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def first_key_block(
    block_ids: Sequence[int],
    pos: int,
    block_size: int,
    sliding_window: int | None,
    num_sink_blocks: int,
    null_block_id: int | None,
) -> int:
    """The first table position after the sink blocks holding a key the query at ``pos``
    sees: the window's first block, or the first block not released to the null block
    (released positions follow the sink blocks, in one run), whichever is later."""
    first = 0
    if sliding_window is not None:
        first = max(0, pos - sliding_window + 1) // block_size
    if (
        null_block_id is not None
        and len(block_ids) > num_sink_blocks
        and block_ids[num_sink_blocks] == null_block_id
    ):
        live = bisect_left(
            block_ids,
            True,
            lo=num_sink_blocks,
            hi=pos // block_size + 1,
            key=lambda b: b != null_block_id,
        )
        first = max(first, live)
    return first
