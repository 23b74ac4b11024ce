"""Tier 2 on the engine side: moves block bytes between the KV pool and the on-disk store.

The cache manager decides (``cache_manager.tier``); this moves bytes, on three threads::

    engine thread   hold(request): prefetch ------> reader thread: store.get, verify -> ready
                    released(): ready -> kv.stage_tier_blocks; the held requests to admit
                    before_execute() / after_update(): take_tier_plan(); spills: copy out of
                                   the pool -> writer queue; restores: staged bytes -> pool
    writer thread   encode + store.put_many (+ LRU touches of restored blocks), one batch

The engine loop drives a ``Tier``: ``KVTier`` when tier 2 is on, ``NoTier`` (holds nothing,
moves nothing) when it is off, as ``NoSloPlanner`` stands in for the slo planner.

A step never waits on the disk: reads happen while the request waits (other requests keep
stepping), writes after the step started. Every store failure is a miss or a dropped spill,
logged once per kind and counted (``KVTierStats.errors_total``); a request never fails.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from cache_manager import KVCacheManager, KVTierStats, TierBlock, prefix_block_keys
from kv_store import BlockStore, EntryError, StoreError, decode_entry, encode_entry, store_key
from model_runner.base import BlockIO, Runner
from scheduler.output import SchedulerStats
from scheduler.request import Request

logger = logging.getLogger(__name__)

# Spilled bytes not yet written: past this, new spills are dropped (counted as "backlog").
DEFAULT_MAX_PENDING_BYTES = 512 << 20

T = TypeVar("T")


class Tier(Protocol[T]):
    """Tier 2 as the engine loop drives it, on the engine thread. ``T`` is what the engine
    holds for a request it cannot admit yet (its admission message)."""

    def attach(self, wake: Callable[[], None], is_waiting: Callable[[str], bool]) -> None:
        """``wake`` (any thread) when held requests are ready; ``is_waiting``: whether a
        request with staged blocks may still be admitted."""
        ...

    def hold(self, request: Request, item: T) -> bool:
        """Whether to hold ``request`` (with ``item``) while its prefix is read; False:
        admit it now."""
        ...

    @property
    def has_ready(self) -> bool:
        """Whether ``released`` has items to return."""
        ...

    def released(self) -> list[T]:
        """The held items whose reads finished (their blocks are staged): admit them."""
        ...

    def release(self, request_id: str) -> T | None:
        """Stop holding ``request_id`` (an abort): its item, or None when not held."""
        ...

    def release_all(self) -> list[T]:
        """Every held item (shutdown, death)."""
        ...

    def before_execute(self) -> None:
        """The planned spills out and restores in, after ``schedule``, before anything
        writes the pool."""
        ...

    def after_update(self) -> None:
        """The spills of blocks ``update`` freed, now rather than a step later."""
        ...

    def annotate(self, stats: SchedulerStats) -> SchedulerStats:
        """``stats`` with tier 2's own figures."""
        ...

    def shutdown(self) -> None:
        """The last spills, written before the store closes (a restart finds them)."""
        ...

    def wait_written(
        self, keys: Sequence[bytes], cache_salt: str | None, timeout_s: float = 30.0
    ) -> bool:
        """Whether the spills of the prefix-cache ``keys`` queued so far left the write queue
        within ``timeout_s`` (any thread; a prefill replica publishes this way). False with
        no store to write to."""
        ...


class NoTier(Generic[T]):
    """Tier 2 off: holds nothing, moves nothing."""

    def attach(self, wake: Callable[[], None], is_waiting: Callable[[str], bool]) -> None:
        pass

    def hold(self, request: Request, item: T) -> bool:
        return False

    @property
    def has_ready(self) -> bool:
        return False

    def released(self) -> list[T]:
        return []

    def release(self, request_id: str) -> T | None:
        return None

    def release_all(self) -> list[T]:
        return []

    def before_execute(self) -> None:
        pass

    def after_update(self) -> None:
        pass

    def annotate(self, stats: SchedulerStats) -> SchedulerStats:
        return stats

    def shutdown(self) -> None:
        pass

    def wait_written(
        self, keys: Sequence[bytes], cache_salt: str | None, timeout_s: float = 30.0
    ) -> bool:
        return False


