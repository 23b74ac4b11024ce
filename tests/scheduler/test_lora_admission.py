"""The ``max_loras`` admission rule (``scheduler.lora``): no more distinct adapters running
than the limit, requests of running adapters and of the base model admitted past one that
must wait, aging so no adapter starves, and the per-adapter counts of the stats."""

from __future__ import annotations

import dataclasses
import random

from scheduler import LoraRef, Request
from tests.scheduler.helpers import (
    make_request,
    make_runner,
    make_scheduler,
    run_until_done,
    step,
)


def with_adapter(request: Request, name: str | None) -> Request:
    if name is None:
        return request
    return dataclasses.replace(request, lora=LoraRef(name, f"{name}@0"))


def running_adapters(scheduler: object) -> set[str]:
    ids = scheduler.running_request_ids()  # type: ignore[attr-defined]
    refs = (scheduler.get_request(r).lora for r in ids)  # type: ignore[attr-defined]
    return {ref.name for ref in refs if ref is not None}


def test_a_third_adapter_waits_and_others_pass_it() -> None:
    """With max_loras 2 and adapters A and B running, a request for C waits; requests of A
    and of the base model queued behind it are admitted past it, in order; C runs once A's
    and B's requests end, and the plan's seqs carry each request's adapter."""
    scheduler, kv = make_scheduler(
        num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2, aging_steps=100
    )
    runner = make_runner(kv)
    for rid, name in (("a0", "A"), ("b0", "B")):
        scheduler.add_request(with_adapter(make_request(rid, 4, max_tokens=3), name))
    first = step(scheduler, runner)
    assert [(s.request_id, s.lora.name) for s in first.plan.prefill] == [("a0", "A"), ("b0", "B")]
    for rid, name in (("c0", "C"), ("a1", "A"), ("base", None)):
        scheduler.add_request(with_adapter(make_request(rid, 4, max_tokens=3), name))
    second = step(scheduler, runner)
    assert [s.request_id for s in second.plan.prefill] == ["a1", "base"]
    assert scheduler.waiting_request_ids() == ["c0"]
    assert running_adapters(scheduler) == {"A", "B"}
    stats = scheduler.make_stats()
    assert stats.lora_running == {"A": 2, "B": 1, "": 1} and stats.lora_waiting == {"C": 1}
    finished: set[str] = set()
    while "c0" in scheduler.waiting_request_ids():
        out = step(scheduler, runner)
        assert len(running_adapters(scheduler)) <= 2
        finished |= {o.request_id for o in out.outputs if o.finished}
    # C got a slot only once A's requests or B's had all ended.
    assert {"a0", "a1"} <= finished or "b0" in finished
    run_until_done(scheduler, runner)


def test_aging_stops_other_adapters_from_passing() -> None:
    """A request that waited aging_steps steps for a slot lets only base-model requests pass:
    later requests of a running adapter wait behind it, and it runs as soon as a slot frees
    (it does not starve while its rivals keep arriving)."""
    scheduler, kv = make_scheduler(
        num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_loras=1, aging_steps=2
    )
    runner = make_runner(kv)
    scheduler.add_request(with_adapter(make_request("a0", 4, max_tokens=6), "A"))
    step(scheduler, runner)
    scheduler.add_request(with_adapter(make_request("b0", 4, max_tokens=2), "B"))
    admitted: list[str] = []
    for i in range(12):
        # A keeps getting requests, and so does the base model.
        scheduler.add_request(with_adapter(make_request(f"a{i + 1}", 4, max_tokens=6), "A"))
        scheduler.add_request(make_request(f"base{i}", 4, max_tokens=1))
        out = step(scheduler, runner)
        admitted += [s.request_id for s in out.plan.prefill if s.start_pos == 0]
        assert len(running_adapters(scheduler)) <= 1
    assert "b0" in admitted, "B starved"
    b_at = admitted.index("b0")
    # After b0 aged (2 steps), no A request was admitted before it; base ones were.
    a_before = [r for r in admitted[:b_at] if r.startswith("a")]
    assert a_before == ["a1", "a2"], admitted
    assert any(r.startswith("base") for r in admitted[:b_at])


def test_random_workload_never_exceeds_max_loras_and_finishes() -> None:
    """A seeded mix of 6 adapters and the base model, arriving over time with preemptions
    (a small cache): no step runs more than max_loras adapters, every request finishes, and
    the cache invariants hold after every step."""
    rng = random.Random(7)
    scheduler, kv = make_scheduler(
        num_blocks=24,
        max_num_seqs=6,
        max_num_batched_tokens=24,
        max_loras=2,
        aging_steps=8,
        enable_prefix_caching=True,
    )
    runner = make_runner(kv)
    pending = [
        with_adapter(
            make_request(f"r{i}", rng.randint(2, 12), max_tokens=rng.randint(1, 8)),
            rng.choice([None, "A", "B", "C", "D", "E", "F"]),
        )
        for i in range(60)
    ]
    finished: set[str] = set()
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                scheduler.add_request(pending.pop(0))
        out = step(scheduler, runner)
        seqs = out.plan.prefill + out.plan.decode
        assert len({s.lora.name for s in seqs if s.lora is not None}) <= 2
        assert len(running_adapters(scheduler)) <= 2
        finished |= {o.request_id for o in out.outputs if o.finished}
        steps += 1
        assert steps < 2000
    assert finished == {f"r{i}" for i in range(60)}
