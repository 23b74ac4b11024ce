"""The cache manager's boundary types: what it reads from a request (``CacheSequence``), what an
allocation changed (``Allocation``), a prefix hit waiting to be consumed (``PrefixHit``), and
one request's block table (``RequestBlocks``, the manager's own state)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from cache_manager.block import KVBlock
from cache_manager.tier import TierBlock


class CacheSequence(Protocol):
    """What the cache manager reads from a request; ``scheduler.request.Request`` fits."""

    request_id: str
    num_computed_tokens: int
    cache_salt: str | None

    @property
    def all_token_ids(self) -> list[int]: ...  # prompt + output so far

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one ``allocate_slots``/``reserve_slots`` call changed in a block table. Read-only.

    ``new_block_ids`` were appended to the table (prefix hits first, then fresh blocks).
    ``block_copies`` are copy-on-write pairs ``(src, dst)``: the runner copies the KV of block
    ``src`` into block ``dst`` before the step, and the table now holds ``dst`` where it held
    ``src``. Always re-read ``block_ids(request_id)`` for the current table.
    """

    new_block_ids: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)


# The usual decode step changes nothing; one shared, never mutated answer for it.
NOTHING_NEW = Allocation()


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)
class PrefixHit:
    """The cached prefix ``get_computed_blocks`` found for one request: full, verified blocks
    and their prefix-cache keys (``num_tokens = len(blocks) * block_size``).

    ``allocate_slots`` / ``reserve_slots`` of the same request consume it: they reference the
    blocks, seed the table's keys with ``keys`` (nothing is hashed twice), and count
    ``num_query_tokens`` looked up and ``num_tokens`` hit, once. Compared by identity.

    With tier 2, ``restore`` continues the chain past the tier-1 ``blocks`` with blocks
    staged from the store: the allocation gives each a fresh block (``TierPlan.restores``)::

        | blocks (tier 1) | restore (tier 2, staged) |      keys cover both
    """

    request_id: str
    blocks: tuple[KVBlock, ...]
    keys: tuple[bytes, ...]
    num_tokens: int
    num_query_tokens: int  # len(all_token_ids) at lookup; 0 with prefix caching off
    restore: tuple[TierBlock, ...] = ()

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass(slots=True, eq=False)
class RequestBlocks:
    """One request's block table and prefix-cache progress."""

    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # Keys of the request's first len(block_keys) blocks (the computed, full ones); kept even
    # for released positions, because later keys chain on them.
    block_keys: list[bytes] = field(default_factory=list)
    # Positions released to the null block (sliding window, adaptive strategy): the
    # ``num_released`` positions after the sink blocks, ``[num_sink_blocks, + num_released)``.
    num_released: int = 0
    num_slots: int = 0  # slots written or being written: num_computed + new of the last step


class Growth(NamedTuple):
    """``KVCacheManager._measure``'s reading of one allocation, before it happens."""

    state: RequestBlocks | None
    start: int  # first slot written (the computed tokens, or the hit's)
    end: int  # one past the last slot written this step
    first: int  # the existing table positions the range writes: [first, last)
    last: int
    num_written: int  # blocks holding the slots up to end
    num_fresh: int  # blocks appended
    num_cow: int  # shared blocks copied on write
    num_take: int  # free-list blocks taken in all
