"""The simulated engine: the real ``Scheduler`` and ``KVCacheManager`` over a ``SimRunner``
(a roofline cost model of a named GPU + model, ``model_runner/sim.py``) on a virtual clock,
and the two drivers: one engine (``simulate``) and many behind a router
(``simulate_cluster``). Each step is the engine's three calls. What a run reports is
``sim_report``; the CLI is ``simulate``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from cache_manager import KVCacheConfig, KVCacheManager, TierBlock, prefix_block_keys
from cluster.routing import CostModelPrice, ReplicaLoad, make_router, routing_keys
from loadtest.sim_report import RunSpec, Track, report
from loadtest.workload import RequestSpec
from model_runner.sim import SimProfile, SimRunner, roofline_cost_model
from scheduler import OverloadError, Request, RequestOutput, SamplingParams, Scheduler
from scheduler.cost_model import StepShape

__all__ = ["RunSpec", "SimEngine", "SimStore", "simulate", "simulate_cluster"]


class SimStore:
    """KV tier 2 as the simulator sees it: one store shared by every simulated replica,
    holding block keys (LRU, bounded by ``capacity_blocks``); reading a block (and copying it
    into the pool) costs ``restore_s_per_block`` of the waiting request's time, as
    ``server.kv_tier``'s reader thread does while other requests keep stepping."""

    def __init__(
        self,
        capacity_blocks: int,
        restore_s_per_block: float,
        on_put: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        if capacity_blocks < 1 or restore_s_per_block < 0:
            raise ValueError(
                f"capacity_blocks must be >= 1 and restore_s_per_block >= 0, got "
                f"{capacity_blocks} and {restore_s_per_block}"
            )
        self.capacity_blocks = capacity_blocks
        self.restore_s_per_block = restore_s_per_block
        self.on_put = on_put
        self._blocks: OrderedDict[bytes, TierBlock] = OrderedDict()
        self.num_spilled_blocks = 0
        self.num_restored_blocks = 0

    def put(self, blocks: Sequence[TierBlock]) -> None:
        for block in blocks:
            self._blocks[block.key] = block
            self._blocks.move_to_end(block.key)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        self.num_spilled_blocks += len(blocks)
        if self.on_put is not None and blocks:
            self.on_put([b.key for b in blocks])

    def read(self, candidates: Sequence[TierBlock], in_tier1: Sequence[bool]) -> list[TierBlock]:
        """The candidates found, in chain order up to the first one neither tier holds (the
        real reader's rule); each found block counts as a use."""
        found: list[TierBlock] = []
        for block, held in zip(candidates, in_tier1, strict=True):
            stored = self._blocks.get(block.key)
            if stored is None:
                if held:
                    continue
                break
            self._blocks.move_to_end(block.key)
            found.append(stored)
        return found


class SimEngine:
    """One simulated engine: a fresh scheduler, cache manager, SimRunner and virtual clock,
    and what the simulator records for its requests. ``step()`` is one engine step."""

    def __init__(
        self,
        run: RunSpec,
        profile: SimProfile,
        *,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        max_steps: int,
        store: SimStore | None = None,
    ) -> None:
        self.run = run
        self.store = store
        self.kv = KVCacheManager(
            KVCacheConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                block_bytes=profile.model.kv_bytes_per_token * block_size,
                kv_tier=store is not None,
            )
        )
        # slo: the roofline's least-squares fit as the prior, refitted online from every step
        # (the simulated device's times are the "measurements").
        self.cost_model = roofline_cost_model(profile) if run.config.policy == "slo" else None
        self.sched = Scheduler(run.config, self.kv, self.cost_model)
        self.runner = SimRunner(profile)
        self.clock = self.runner.clock
        self.eos = self.runner.info.eos_token_ids
        self.max_steps = max_steps
        self.tracks: dict[str, Track] = {}
        self.rejected: Counter[str] = Counter()
        self.static_batch: dict[str, int] = {}  # static batching: the batch, id -> final length
        self.num_steps = 0
        self.usage_time = 0.0  # integral of KV usage over busy time
        self.max_usage = 0.0
        self.decode_rows = 0
        self.to_cancel: set[str] = set()  # requests the client will cancel after some tokens
        # Requests held while tier 2 reads their prefix: (ready at, request, blocks found).
        self.held: list[tuple[float, Request, RequestSpec, list[TierBlock]]] = []
        self.reader_free_s = 0.0

    @property
    def num_load(self) -> int:
        """Requests queued or running here (what a router balances)."""
        return self.sched.num_waiting + self.sched.num_running + len(self.held)

    def has_work(self) -> bool:
        return self.sched.has_unfinished_requests() or bool(self.held)

    def admit(self, spec: RequestSpec, arrival_s: float) -> None:
        assert spec.prompt_token_ids is not None
        rid = f"req-{spec.index}"
        request = Request(
            request_id=rid,
            prompt_token_ids=list(spec.prompt_token_ids),
            sampling=SamplingParams(max_tokens=spec.max_tokens, ignore_eos=spec.ignore_eos),
            eos_token_ids=self.eos,
            priority=spec.priority,
            arrival_time_s=arrival_s,
        )
        found = self._prefetch(request)
        if found:
            assert self.store is not None
            # One reader per replica (server.kv_tier's reader thread): reads queue.
            start_s = max(arrival_s, self.reader_free_s)
            self.reader_free_s = start_s + len(found) * self.store.restore_s_per_block
            self.held.append((self.reader_free_s, request, spec, found))
            return
        self._add(request, spec, arrival_s)

    def _prefetch(self, request: Request) -> list[TierBlock]:
        """The blocks tier 2 would read for ``request`` (``server.kv_tier.KVTier.prefetch``'s
        rule: nothing when tier 1 holds the whole prefix and the pool has room for it)."""
        if self.store is None:
            return []
        tokens, bs, kv = request.prompt_token_ids, self.kv.block_size, self.kv
        keys = prefix_block_keys(tokens[: len(tokens) - 1], bs, None)
        if not keys:
            return []
        in_tier1 = [kv.has_cached_key(key) for key in keys]
        if all(in_tier1):
            return []  # the engine may read these to guard against eviction, but never waits
        candidates = [
            TierBlock(key, keys[i - 1] if i else None, tuple(tokens[i * bs : (i + 1) * bs]), None)
            for i, key in enumerate(keys)
        ]
        return self.store.read(candidates, in_tier1)

    def _release_held(self, now_s: float) -> None:
        """Admit the held requests whose read is done, their blocks staged."""
        ready = [h for h in self.held if h[0] <= now_s]
        if not ready:
            return
        self.held = [h for h in self.held if h[0] > now_s]
        for _, request, spec, found in sorted(ready, key=lambda h: h[0]):
            self.kv.stage_tier_blocks(request.request_id, found)
            self._add(request, spec, request.arrival_time_s)

    def _move_tier_blocks(self) -> None:
        """Spills go to the store; restores were paid for while their request was held."""
        plan = self.kv.take_tier_plan()
        if plan.spills and self.store is not None:
            self.store.put([block for _, block in plan.spills])
        if plan.restores and self.store is not None:
            self.store.num_restored_blocks += len(plan.restores)

    def _add(self, request: Request, spec: RequestSpec, arrival_s: float) -> None:
        rid = request.request_id
        try:
            self.sched.add_request(request)
        except OverloadError:
            self.rejected["overload"] += 1
            return
        except ValueError:
            self.rejected["invalid"] += 1
            return
        self.tracks[rid] = Track(arrival_s, request.num_prompt_tokens, spec.cancel_after_tokens)
        if spec.cancel_after_tokens is not None:
            self.to_cancel.add(rid)
        if self.run.static_batching:
            self.static_batch[rid] = 0

    def _record(self, out: RequestOutput, now_s: float) -> None:
        track = self.tracks[out.request_id]
        track.token_times_s.extend(now_s for _ in out.new_token_ids)
        if out.finished:
            track.finished_s = now_s
            track.finish_reason = out.finish_reason.value if out.finish_reason else None
            track.num_cached_tokens = out.num_cached_tokens
            if out.request_id in self.static_batch:
                self.static_batch[out.request_id] = track.num_prompt_tokens + out.num_output_tokens

    def step(self) -> None:
        """One step: schedule, execute on the cost model (the clock advances), update."""
        sched, clock, tracks = self.sched, self.clock, self.tracks
        self.num_steps += 1
        if self.num_steps > self.max_steps:
            raise RuntimeError(f"{self.run.name}: no end after {self.max_steps} steps")
        plan = sched.schedule(clock.now_s)
        self._move_tier_blocks()
        if plan.is_empty:
            raise RuntimeError(
                f"{self.run.name}: step {plan.step_id} scheduled nothing with "
                f"{sched.num_waiting} waiting and {sched.num_running} running"
            )
        for seq in plan.prefill:
            track = tracks[seq.request_id]
            if track.first_scheduled_s is None:
                track.first_scheduled_s = clock.now_s
        padding = [(1, length) for length in self.static_batch.values() if length]
        start_s = clock.now_s
        result = self.runner.execute(plan, padding=padding)
        now_s = clock.now_s
        if self.cost_model is not None:
            self.cost_model.observe(StepShape.of_plan(plan), now_s - start_s)
        usage = self.kv.usage
        self.usage_time += usage * (now_s - start_s)
        self.max_usage = max(self.max_usage, usage)
        self.decode_rows += len(plan.decode)
        for out in sched.update(plan, result):
            self._record(out, now_s)
        self._move_tier_blocks()
        for rid in list(self.to_cancel):
            track = tracks[rid]
            if track.finished_s is not None:
                self.to_cancel.discard(rid)
            elif track.cancel_after is not None and len(track.token_times_s) >= track.cancel_after:
                aborted = sched.abort(rid)
                assert aborted is not None
                self._record(aborted, now_s)
                self.to_cancel.discard(rid)

    def run_until(self, t_s: float) -> None:
        """Step while there is work and the clock is before ``t_s``; then idle up to it."""
        while self.clock.now_s < t_s and self._advance(t_s):
            pass
        if self.clock.now_s < t_s:
            self.clock.advance_to(t_s)
        self._release_held(self.clock.now_s)

    def finish(self) -> None:
        """Step until every admitted request has ended."""
        while self._advance(float("inf")):
            pass

    def _advance(self, limit_s: float) -> bool:
        """One step, or (idle with held requests) a jump to the next read's end before
        ``limit_s``; False when there is nothing to do before it."""
        self._release_held(self.clock.now_s)
        if self.sched.has_unfinished_requests():
            self.step()
            return True
        if not self.held:
            return False
        next_s = min(h[0] for h in self.held)
        if next_s >= limit_s:
            return False
        self.clock.advance_to(next_s)
        return True


