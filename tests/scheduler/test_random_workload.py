"""Random workloads (hypothesis, derandomized): invariants after every step, no leak at the end."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.fake import FakeRunner, make_fake_info
from scheduler import (
    OverloadError,
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.cost_model import StepCostModel, StepShape
from tests.scheduler.helpers import EOS, assert_no_blocks_held

STOP_TOKEN = 3
MAX_STEPS = 3000


@dataclass(frozen=True)
class Add:
    prompt_len: int
    max_tokens: int
    prefix: int  # 0 = none, else which of two shared prefixes
    priority: int
    n: int
    min_tokens: int
    ignore_eos: bool
    script: tuple[int, ...]


@dataclass(frozen=True)
class Steps:
    count: int


@dataclass(frozen=True)
class Abort:
    pick: int


@dataclass(frozen=True)
class Finish:
    pick: int


@dataclass(frozen=True)
class RunnerFails:
    pick: int


adds = st.builds(
    Add,
    prompt_len=st.integers(1, 24),
    max_tokens=st.integers(1, 12),
    prefix=st.integers(0, 2),
    priority=st.integers(0, 3),
    n=st.sampled_from([1, 1, 1, 2, 3]),
    min_tokens=st.integers(0, 2),
    ignore_eos=st.booleans(),
    script=st.lists(st.sampled_from([EOS, STOP_TOKEN, 5, 6, 7, 8, 9]), max_size=8).map(tuple),
)
events = st.one_of(
    st.builds(Steps, st.integers(1, 4)),
    st.builds(Steps, st.integers(1, 4)),
    st.builds(Abort, st.integers(0, 1000)),
    st.builds(Finish, st.integers(0, 1000)),
    st.builds(RunnerFails, st.integers(0, 1000)),
)
# Each request is followed by up to two events (steps, aborts, stop strings, runner failures).
ops = st.lists(st.tuples(adds, st.lists(events, max_size=2)), min_size=6, max_size=24).map(
    lambda pairs: [op for add, after in pairs for op in (add, *after)]
)
configs = st.fixed_dictionaries(
    {
        "num_blocks": st.one_of(st.integers(6, 12), st.integers(6, 32)),
        "block_size": st.sampled_from([2, 4, 8]),
        "max_num_seqs": st.integers(3, 6),
        "extra_budget": st.integers(0, 24),
        "long_prefill_token_threshold": st.integers(0, 12),
        "policy": st.sampled_from(["stall-free", "prefill-first", "slo"]),
        "itl_slo_ms": st.integers(2, 12),
        "max_decode_starvation_steps": st.integers(1, 3),
        "queue_order": st.sampled_from(["fcfs", "priority"]),
        "aging_steps": st.integers(0, 8),
        "preemption": st.sampled_from(["priority", "newest"]),
        "memory_mode": st.sampled_from(["optimistic", "optimistic", "reserve"]),
        "prefix_caching": st.booleans(),
        "sliding_window": st.sampled_from([None, None, 6, 12]),
        "max_waiting_requests": st.integers(4, 40),
        "speculative": st.sampled_from(["off", "ngram"]),
        "num_speculative_tokens": st.integers(1, 5),
    }
)


class Harness:
    """Drives a scheduler through ops and checks the invariants after every step."""

    def __init__(self, cfg: dict[str, object]) -> None:
        block_size = int(cfg["block_size"])  # type: ignore[call-overload]
        window = cfg["sliding_window"]
        self.kv = KVCacheManager(
            KVCacheConfig(
                num_blocks=int(cfg["num_blocks"]),  # type: ignore[call-overload]
                block_size=block_size,
                enable_prefix_caching=bool(cfg["prefix_caching"]),
                sliding_window=window if isinstance(window, int) else None,
            )
        )
        max_num_seqs = int(cfg["max_num_seqs"])  # type: ignore[call-overload]
        self.config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_seqs + int(cfg["extra_budget"]),  # type: ignore[call-overload]
            max_model_len=64,
            long_prefill_token_threshold=int(cfg["long_prefill_token_threshold"]),  # type: ignore[call-overload]
            policy=str(cfg["policy"]),
            max_decode_starvation_steps=int(cfg["max_decode_starvation_steps"]),  # type: ignore[call-overload]
            queue_order=str(cfg["queue_order"]),
            aging_steps=int(cfg["aging_steps"]),  # type: ignore[call-overload]
            preemption=str(cfg["preemption"]),
            max_waiting_requests=int(cfg["max_waiting_requests"]),  # type: ignore[call-overload]
            memory_mode=str(cfg["memory_mode"]),
            itl_slo_ms=int(cfg["itl_slo_ms"]),  # type: ignore[call-overload]
            ttft_slo_ms=200,
            speculative=str(cfg["speculative"]),
            num_speculative_tokens=int(cfg["num_speculative_tokens"]),  # type: ignore[call-overload]
            ngram_max=3,
            ngram_min=1,
        )
        # slo: a real RLS model, fed a linear "machine", with targets tight enough to bind
        # (late moves, deferred admissions, preemptions, the block floor all happen).
        self.cost = StepCostModel((1e-3, 2e-4, 5e-4, 1e-6, 1e-5, 2e-3))
        self.now_s = 0.0
        self.sched = Scheduler(self.config, self.kv, self.cost)
        self.runner = FakeRunner(
            make_fake_info(eos_token_ids=(EOS,)),
            verify_kv_block_size=block_size,
            verify_kv_null_block_id=self.kv.null_block_id,
        )
        self.ids: list[str] = []
        self.finished: Counter[str] = Counter()
        self.expected: set[str] = set()  # ids that must report exactly one final output

    def add(self, op: Add) -> None:
        rid = f"r{len(self.ids)}"
        prefix = [] if op.prefix == 0 else [1000 * op.prefix + i for i in range(12)]
        prompt = (prefix + list(range(10 + len(self.ids), 10 + len(self.ids) + op.prompt_len)))[:40]
        n = op.n if self.config.memory_mode == "optimistic" else 1
        request = Request(
            rid,
            prompt,
            SamplingParams(
                max_tokens=op.max_tokens,
                min_tokens=min(op.min_tokens, op.max_tokens),
                ignore_eos=op.ignore_eos,
                stop_token_ids=(STOP_TOKEN,),
                n=n,
            ),
            eos_token_ids=(EOS,),
            priority=op.priority,
            arrival_time_s=self.now_s,
            ttft_slo_s=None if op.priority == 0 else 0.1 * op.priority,
        )
        self.runner.set_script(rid, op.script)
        try:
            self.sched.add_request(request)
        except (ValueError, OverloadError):
            return
        self.ids.append(rid)
        self.expected.add(rid)

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.parent_id is not None:
                self.expected.add(out.request_id)
            if out.finished:
                self.finished[out.request_id] += 1

    def pick(self, k: int) -> str | None:
        return self.ids[k % len(self.ids)] if self.ids else None

    def step(self) -> SchedulerOutput:
        sched, kv, config = self.sched, self.kv, self.config
        plan = sched.schedule(self.now_s)
        shape = StepShape.of_plan(plan)
        self.cost.observe(shape, 1e-3 + 3e-4 * shape.prefill_tokens + 6e-4 * shape.decode_seqs)
        self.now_s += 0.05
        assert plan.num_prefill_tokens <= config.max_num_batched_tokens
        assert plan.num_scheduled_tokens <= config.max_num_batched_tokens
        assert sched.num_running <= config.max_num_seqs
        assert len(plan.decode) <= config.max_num_seqs
        ids = [s.request_id for s in (*plan.prefill, *plan.decode)]
        assert len(ids) == len(set(ids)), f"a request is scheduled twice: {ids}"
        assert all(len(s.token_ids) == 1 + s.num_draft_tokens for s in plan.decode)
        self.record(sched.update(plan, self.runner.execute(plan)))
        kv.check_invariants()
        stats = sched.make_stats()
        assert stats.num_running == sched.num_running
        assert stats.kv.total_sequences == sched.num_running
        if config.memory_mode == "reserve":
            assert stats.num_preemptions_total == 0
        return plan

    def run(self, operations: list[object]) -> None:
        for op in operations:
            if isinstance(op, Add):
                self.add(op)
            elif isinstance(op, Steps):
                for _ in range(op.count):
                    self.step()
            elif isinstance(op, Abort) and (rid := self.pick(op.pick)):
                out = self.sched.abort(rid)
                self.record([out] if out is not None else [])
            elif isinstance(op, Finish) and (rid := self.pick(op.pick)):
                out = self.sched.finish(rid, "</s>")
                self.record([out] if out is not None else [])
            elif isinstance(op, RunnerFails) and (rid := self.pick(op.pick)):
                self.runner.fail_request(rid, "injected")
        num_steps = 0
        while self.sched.has_unfinished_requests():
            num_steps += 1
            assert num_steps < MAX_STEPS, "the workload does not finish"
            self.step()
        self.sched.schedule()  # reports the last finished ids; nothing left to plan
        assert_no_blocks_held(self.kv)
        assert self.sched.num_waiting == 0 and self.sched.make_stats().num_waiting_tokens == 0
        assert {rid: 1 for rid in self.expected} == dict(self.finished)


@settings(
    max_examples=800,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cfg=configs, operations=ops)
def test_random_workloads_keep_every_invariant(
    cfg: dict[str, object], operations: list[object]
) -> None:
    """After every step: cache invariants, budget, seats; at the end: no block leaked and
    exactly one final output per request (and per forked sample)."""
    Harness(cfg).run(operations)