@dataclass(slots=True)
class _Prefetch:
    request_id: str
    salt: str | None
    candidates: list[TierBlock]  # every full block of the prompt, in chain order
    in_tier1: list[bool]  # whether tier 1 held the block when the prefetch started


@dataclass(slots=True)
class _Spill:
    skey: bytes
    block: TierBlock
    payload: bytes


class KVTier(Generic[T]):
    """See the module docstring. ``store`` None: the store could not be opened, the tier
    only counts (spills are dropped, lookups miss)."""

    def __init__(
        self,
        kv: KVCacheManager,
        store: BlockStore | None,
        io: BlockIO,
        fingerprint: bytes,
        *,
        capacity_bytes: int,
        open_error: str | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
    ) -> None:
        self.kv = kv
        self.store = store
        self.io = io
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.max_pending_bytes = max_pending_bytes
        self._wake: Callable[[], None] = lambda: None
        self._is_waiting: Callable[[str], bool] = lambda _: False
        self._held: dict[str, T] = {}  # engine thread: requests held while being read
        self._lock = threading.Lock()
        self._errors: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._pending: dict[bytes, _Spill] = {}  # store key -> spill not yet written
        self._pending_bytes = 0
        self._ready: deque[tuple[str, list[tuple[TierBlock, bytes | memoryview]]]] = deque()
        # Engine thread: request -> chain key -> payload, and their bytes.
        self._staged: dict[str, dict[bytes, bytes | memoryview]] = {}
        self._staged_bytes = 0
        self._counts: Counter[str] = Counter()
        self._seconds: Counter[str] = Counter()
        self._usage = (0, 0)
        self._writes: queue.Queue[list[_Spill] | list[bytes] | None] = queue.Queue()
        self._reads: queue.Queue[_Prefetch | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        if open_error is not None:
            self._error("open", open_error)
        if store is not None:
            if store.num_stale_locks:
                self._error(
                    "stale_lock", f"cleared {store.num_stale_locks} reader slots of dead processes"
                )
            self._refresh_usage()
            for target, name in ((self._write_loop, "writer"), (self._read_loop, "reader")):
                thread = threading.Thread(target=target, name=f"kvserve-tier-{name}", daemon=True)
                thread.start()
                self._threads.append(thread)

    # ------------------------------------------------------------------ engine thread

    def attach(self, wake: Callable[[], None], is_waiting: Callable[[str], bool]) -> None:
        self._wake = wake
        self._is_waiting = is_waiting

    def hold(self, request: Request, item: T) -> bool:
        if not self.prefetch(request):
            return False
        self._held[request.request_id] = item
        return True

    def released(self) -> list[T]:
        if not self._ready:
            return []
        held = (self._held.pop(request_id, None) for request_id in self.poll())
        return [item for item in held if item is not None]

    def release(self, request_id: str) -> T | None:
        return self._held.pop(request_id, None)

    def release_all(self) -> list[T]:
        items = list(self._held.values())
        self._held.clear()
        return items

    def before_execute(self) -> None:
        self.move_blocks(self._is_waiting)

    def after_update(self) -> None:
        self.move_blocks(self._is_waiting)

    def shutdown(self) -> None:
        self.move_blocks(lambda _: False)
        self.close()

    def prefetch(self, request: Request) -> bool:
        """Start reading ``request``'s prefix from the store; True: hold the request until
        ``poll`` returns its id (tier 1 lacks part of the prefix). Never raises.

        Blocks tier 1 holds now are read too (a miss on them is no reason to stop): a
        request that waits in the queue may see them evicted before its admission, and then
        its hit continues into tier 2 instead of recomputing from there. A request whose
        prefix is all in tier 1 while the pool has room for it without evicting reads nothing.
        """
        if self.store is None or self._closed:
            return False
        if self._staged_bytes >= self.max_pending_bytes:
            self._error("backlog", f"{self._staged_bytes} bytes staged for waiting requests")
            return False
        try:
            tokens = request.all_token_ids
            bs = self.kv.block_size
            salt = request.cache_salt
            keys = prefix_block_keys(tokens[: len(tokens) - 1], bs, salt)
            if not keys:
                return False
            in_tier1 = [self.kv.has_cached_key(key) for key in keys]
            kv = self.kv
            num_empty = kv.num_free_blocks - kv.num_cached_free_blocks
            if all(in_tier1) and num_empty >= kv.num_blocks_for(len(tokens)):
                return False  # all in tier 1, and room without evicting: nothing to read
            candidates = [
                TierBlock(
                    key, keys[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]), salt
                )
                for i, key in enumerate(keys)
            ]
        except Exception as exc:  # a malformed request is the scheduler's to reject
            logger.debug("tier prefetch skipped for %s: %r", request.request_id, exc)
            return False
        self._reads.put(_Prefetch(request.request_id, salt, candidates, in_tier1))
        return not all(in_tier1)

    @property
    def has_ready(self) -> bool:
        return bool(self._ready)

    def poll(self) -> list[str]:
        """Stage the finished prefetches in the cache manager; their request ids (to admit)."""
        done: list[str] = []
        while self._ready:
            request_id, found = self._ready.popleft()
            if found:
                self.kv.stage_tier_blocks(request_id, [b for b, _ in found])
                self._drop_staged(request_id)
                self._staged[request_id] = {b.key: payload for b, payload in found}
                self._staged_bytes += sum(len(payload) for _, payload in found)
            done.append(request_id)
        return done

    def move_blocks(self, is_alive: Callable[[str], bool]) -> None:
        """Move the planned bytes (spills out, then restores in); drop the staged bytes of
        requests that were admitted or ended. Call after ``schedule`` (before anything writes
        the pool) and after ``update`` (so freed blocks are spilled without waiting for
        another step)."""
        plan = self.kv.take_tier_plan()
        if plan.spills:
            self._spill(plan.spills)
        if plan.restores:
            t0 = time.perf_counter()
            ids: list[int] = []
            payloads: list[bytes | memoryview] = []
            for block_id, key in plan.restores:
                ids.append(block_id)
                payloads.append(self._staged_payload(key))
            self.io.write_blocks(ids, payloads)
            with self._lock:
                self._counts["restore_blocks"] += len(ids)
                self._counts["restore_bytes"] += len(ids) * self.io.block_bytes
                self._seconds["restore"] += time.perf_counter() - t0
        if self._staged:
            staged = set(self.kv.staged_tier_request_ids())
            for request_id in list(self._staged):
                if request_id not in staged:
                    self._drop_staged(request_id)
                elif not is_alive(request_id):
                    self.kv.unstage_tier_blocks(request_id)
                    self._drop_staged(request_id)

    def _drop_staged(self, request_id: str) -> None:
        payloads = self._staged.pop(request_id, None)
        if payloads is not None:
            self._staged_bytes -= sum(len(p) for p in payloads.values())

    def _staged_payload(self, key: bytes) -> bytes | memoryview:
        for payloads in self._staged.values():
            payload = payloads.get(key)
            if payload is not None:
                return payload
        raise AssertionError(f"restore of {key.hex()} without staged bytes")

    def _spill(self, spills: Sequence[tuple[int, TierBlock]]) -> None:
        if self.store is None or self._closed:
            return
        if self._pending_bytes >= self.max_pending_bytes:
            self._error("backlog", f"{self._pending_bytes} spilled bytes not yet written")
            return
        payloads = self.io.read_blocks([block_id for block_id, _ in spills])
        batch = [
            _Spill(store_key(self.fingerprint, b.key, b.cache_salt), b, payload)
            for (_, b), payload in zip(spills, payloads, strict=True)
        ]
        with self._lock:
            for spill in batch:
                self._pending[spill.skey] = spill
            self._pending_bytes += sum(len(s.payload) for s in batch)
        self._writes.put(batch)

    def annotate(self, stats: SchedulerStats) -> SchedulerStats:
        """``stats`` with the store's side of tier 2 in ``stats.kv.tier2``."""
        return dataclasses.replace(stats, kv=dataclasses.replace(stats.kv, tier2=self.stats()))

    def stats(self) -> KVTierStats:
        with self._lock:
            c, s = self._counts, self._seconds
            return KVTierStats(
                backend="off" if self.store is None else self.store.kind,
                capacity_bytes=self.capacity_bytes,
                num_blocks=self._usage[0],
                num_bytes=self._usage[1],
                spill_blocks_total=c["spill_blocks"],
                spill_bytes_total=c["spill_bytes"],
                spill_seconds_total=s["spill"],
                restore_blocks_total=c["restore_blocks"],
                restore_bytes_total=c["restore_bytes"],
                restore_seconds_total=s["restore"],
                lookups_blocks_total=c["lookups"],
                errors_total=dict(self._errors),
            )

    def wait_written(
        self, keys: Sequence[bytes], cache_salt: str | None, timeout_s: float = 30.0
    ) -> bool:
        """Whether the spills of the prefix-cache ``keys`` (of ``cache_salt``) queued so far
        left the write queue (written, or dropped by a failing store) within ``timeout_s``.
        Thread-safe: a prefill replica waits here before saying its blocks are published."""
        skeys = [store_key(self.fingerprint, key, cache_salt) for key in keys]
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = any(skey in self._pending for skey in skeys)
            if not pending:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def drain(self, timeout_s: float = 30.0) -> None:
        """Wait until every queued write and read is done (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._writes.unfinished_tasks == 0 and self._reads.unfinished_tasks == 0:
                return
            time.sleep(0.002)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, stop the threads, close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.drain(timeout_s)
        self._writes.put(None)
        self._reads.put(None)
        for thread in self._threads:
            thread.join(timeout_s)
        if self.store is not None:
            try:
                self.store.close()
            except Exception as exc:
                logger.debug("closing the tier store: %r", exc)

    # ------------------------------------------------------------------ faults

    def _error(self, kind: str, message: str) -> None:
        with self._lock:
            self._errors[kind] += 1
            first = kind not in self._logged
            self._logged.add(kind)
        if first:  # one line per kind; the counter has the rest
            logger.warning(
                "KV tier 2 (%s): %s; serving from tier 1 and recomputation", kind, message
            )

    # ------------------------------------------------------------------ writer thread

    def _write_loop(self) -> None:
        while True:
            job = self._writes.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception as exc:  # never let the thread die
                self._error("write", repr(exc))
            finally:
                self._writes.task_done()

    def _write(self, job: list[_Spill] | list[bytes]) -> None:
        store = self.store
        assert store is not None
        if not job:
            return
        if isinstance(job[0], bytes):
            try:
                store.touch_many(job)  # type: ignore[arg-type]
            except StoreError as exc:
                self._error(exc.kind, str(exc))
            return
        spills: list[_Spill] = job  # type: ignore[assignment]
        t0 = time.perf_counter()
        items = [
            (
                s.skey,
                encode_entry(
                    self.fingerprint,
                    s.block.key,
                    s.block.parent_hash,
                    s.block.cache_salt,
                    s.block.token_ids,
                    s.payload,
                ),
            )
            for s in spills
        ]
        num_new = 0
        try:
            num_new = store.put_many(items)
        except StoreError as exc:
            self._error(exc.kind, str(exc))
        finally:
            with self._lock:
                for s in spills:
                    if self._pending.get(s.skey) is s:
                        del self._pending[s.skey]
                self._pending_bytes -= sum(len(s.payload) for s in spills)
        elapsed = time.perf_counter() - t0
        with self._lock:
            self._counts["spill_blocks"] += num_new
            self._counts["spill_bytes"] += sum(len(v) for _, v in items) if num_new else 0
            self._seconds["spill"] += elapsed
        self._refresh_usage()

    def _refresh_usage(self) -> None:
        assert self.store is not None
        try:
            usage = self.store.usage()
        except StoreError as exc:
            self._error(exc.kind, str(exc))
            return
        with self._lock:
            self._usage = usage

    # ------------------------------------------------------------------ reader thread

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            try:
                if job is None:
                    return
                found = self._read(job)
            except Exception as exc:  # never let the thread die; the request recomputes
                self._error("read", repr(exc))
                found = []
            finally:
                self._reads.task_done()
            if job is None:
                return
            self._ready.append((job.request_id, found))
            self._wake()

    def _read(self, job: _Prefetch) -> list[tuple[TierBlock, bytes | memoryview]]:
        """The candidates found in the store, verified, in chain order up to the first miss
        of a block tier 1 did not hold."""
        store = self.store
        assert store is not None
        found: list[tuple[TierBlock, bytes | memoryview]] = []
        touched: list[bytes] = []
        t0 = time.perf_counter()
        block_bytes = self.io.block_bytes
        for block, in_tier1 in zip(job.candidates, job.in_tier1, strict=True):
            skey = store_key(self.fingerprint, block.key, block.cache_salt)
            with self._lock:
                self._counts["lookups"] += 1
                pending = self._pending.get(skey)
            if pending is not None:
                found.append((block, pending.payload))
                continue
            try:
                raw = store.get(skey)
            except StoreError as exc:
                self._error(exc.kind, str(exc))
                break
            if raw is None:
                if in_tier1:
                    continue
                break
            try:
                entry = decode_entry(raw)
            except EntryError as exc:
                self._error(exc.kind, f"entry {skey.hex()}: {exc}")
                self._discard(skey)
                break
            if (
                entry.fingerprint != self.fingerprint
                or entry.key != block.key
                or entry.parent_hash != block.parent_hash
                or entry.cache_salt != block.cache_salt
                or entry.token_ids != block.token_ids
            ):
                break  # another prefix under a colliding key: a miss, never its KV
            if len(entry.payload) != block_bytes:
                self._error("truncated", f"entry {skey.hex()}: payload of {len(entry.payload)}")
                self._discard(skey)
                break
            found.append((block, entry.payload))
            touched.append(skey)
        if touched:
            self._writes.put(touched)
        with self._lock:
            self._seconds["restore"] += time.perf_counter() - t0
        return found

    def _discard(self, skey: bytes) -> None:
        assert self.store is not None
        try:
            self.store.discard(skey)
        except StoreError as exc:
            self._error(exc.kind, str(exc))


def open_kv_tier(
    kv: KVCacheManager,
    runner: Runner,
    *,
    disk_dir: str,
    capacity_bytes: int,
    store_kind: str,
    source: str,
    block_size: int,
) -> KVTier[Any]:
    """Tier 2 for a built engine: the store under ``disk_dir`` (a failure to open it is
    logged and counted, and the tier stays off), keyed by the model fingerprint."""
    import os

    from kv_store import model_fingerprint, open_store
    from kv_store.fingerprint import weights_digest

    info = runner.info
    store: BlockStore | None = None
    error: str | None = None
    try:
        store = open_store(store_kind, os.path.join(disk_dir, store_kind), capacity_bytes)
    except StoreError as exc:
        error = str(exc)
    digest = "fake"
    if source != "fake":
        cache_file = os.path.join(disk_dir, "fingerprints.json") if store is not None else None
        digest = weights_digest(source, cache_file)
    fingerprint = model_fingerprint(
        digest,
        f"{info.weights}/{info.dtype}",
        info.kv_dtype,
        block_size,
        f"{info.name}/{info.vocab_size}",
    )
    return KVTier(
        kv,
        store,
        runner.block_io(),
        fingerprint,
        capacity_bytes=capacity_bytes,
        open_error=error,
    )
