"""KV cache strategies: whether a request keeps its KV between steps, and what gives way under
memory pressure. Small strategy objects, chosen by ``KVCacheConfig.kv_strategy``.

- ``always``: every request keeps its KV until it ends (the paged cache as it has always been).
- ``disabled``: no request keeps KV between steps. After each sampled token its blocks are
  freed and the next step recomputes the whole sequence from position 0: the O(n^2)
  baseline for debugging and benchmarks. Blocks still exist during a step (attention reads
  the keys the step itself writes), and prefix caching is off.
- ``long-sequence-only``: as ``disabled`` while a request is shorter than
  ``kv_strategy_threshold`` tokens, as ``always`` from there on.
- ``adaptive``: as ``always`` until memory runs short. Then, before the scheduler preempts,
  retention shrinks: cached prefixes go first (they are free blocks here, lazy eviction, so the
  free list hands them out before anything else), then the oldest blocks of the longest
  requests are released, keeping each request's last ``kv_strategy_threshold`` tokens (their
  positions point at the null block and attention skips them: a lossy sliding window).
"""

from __future__ import annotations

KV_STRATEGIES = ("always", "long-sequence-only", "adaptive", "disabled")


class KVStrategy:
    """``always``: keep everything; never shrink retention."""

    name = "always"
    windows_under_pressure = False

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    @property
    def always_retains(self) -> bool:
        """True when no request ever drops its KV between steps (the hot path skips asking)."""
        return True

    def retains(self, num_tokens: int) -> bool:
        """Whether a request of ``num_tokens`` tokens keeps its KV for the next step."""
        return True


class DisabledStrategy(KVStrategy):
    name = "disabled"

    @property
    def always_retains(self) -> bool:
        return False

    def retains(self, num_tokens: int) -> bool:
        return False


class LongSequenceOnlyStrategy(KVStrategy):
    name = "long-sequence-only"

    @property
    def always_retains(self) -> bool:
        return False

    def retains(self, num_tokens: int) -> bool:
        return num_tokens >= self.threshold


class AdaptiveStrategy(KVStrategy):
    name = "adaptive"
    windows_under_pressure = True


def make_kv_strategy(name: str, threshold: int) -> KVStrategy:
    """The strategy named by ``KVCacheConfig.kv_strategy``."""
    for cls in (KVStrategy, DisabledStrategy, LongSequenceOnlyStrategy, AdaptiveStrategy):
        if cls.name == name:
            return cls(threshold)
    raise ValueError(f"unknown kv_strategy {name!r}; use one of {', '.join(KV_STRATEGIES)}")