def simulate(
    run: RunSpec,
    profile: SimProfile,
    specs: Sequence[RequestSpec],
    arrivals_s: Sequence[float],
    *,
    num_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_steps: int = 2_000_000,
) -> dict[str, Any]:
    """Run one configuration over the workload on a fresh scheduler, cache and clock."""
    engine = SimEngine(
        run,
        profile,
        num_blocks=num_blocks,
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
        max_steps=max_steps,
    )
    sched, clock = engine.sched, engine.clock
    order = sorted(range(len(specs)), key=lambda i: (arrivals_s[i], i))
    next_arrival = 0
    while next_arrival < len(order) or sched.has_unfinished_requests():
        # Arrivals up to now join the queue; static batching admits a batch only when idle.
        if not run.static_batching or not sched.has_unfinished_requests():
            engine.static_batch.clear()
            cap = run.config.max_num_seqs if run.static_batching else len(order)
            while (
                next_arrival < len(order)
                and arrivals_s[order[next_arrival]] <= clock.now_s
                and len(engine.static_batch) < cap
            ):
                i = order[next_arrival]
                engine.admit(specs[i], arrivals_s[i])
                next_arrival += 1
        if not sched.has_unfinished_requests():
            if next_arrival < len(order):
                clock.advance_to(arrivals_s[order[next_arrival]])
            continue
        engine.step()
    return report(run, [engine])


