"""Small builders for cache-manager tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_manager import KVCacheConfig, KVCacheManager, PrefixHit


@dataclass(slots=True)
class Seq:
    """A minimal CacheSequence: tokens, progress and salt."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    num_prompt: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_prompt or len(self.tokens)


def make_kv(num_blocks: int = 8, block_size: int = 4, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=block_size, **kwargs))  # type: ignore[arg-type]


def make_seq(request_id: str, tokens: list[int] | range, salt: str | None = None) -> Seq:
    return Seq(request_id, list(tokens), cache_salt=salt)


def prefill(kv: KVCacheManager, seq: Seq, *, use_cache: bool = True) -> list[int]:
    """Admit ``seq`` like the scheduler does: prefix lookup, allocate the rest, run the step,
    register full blocks. Returns the hit block ids."""
    hit = kv.get_computed_blocks(seq) if use_cache else None
    num_hit_tokens = 0 if hit is None else hit.num_tokens
    alloc = kv.allocate_slots(seq, len(seq.tokens) - num_hit_tokens, hit)
    assert alloc is not None, f"no room for {seq.request_id}"
    seq.num_computed_tokens = len(seq.tokens)
    kv.cache_full_blocks(seq)
    kv.check_invariants()
    return [] if hit is None else hit.block_ids


def hit_view(hit: PrefixHit) -> tuple[list[int], int]:
    """(hit block ids, hit tokens): what a lookup found."""
    return (hit.block_ids, hit.num_tokens)


def decode(kv: KVCacheManager, seq: Seq, token: int) -> object:
    """One decode step: the token sampled last step is appended and computed now."""
    seq.tokens.append(token)
    alloc = kv.allocate_slots(seq, len(seq.tokens) - seq.num_computed_tokens)
    if alloc is not None:
        seq.num_computed_tokens = len(seq.tokens)
        kv.cache_full_blocks(seq)
    kv.check_invariants()
    return alloc
