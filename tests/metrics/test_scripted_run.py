"""The real Scheduler + KVCacheManager + FakeRunner, driven step by step into a PrometheusSink.

Expected values are derived by hand from the scenario below (block_size 4, 10 blocks, a
16-token step budget, stall-free batching); the clock is the step number.

    step 1  prefill  A(10)                      A: blocks 0,1,2; 2 full blocks cached
    step 2  decode   A
    step 3  decode   A -> length (3 tokens)     A freed: 3 cached-free, 7 free
    (B, C, D, E arrive at t=3; D is aborted while waiting)
    step 4  prefill  B(2, 8 hit) C(6) E(4)      B reuses A's blocks 0,1; E fails (error)
    (F arrives at t=4: 32 distinct tokens, max_tokens 1)
    step 5  mixed    decode B, C + prefill F(14)   B -> length, C -> stop (EOS)
    step 6  prefill  F(16)                      needs 4 blocks: 2 free + 2 evicted
    step 7  prefill  F(2) -> length             every block ends cached-free
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from cache_manager import KVCacheConfig, KVCacheManager
from metrics.prometheus import PrometheusSink
from metrics.records import RequestRecord, StepRecord
from model_runner.fake import FakeRunner, make_fake_info
from scheduler import (
    Request,
    RequestOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from tests.metrics.helpers import value

EOS = 2


@dataclass(slots=True)
class _Times:
    arrival_s: float
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    gaps: list[float] = field(default_factory=list)


class Harness:
    """A synchronous engine: schedule, execute, update, then report to the sink."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.kv = KVCacheManager(KVCacheConfig(num_blocks=10, block_size=4, block_bytes=64))
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64),
            self.kv,
        )
        self.runner = FakeRunner(make_fake_info(eos_token_ids=(EOS,)))
        self.sink = PrometheusSink(registry, model_info={"model": "fake"})
        self.now = 0.0
        self.times: dict[str, _Times] = {}
        self.kinds: list[str] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int, script: list[int]) -> None:
        self.runner.set_script(rid, script)
        self.scheduler.add_request(
            Request(
                request_id=rid,
                prompt_token_ids=prompt,
                sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                eos_token_ids=(EOS,),
                arrival_time_s=self.now,
            )
        )
        self.times[rid] = _Times(arrival_s=self.now)

    def abort(self, rid: str) -> None:
        out = self.scheduler.abort(rid)
        assert out is not None
        self._done(out, abort_reason="abort_call")

    def step(self) -> str:
        self.now += 1.0
        plan = self.scheduler.schedule()
        result = self.runner.execute(plan)
        outs = self.scheduler.update(plan, result)
        self.kv.check_invariants()
        for seq in (*plan.prefill, *plan.decode):
            t = self.times[seq.request_id]
            if t.first_scheduled_s is None:
                t.first_scheduled_s = self.now
        kind = {(True, True): "mixed", (True, False): "prefill", (False, True): "decode"}.get(
            (bool(plan.prefill), bool(plan.decode)), "idle"
        )
        self.kinds.append(kind)
        self.sink.on_step(
            StepRecord(self.scheduler.make_stats(), kind, step_duration_s=0.01, schedule_cpu_s=0)
        )
        for out in outs:
            t = self.times[out.request_id]
            if out.new_token_ids:
                if t.first_token_s is None:
                    t.first_token_s = self.now
                else:
                    assert t.last_token_s is not None
                    t.gaps.append(self.now - t.last_token_s)
                t.last_token_s = self.now
            if out.finished:
                self._done(out, abort_reason=None)
        return kind

    def _done(self, out: RequestOutput, abort_reason: str | None) -> None:
        assert out.finish_reason is not None
        t = self.times[out.request_id]
        self.sink.on_request_done(
            RequestRecord(
                request_id=out.request_id,
                finish_reason=out.finish_reason.value,
                abort_reason=abort_reason,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
                num_output_tokens=out.num_output_tokens,
                arrival_s=t.arrival_s,
                first_scheduled_s=t.first_scheduled_s,
                first_token_s=t.first_token_s,
                finished_s=self.now,
                inter_token_s=list(t.gaps),
            )
        )


def blocks(registry: CollectorRegistry) -> dict[str, float]:
    return {
        state: value(registry, "kvserve_kv_cache_blocks", state=state)
        for state in ("used", "cached_free", "free", "reserved")
    }


