"""Random operation sequences against the cache manager, with a shadow KV store as oracle.

Every operation is followed by ``check_invariants()`` and by a data check: a shadow store
records, for every slot the model would write, the token prefix whose KV it holds. Every
computed position of every live request must read back exactly its own prefix through the
request's block table, and every prefix hit must point at blocks holding the queried prefix.
A copy-on-write, eviction or prefix-cache bug that hands out the wrong KV fails this check.
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from cache_manager import Allocation, KVCacheConfig, KVCacheManager
from tests.cache_manager.helpers import Seq

MAX_TOKENS = 40
# Shared prompt prefixes (system prompts); tokens come from a tiny vocabulary so that
# accidental equal blocks happen too.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 0, 0, 0, 0], [7, 7, 7, 7, 7, 7]]
SALTS = [None, "tenant-a", "tenant-b"]
tokens_st = st.lists(st.integers(0, 3), max_size=10)


class CacheManagerMachine(RuleBasedStateMachine):
    """Scheduler-like use of one KVCacheManager: admit, step, fork, free/abort, look up."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(KVCacheConfig(num_blocks=8))
        self.seqs: dict[str, Seq] = {}
        self.store: dict[int, list[tuple[int, ...] | None]] = {}
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(3, 24),
        block_size=st.sampled_from([1, 2, 4]),
        prefix_caching=st.booleans(),
        policy=st.sampled_from(["lru", "lfu", "shared-prefix"]),
        window=st.sampled_from([None, None, 5, 9]),
    )
    def configure(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool,
        policy: str,
        window: int | None,
    ) -> None:
        config = KVCacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
            eviction_policy=policy,
            sliding_window=window,
        )
        self.kv = KVCacheManager(config)
        self.store = {b: [None] * block_size for b in range(num_blocks)}

    # ------------------------------------------------------------------ helpers

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def _pick(self, index: int) -> Seq | None:
        if not self.seqs:
            return None
        return self.seqs[sorted(self.seqs)[index % len(self.seqs)]]

    def _write(self, seq: Seq, start: int, end: int, alloc: Allocation) -> None:
        """What the runner does: apply copy-on-write, then write KV for [start, end)."""
        for src, dst in alloc.block_copies:
            event("copy-on-write")
            self.store[dst] = list(self.store[src])
        table = self.kv.block_ids(seq.request_id)
        bs = self.kv.block_size
        assert len(table) * bs >= end
        for new_id in alloc.new_block_ids:
            assert new_id in table
        for p in range(start, end):
            block_id = table[p // bs]
            assert block_id != self.kv.null_block_id
            self.store[block_id][p % bs] = tuple(seq.tokens[: p + 1])

    def _after_step(self, seq: Seq) -> None:
        self.kv.cache_full_blocks(seq)
        released = self.kv.release_out_of_window(seq)
        assert released >= 0
        if released:
            event("sliding-window release")
        if self.kv.sliding_window is None:
            assert released == 0

    def _check_hits(self, seq: Seq, hits: list[int], num_hit_tokens: int) -> None:
        bs = self.kv.block_size
        assert num_hit_tokens == len(hits) * bs
        assert num_hit_tokens < len(seq.tokens)
        if not self.kv.enable_prefix_caching:
            assert hits == []
        if hits:
            event("prefix hit")
        for i, block_id in enumerate(hits):
            for offset in range(bs):
                p = i * bs + offset
                assert self.store[block_id][offset] == tuple(seq.tokens[: p + 1])

    def _snapshot(self) -> tuple[object, ...]:
        kv = self.kv
        tables = {rid: kv.block_ids(rid) for rid in self.seqs}
        return (kv.free_block_ids(), kv.make_stats(), tables)

    # ------------------------------------------------------------------ rules

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(0, 12),
        tail=tokens_st,
        salt=st.sampled_from(SALTS),
        chunk=st.integers(1, 16),
        reserve=st.sampled_from([0, 0, 0, 3, 8]),
    )
    def admit(
        self,
        prefix: int,
        prefix_len: int,
        tail: list[int],
        salt: str | None,
        chunk: int,
        reserve: int,
    ) -> None:
        tokens = PREFIXES[prefix][:prefix_len] + tail
        if not tokens:
            tokens = [0]
        seq = Seq(self._new_id(), tokens, cache_salt=salt)
        kv = self.kv
        hit = kv.get_computed_blocks(seq)
        hits, num_hit_tokens = hit.block_ids, hit.num_tokens
        self._check_hits(seq, hits, num_hit_tokens)
        num_new = min(chunk, len(tokens) - num_hit_tokens)
        before = self._snapshot()
        if reserve:
            alloc = kv.reserve_slots(seq, len(tokens) + reserve, hit)
        else:
            alloc = kv.allocate_slots(seq, num_new, hit)
        if alloc is None:
            event("admission refused: no room")
            after = self._snapshot()
            # A refused allocation changes nothing, not even the prefix-query counters.
            assert after == before
            assert not kv.has_request(seq.request_id)
            return
        assert alloc.new_block_ids[: len(hits)] == hits
        assert alloc.block_copies == []
        seq.num_computed_tokens = num_hit_tokens
        self.seqs[seq.request_id] = seq
        if reserve:
            assert len(kv.block_ids(seq.request_id)) == kv.num_blocks_for(len(tokens) + reserve)
            step = kv.allocate_slots(seq, num_new)
            assert step == Allocation([], [])
            alloc = step
        self._write(seq, num_hit_tokens, num_hit_tokens + num_new, alloc)
        seq.num_computed_tokens += num_new
        self._after_step(seq)

    @rule(index=st.integers(0, 1000), chunk=st.integers(1, 8), token=st.integers(0, 3))
    def step(self, index: int, chunk: int, token: int) -> None:
        seq = self._pick(index)
        if seq is None:
            return
        if seq.num_computed_tokens == len(seq.tokens):
            if len(seq.tokens) >= MAX_TOKENS:
                return
            seq.tokens.append(token)  # sampled by the previous step
        start = seq.num_computed_tokens
        num_new = min(chunk, len(seq.tokens) - start)
        before = self._snapshot()
        alloc = self.kv.allocate_slots(seq, num_new)
        if alloc is None:
            event("step refused: no room")
            assert self._snapshot() == before
            self._free(seq)  # preemption by recompute
            return
        self._write(seq, start, start + num_new, alloc)
        seq.num_computed_tokens += num_new
        self._after_step(seq)

    @rule(index=st.integers(0, 1000), reserve=st.sampled_from([0, 0, 4]))
    def fork(self, index: int, reserve: int) -> None:
        parent = self._pick(index)
        if parent is None:
            return
        child = Seq(
            self._new_id(),
            list(parent.tokens),
            num_computed_tokens=parent.num_computed_tokens,
            cache_salt=parent.cache_salt,
        )
        self.kv.fork(parent.request_id, child.request_id)
        assert self.kv.block_ids(child.request_id) == self.kv.block_ids(parent.request_id)
        self.seqs[child.request_id] = child
        if reserve:  # reserve mode: both sides make the blocks they will write private
            for seq in (parent, child):
                self._reserve_private(seq, len(seq.tokens) + reserve)

    def _reserve_private(self, seq: Seq, num_total: int) -> None:
        kv = self.kv
        num_before = len(kv.block_ids(seq.request_id))
        before = self._snapshot()
        alloc = kv.reserve_slots(seq, num_total)
        if alloc is None:
            assert self._snapshot() == before
            return
        self._write(seq, 0, 0, alloc)  # applies the copies, writes nothing
        table = kv.block_ids(seq.request_id)
        assert len(table) == max(num_before, kv.num_blocks_for(num_total))
        others = {
            block_id
            for request_id in self.seqs
            if request_id != seq.request_id
            for block_id in kv.block_ids(request_id)
        }
        # Every block the request will write within num_total is its own.
        for p in range(seq.num_computed_tokens // kv.block_size, kv.num_blocks_for(num_total)):
            assert table[p] not in others, f"{seq.request_id}: block {table[p]} still shared"

    def _free(self, seq: Seq) -> None:
        self.kv.free(seq.request_id)
        del self.seqs[seq.request_id]
        assert not self.kv.has_request(seq.request_id)

    @rule(index=st.integers(0, 1000))
    def free_or_abort(self, index: int) -> None:
        seq = self._pick(index)
        if seq is None:
            return
        self._free(seq)
        try:
            self.kv.free(seq.request_id)
        except KeyError:
            pass
        else:
            raise AssertionError("double free did not raise")

    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        prefix_len=st.integers(1, 12),
        tail=tokens_st,
        salt=st.sampled_from(SALTS),
    )
    def lookup(self, prefix: int, prefix_len: int, tail: list[int], salt: str | None) -> None:
        seq = Seq("probe", PREFIXES[prefix][:prefix_len] + tail, cache_salt=salt)
        hit = self.kv.get_computed_blocks(seq)
        self._check_hits(seq, hit.block_ids, hit.num_tokens)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def consistent(self) -> None:
        kv = self.kv
        kv.check_invariants()
        stats = kv.make_stats()
        assert (
            stats.num_blocks_used
            + stats.num_blocks_cached_free
            + stats.num_blocks_free
            + stats.num_blocks_reserved
            == stats.num_blocks_total
        )
        assert stats.total_sequences == len(self.seqs)
        assert 0.0 <= stats.cache_efficiency <= 1.0
        bs = kv.block_size
        for seq in self.seqs.values():
            table = kv.block_ids(seq.request_id)
            for p in range(seq.num_computed_tokens):
                block_id = table[p // bs]
                if block_id == kv.null_block_id:
                    window = kv.sliding_window
                    assert window is not None and p < seq.num_computed_tokens - window
                    continue
                assert self.store[block_id][p % bs] == tuple(seq.tokens[: p + 1]), (
                    f"{seq.request_id} position {p} reads wrong KV from block {block_id}"
                )

    def teardown(self) -> None:
        if self.kv.make_stats().evictions_total:
            event("evictions")
        for seq in list(self.seqs.values()):
            self._free(seq)
        kv = self.kv
        kv.check_invariants()
        stats = kv.make_stats()
        assert kv.num_free_blocks == kv.num_blocks - stats.num_blocks_reserved
        assert (stats.num_blocks_used, stats.total_sequences, stats.total_tokens) == (0, 0, 0)


CacheManagerMachine.TestCase.settings = settings(
    max_examples=2000,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_random_operations_keep_invariants_and_kv_correct = CacheManagerMachine.TestCase