def simulate_cluster(
    run: RunSpec,
    profile: SimProfile,
    specs: Sequence[RequestSpec],
    arrivals_s: Sequence[float],
    *,
    num_replicas: int,
    router: str,
    num_blocks: int,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    max_steps: int = 2_000_000,
    seed: int = 0,
    tier_capacity_blocks: int | None = None,
    restore_s_per_block: float = 0.0,
) -> dict[str, Any]:
    """``num_replicas`` engines (each ``num_blocks`` of KV) behind ``cluster.routing``'s router.

    Before each arrival every replica runs up to the arrival time (a replica mid-step
    finishes that step first); the router then sees each replica's queued + running count
    and picks one, as ``kvserve cluster serve`` does with in-flight counts.

    ``tier_capacity_blocks``: the replicas share a tier 2 of that many blocks (a
    ``SimStore``), each read costing ``restore_s_per_block``. The cost router prices
    prefills with the profile's roofline cost model and learns each spill as it happens (a
    replica's report with no delay).
    """
    if run.static_batching:
        raise ValueError("--replicas simulates continuous batching only")
    chooser = make_router(
        router,
        capacity_blocks=num_blocks,
        seed=seed,
        block_size=block_size,
        price=CostModelPrice(roofline_cost_model(profile), run.config.max_num_batched_tokens),
        shared_capacity_blocks=tier_capacity_blocks,
        restore_s_per_block=restore_s_per_block,
    )
    store = None
    if tier_capacity_blocks is not None:

        def learn(keys: list[bytes]) -> None:  # spilled: in the shared tier now
            chooser.learn(None, (int.from_bytes(key[:8], "little") for key in keys))

        store = SimStore(tier_capacity_blocks, restore_s_per_block, on_put=learn)
    engines = [
        SimEngine(
            run,
            profile,
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_steps=max_steps,
            store=store,
        )
        for _ in range(num_replicas)
    ]
    decisions: Counter[str] = Counter()
    for i in sorted(range(len(specs)), key=lambda i: (arrivals_s[i], i)):
        spec, t_s = specs[i], arrivals_s[i]
        assert spec.prompt_token_ids is not None
        for engine in engines:
            engine.run_until(t_s)
        loads = [ReplicaLoad(f"{k:02d}", e.num_load) for k, e in enumerate(engines)]
        decision = chooser.choose(
            loads,
            routing_keys(spec.prompt_token_ids, block_size, None),
            num_prompt_tokens=len(spec.prompt_token_ids),
            now_s=t_s,
        )
        decisions[decision.reason] += 1
        engines[int(decision.replica_id)].admit(spec, t_s)
    for engine in engines:
        engine.finish()
    out = report(run, engines)
    out["name"] = f"{num_replicas} x {router}"
    out["replicas"] = num_replicas
    out["router"] = router
    out["router_decisions"] = dict(sorted(decisions.items()))
    if store is not None:
        out["kv"]["tier2"] = {
            "capacity_blocks": store.capacity_blocks,
            "restore_s_per_block": store.restore_s_per_block,
            "spilled_blocks": store.num_spilled_blocks,
            "restored_blocks": store.num_restored_blocks,
        }
    return out