def test_scripted_run_pins_every_counter() -> None:
    """Token counters, finish reasons, prefix hits, evictions, blocks by state, step kinds."""
    registry = CollectorRegistry()
    h = Harness(registry)
    h.add("A", list(range(1, 11)), max_tokens=3, script=[100, 101, 102])
    assert [h.step(), h.step(), h.step()] == ["prefill", "decode", "decode"]
    assert blocks(registry) == {"used": 0, "cached_free": 3, "free": 7, "reserved": 0}
    assert value(registry, "kvserve_prefix_cache_queries_tokens_total") == 10.0
    assert value(registry, "kvserve_prefix_cache_hits_tokens_total") == 0.0

    h.add("B", [*range(1, 9), 20, 21], max_tokens=2, script=[200, 201])  # 8-token prefix of A
    h.add("C", list(range(30, 36)), max_tokens=4, script=[300, EOS])
    h.add("D", list(range(40, 50)), max_tokens=4, script=[])
    h.add("E", list(range(50, 54)), max_tokens=4, script=[])
    h.runner.fail_request("E", "injected")
    h.abort("D")
    assert h.step() == "prefill"
    assert blocks(registry) == {"used": 5, "cached_free": 1, "free": 4, "reserved": 0}
    assert value(registry, "kvserve_prefix_cache_hits_tokens_total") == 8.0
    assert value(registry, "kvserve_requests_running") == 2.0  # B and C

    h.add("F", list(range(60, 92)), max_tokens=1, script=[900])
    assert h.step() == "mixed"
    assert blocks(registry) == {"used": 4, "cached_free": 4, "free": 2, "reserved": 0}
    assert value(registry, "kvserve_kv_cache_sequences") == 1.0
    assert value(registry, "kvserve_kv_cache_tokens") == 14.0
    assert value(registry, "kvserve_kv_cache_used_memory_bytes") == 4 * 64
    assert value(registry, "kvserve_kv_cache_usage_ratio") == 0.4
    assert value(registry, "kvserve_kv_cache_evictions_total") == 0.0
    assert [h.step(), h.step()] == ["prefill", "prefill"]
    assert not h.scheduler.has_unfinished_requests()

    assert blocks(registry) == {"used": 0, "cached_free": 10, "free": 0, "reserved": 0}
    assert value(registry, "kvserve_kv_cache_evictions_total") == 2.0
    assert value(registry, "kvserve_kv_cache_capacity_blocks") == 10.0
    assert value(registry, "kvserve_kv_cache_memory_bytes") == 640.0
    assert value(registry, "kvserve_kv_cache_sequences") == 0.0
    assert value(registry, "kvserve_prompt_tokens_total") == 10 + 10 + 6 + 10 + 4 + 32
    assert value(registry, "kvserve_generation_tokens_total") == 3 + 2 + 2 + 1
    assert value(registry, "kvserve_prefix_cache_queries_tokens_total") == 10 + 10 + 6 + 4 + 32
    assert value(registry, "kvserve_prefix_cache_hits_tokens_total") == 8.0
    assert value(registry, "kvserve_prefix_cache_hit_ratio") == 8 / 62
    assert value(registry, "kvserve_preemptions_total") == 0.0
    assert value(registry, "kvserve_kv_cache_cow_copies_total") == 0.0
    finished = {
        reason: value(registry, "kvserve_requests_finished_total", finish_reason=reason)
        for reason in ("stop", "length", "abort", "error")
    }
    assert finished == {"stop": 1.0, "length": 3.0, "abort": 1.0, "error": 1.0}
    assert value(registry, "kvserve_request_aborts_total", reason="abort_call") == 1.0
    assert value(registry, "kvserve_request_aborts_total", reason="error") == 1.0
    assert value(registry, "kvserve_request_aborts_total", reason="client_cancel") == 0.0

    # Steps: 1 4 6 7 prefill-only, 2 3 decode-only, 5 mixed; batches count 5 mixed twice.
    assert value(registry, "kvserve_scheduler_batches_total", kind="prefill") == 5.0
    assert value(registry, "kvserve_scheduler_batches_total", kind="decode") == 3.0
    dur = "kvserve_step_duration_seconds_count"
    assert value(registry, dur, kind="prefill") == 4.0
    assert value(registry, dur, kind="decode") == 2.0
    assert value(registry, dur, kind="mixed") == 1.0
    # Per-step composition: prefill tokens 10,0,0,12,14,16,2; decode requests 0,1,1,0,2,0,0.
    assert value(registry, "kvserve_step_prefill_tokens_count") == 7.0
    assert value(registry, "kvserve_step_prefill_tokens_sum") == 54.0
    assert value(registry, "kvserve_step_prefill_tokens_bucket", le="0.0") == 2.0
    assert value(registry, "kvserve_step_prefill_tokens_bucket", le="1.0") == 2.0
    assert value(registry, "kvserve_step_prefill_tokens_bucket", le="16.0") == 7.0
    assert value(registry, "kvserve_step_prefill_requests_sum") == 7.0  # 1+3+1+1+1
    assert value(registry, "kvserve_step_decode_requests_sum") == 4.0
    assert value(registry, "kvserve_step_decode_requests_bucket", le="1.0") == 6.0

    # Requests (clock = step number): TTFT A 1, B 1, C 1, F 3; e2e A 3 B 2 C 2 D 0 E 1 F 3.
    assert value(registry, "kvserve_request_time_to_first_token_seconds_count") == 4.0
    assert value(registry, "kvserve_request_time_to_first_token_seconds_sum") == 6.0
    assert value(registry, "kvserve_request_e2e_latency_seconds_count") == 6.0
    assert value(registry, "kvserve_request_e2e_latency_seconds_sum") == 11.0
    assert value(registry, "kvserve_request_queue_time_seconds_count") == 5.0  # D never ran
    assert value(registry, "kvserve_request_queue_time_seconds_sum") == 1 + 1 + 1 + 1 + 1
    assert value(registry, "kvserve_request_inter_token_latency_seconds_count") == 4.0  # A2 B1 C1
    assert value(registry, "kvserve_request_inter_token_latency_seconds_sum") == 4.0
    assert value(registry, "kvserve_request_time_per_output_token_seconds_count") == 3.0
    assert value(registry, "kvserve_request_generation_tokens_sum") == 8.0
    assert value(registry, "kvserve_request_prompt_tokens_sum") == 72.0
    assert value(registry, "kvserve_request_prompt_tokens_bucket", le="8.0") == 2.0  # C, E
    assert value(registry, "kvserve_request_prompt_tokens_bucket", le="16.0") == 5.0
    assert h.kinds == ["prefill", "decode", "decode", "prefill", "mixed", "prefill", "prefill"]
