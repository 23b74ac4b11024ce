"""Tier 2 bookkeeping: which evicted blocks spill below the pool, which come back. Pure.

The cache manager decides, the engine moves bytes (``server.kv_tier``)::

    free / update -> keyed blocks becoming evictable -> TierPlan.spills   (copy out, then
    schedule()    -> prefix hits on staged blocks    -> TierPlan.restores  write off-path)
    engine: take_tier_plan(); copy spills out of the pool, then restores into it; execute.

A keyed block is spilled once per key, when its last holder frees it (not when it is
evicted): by the time it is evicted the store already has it, and so do a restarted server
and the other replicas on the host. A spill a failing store drops is simply a later miss.

A block below tier 1 is known here only as a ``TierBlock`` (its key and what the key stands
for); its bytes live in the store. A request's blocks found in the store are *staged* for it
(``stage``) once their bytes are in host memory, so a lookup never waits on a disk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from cache_manager.block import KVBlock


@dataclass(frozen=True, slots=True)
class TierBlock:
    """A full block's prefix-cache key and what it stands for (verified like a tier-1 hit)."""

    key: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    cache_salt: str | None

    def matches(
        self, parent_hash: bytes | None, token_ids: Sequence[int], salt: str | None
    ) -> bool:
        return (
            self.parent_hash == parent_hash
            and self.cache_salt == salt
            and self.token_ids == tuple(token_ids)
        )


@dataclass(frozen=True, slots=True)
class TierPlan:
    """What the engine moves before a step's forward pass, in this order:

    ``spills``: ``(block_id, block)`` evicted this step; copy the block's KV out *before*
    anything writes the block, then write it to the store off the critical path.
    ``restores``: ``(block_id, key)`` handed out this step for a staged block; copy the staged
    bytes of ``key`` into the block before the step reads it.
    """

    spills: list[tuple[int, TierBlock]] = field(default_factory=list)
    restores: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.spills and not self.restores


class TierLedger:
    """Spills and restores planned since the engine last took them, and staged blocks."""

    __slots__ = ("_restores", "_spills", "_staged", "num_hit_blocks", "num_spilled_blocks")

    def __init__(self) -> None:
        self._spills: list[tuple[int, TierBlock]] = []
        self._restores: dict[int, bytes] = {}  # block_id -> key, in planning order
        self._staged: dict[str, dict[bytes, TierBlock]] = {}  # request_id -> key -> block
        self.num_hit_blocks = 0
        self.num_spilled_blocks = 0

    def on_free(self, block: KVBlock) -> None:
        """A keyed block became evictable and tier 2 does not have it yet: spill it. Its KV
        is final and stays put until the block is handed out, which the engine's copy-out
        (before the next forward pass) precedes."""
        key = block.block_hash
        assert key is not None and block.token_ids is not None
        block.is_spilled = True
        self._spills.append(
            (block.block_id, TierBlock(key, block.parent_hash, block.token_ids, block.cache_salt))
        )
        self.num_spilled_blocks += 1

    def on_evict(self, block: KVBlock) -> None:
        """A keyed block loses its key to be handed out. A restore into it planned this very
        step is dropped: its bytes were never copied in (and the store holds them)."""
        self._restores.pop(block.block_id, None)

    def on_restore(self, block: KVBlock, key: bytes) -> None:
        block.is_spilled = True  # it came from the store
        self._restores[block.block_id] = key
        self.num_hit_blocks += 1

    def take_plan(self) -> TierPlan:
        """Hand the planned moves to the engine and forget them."""
        plan = TierPlan(self._spills, list(self._restores.items()))
        self._spills = []
        self._restores = {}
        return plan

    def stage(self, request_id: str, blocks: Sequence[TierBlock]) -> None:
        """``blocks`` (consecutive, in chain order) are in host memory for ``request_id``."""
        self._staged[request_id] = {b.key: b for b in blocks}

    def unstage(self, request_id: str) -> None:
        self._staged.pop(request_id, None)

    def staged(self, request_id: str) -> dict[bytes, TierBlock] | None:
        return self._staged.get(request_id)

    def staged_request_ids(self) -> list[str]:
        return list(self._staged)

    def pending_restore_ids(self) -> Iterator[int]:
        return iter(self._restores)
