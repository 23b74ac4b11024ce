"""The simulated engine: the real ``Scheduler`` and ``KVCacheManager`` over a ``SimRunner``
(a roofline cost model of a named GPU + model, ``model_runner/sim.py``) on a virtual clock,
and the two drivers: one engine (``simulate``) and many behind a router
(``simulate_cluster``). Each step is the engine's three calls. What a run reports is
``sim_report``; the CLI is ``simulate``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from cache_manager import KVCacheConfig, KVCacheManager
from cluster.routing import ReplicaLoad, make_router, routing_keys
from loadtest.sim_report import RunSpec, Track, report
from loadtest.workload import RequestSpec
from model_runner.sim import SimProfile, SimRunner, roofline_cost_model
from scheduler import OverloadError, Request, RequestOutput, SamplingParams, Scheduler
from scheduler.cost_model import StepShape

__all__ = ["RunSpec", "SimEngine", "simulate", "simulate_cluster"]


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
    ) -> None:
        self.run = run
        self.kv = KVCacheManager(
            KVCacheConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                enable_prefix_caching=enable_prefix_caching,
                block_bytes=profile.model.kv_bytes_per_token * block_size,
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

    @property
    def num_load(self) -> int:
        """Requests queued or running here (what a router balances)."""
        return self.sched.num_waiting + self.sched.num_running

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
        try:
            self.sched.add_request(request)
        except OverloadError:
            self.rejected["overload"] += 1
            return
        except ValueError:
            self.rejected["invalid"] += 1
            return
        self.tracks[rid] = Track(arrival_s, len(spec.prompt_token_ids), spec.cancel_after_tokens)
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
        while self.sched.has_unfinished_requests() and self.clock.now_s < t_s:
            self.step()
        if self.clock.now_s < t_s:
            self.clock.advance_to(t_s)

    def finish(self) -> None:
        """Step until every admitted request has ended."""
        while self.sched.has_unfinished_requests():
            self.step()


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
) -> dict[str, Any]:
    """``num_replicas`` engines (each ``num_blocks`` of KV) behind ``cluster.routing``'s router.

    Before each arrival every replica runs up to the arrival time (a replica mid-step
    finishes that step first); the router then sees each replica's queued + running count
    and picks one, as ``kvserve cluster serve`` does with in-flight counts.
    """
    if run.static_batching:
        raise ValueError("--replicas simulates continuous batching only")
    engines = [
        SimEngine(
            run,
            profile,
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            max_steps=max_steps,
        )
        for _ in range(num_replicas)
    ]
    chooser = make_router(router, capacity_blocks=num_blocks, seed=seed)
    decisions: Counter[str] = Counter()
    for i in sorted(range(len(specs)), key=lambda i: (arrivals_s[i], i)):
        spec, t_s = specs[i], arrivals_s[i]
        assert spec.prompt_token_ids is not None
        for engine in engines:
            engine.run_until(t_s)
        loads = [ReplicaLoad(f"{k:02d}", e.num_load) for k, e in enumerate(engines)]
        decision = chooser.choose(loads, routing_keys(spec.prompt_token_ids, block_size, None))
        decisions[decision.reason] += 1
        engines[int(decision.replica_id)].admit(spec, t_s)
    for engine in engines:
        engine.finish()
    out = report(run, engines)
    out["name"] = f"{num_replicas} x {router}"
    out["replicas"] = num_replicas
    out["router"] = router
    out["router_decisions"] = dict(sorted(decisions.items()))
    return out
