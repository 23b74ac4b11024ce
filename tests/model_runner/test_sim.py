"""SimRunner cost model: exact arithmetic on a tiny hand-computed profile, monotonicity, clock."""

from __future__ import annotations

import pytest

from model_runner.sim import (
    PROFILES,
    Hardware,
    SimModel,
    SimProfile,
    SimRunner,
    VirtualClock,
    estimate_step,
    get_profile,
)
from scheduler import SamplingParams, ScheduledSeq, SchedulerOutput

# 1 layer, hidden 2, intermediate 4, one head (and one KV head) of 2, vocab 8, 1 byte each:
# layer weights 2*2*2 (Q, O) + 2*2*2 (K, V) + 3*2*4 (MLP) = 40, lm_head 2*8 = 16,
# weight bytes 56; KV bytes per token 2 (K, V) * 1 layer * 1 head * 2 dims * 1 byte = 4.
TINY = SimModel(
    name="tiny",
    num_layers=1,
    hidden_size=2,
    intermediate_size=4,
    num_heads=1,
    num_kv_heads=1,
    head_dim=2,
    vocab_size=8,
    dtype_bytes=1,
    max_model_len=64,
)
SLOW = Hardware(
    name="slow", peak_flops=100.0, mem_bandwidth_bytes_s=10.0, step_overhead_s=0.5, memory_bytes=0
)


def test_tiny_model_shape_figures() -> None:
    """Layer weights 40, lm_head 16, weight bytes 56, KV 4 bytes per token."""
    assert (TINY.layer_params, TINY.lm_head_params, TINY.weight_bytes) == (40, 16, 56)
    assert TINY.kv_bytes_per_token == 4


def test_prefill_cost_by_hand() -> None:
    """A 3-token prompt: FLOPs 2*40*3 + 2*16*1 + 4*1*1*2*(0+1+2+3) = 320 (3.2 s);
    bytes 56 + 4*3 = 68 (6.8 s): memory-bound, 6.8 + 0.5 = 7.3 s."""
    cost = estimate_step(TINY, SLOW, [(3, 0)], num_sampled=1)
    assert (cost.flops, cost.bytes) == (320.0, 68.0)
    assert cost.compute_s == pytest.approx(3.2)
    assert cost.memory_s == pytest.approx(6.8)
    assert cost.time_s == pytest.approx(7.3)
    assert not cost.is_compute_bound


def test_decode_cost_by_hand() -> None:
    """Decodes at contexts 5 and 2: FLOPs 2*40*2 + 2*16*2 + 4*2*((5+1)+(2+1)) = 296;
    bytes 56 + 4*(5+2+2) = 92; time 9.2 + 0.5 = 9.7 s."""
    cost = estimate_step(TINY, SLOW, [(1, 5), (1, 2)], num_sampled=2)
    assert (cost.flops, cost.bytes) == (296.0, 92.0)
    assert cost.time_s == pytest.approx(9.7)


def test_kv_bandwidth_applies_to_kv_bytes_only() -> None:
    """With KV at 2 B/s: memory = 56/10 + 36/2 = 23.6 s, time 24.1 s."""
    hw = Hardware(
        name="kv-slow",
        peak_flops=100.0,
        mem_bandwidth_bytes_s=10.0,
        step_overhead_s=0.5,
        memory_bytes=0,
        kv_bandwidth_bytes_s=2.0,
    )
    cost = estimate_step(TINY, hw, [(1, 5), (1, 2)], num_sampled=2)
    assert cost.memory_s == pytest.approx(23.6)
    assert cost.time_s == pytest.approx(24.1)


def test_compute_bound_when_flops_dominate() -> None:
    """A fast memory makes the same prefill compute-bound: 3.2 + 0.5 s."""
    hw = Hardware(
        name="fast-mem",
        peak_flops=100.0,
        mem_bandwidth_bytes_s=1e6,
        step_overhead_s=0.5,
        memory_bytes=0,
    )
    cost = estimate_step(TINY, hw, [(3, 0)], num_sampled=1)
    assert cost.is_compute_bound and cost.time_s == pytest.approx(3.7)


def test_empty_step_costs_nothing() -> None:
    """No chunks: no time, not even the overhead."""
    assert estimate_step(TINY, SLOW, [], 0).time_s == 0.0


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_cost_is_monotone_in_batch_context_and_prefill(name: str) -> None:
    """More decodes, longer contexts or longer prefills never make a step cheaper."""
    profile = PROFILES[name]
    model, hw = profile.model, profile.hardware

    def t(chunks: list[tuple[int, int]], sampled: int) -> float:
        return estimate_step(model, hw, chunks, sampled).time_s

    decode_times = [t([(1, 512)] * b, b) for b in (1, 2, 8, 32, 128, 256, 1024)]
    assert decode_times == sorted(decode_times)
    context_times = [t([(1, c)] * 16, 16) for c in (0, 128, 1024, 4096, 8000)]
    assert context_times == sorted(context_times) and context_times[0] < context_times[-1]
    prefill_times = [t([(n, 0)], 1) for n in (1, 16, 128, 512, 2048, 8192)]
    assert prefill_times == sorted(prefill_times) and prefill_times[0] < prefill_times[-1]
    assert t([(512, 0)] + [(1, 512)] * 8, 9) >= t([(512, 0)], 1)


def test_h100_profile_has_the_roofline_asymmetry() -> None:
    """Batch-1 decode is memory-bound (7.1 ms: 15 GB of weights at 2.68 TB/s + 1.5 ms);
    a 2048-token prefill chunk is compute-bound; a 64-wide decode costs far less than 64x."""
    profile = get_profile("h100-llama3-8b-bf16")
    model, hw = profile.model, profile.hardware
    one = estimate_step(model, hw, [(1, 0)], 1)
    assert not one.is_compute_bound
    one_token_bytes = model.weight_bytes + model.kv_bytes_per_token  # weights + its KV write
    assert one.time_s == pytest.approx(one_token_bytes / hw.mem_bandwidth_bytes_s + 1.5e-3)
    assert estimate_step(model, hw, [(2048, 0)], 1).is_compute_bound
    assert estimate_step(model, hw, [(1, 0)] * 64, 64).time_s < 2 * one.time_s


def test_sim_runner_advances_the_clock_and_samples_like_fake_runner() -> None:
    """execute advances the virtual clock by the step cost, splits it into prefill and decode
    time, and samples FakeRunner's tokens; padding rows cost but sample nothing."""
    profile = SimProfile(name="tiny-slow", model=TINY, hardware=SLOW, kv_budget_bytes=4 * 16 * 10)
    runner = SimRunner(profile, script={"r1": [5, 6]})
    params = SamplingParams()
    prefill = ScheduledSeq("r0", [1, 2, 3], 0, [0], params, True, [1, 2, 3], 3, 0)
    decode = ScheduledSeq("r1", [4], 5, [1, 2], params, True, [9, 9, 9, 9, 9, 4], 5, 1)
    plan = SchedulerOutput(step_id=1, prefill=[prefill], decode=[decode])
    out = runner.execute(plan)
    expected = estimate_step(TINY, SLOW, [(3, 0), (1, 5)], 2).time_s
    assert runner.now_s == pytest.approx(expected) and runner.busy_s == pytest.approx(expected)
    assert out.prefill_time_s == pytest.approx(estimate_step(TINY, SLOW, [(3, 0)], 1).time_s)
    assert out.prefill_time_s + out.decode_time_s == pytest.approx(expected)
    assert out.sampled_token_ids == {"r0": runner.tokens.default_token("r0", 0), "r1": 6}
    before = runner.now_s
    runner.execute(plan, padding=[(1, 7)])
    padded = estimate_step(TINY, SLOW, [(3, 0), (1, 5), (1, 7)], 2).time_s
    assert runner.now_s - before == pytest.approx(padded)
    assert profile.default_num_blocks == 10
    assert runner.info.shape.kv_bytes_per_token == 4 and runner.info.extra["simulated"] == "true"


def test_virtual_clock_only_moves_forward() -> None:
    """advance rejects negative time; advance_to never goes back."""
    clock = VirtualClock()
    clock.advance(1.5)
    clock.advance_to(1.0)
    assert clock.now_s == 1.5
    clock.advance_to(4.0)
    assert clock.now_s == 4.0
    with pytest.raises(ValueError):
        clock.advance(-0.1)


def test_profiles_and_validation() -> None:
    """Unknown profiles list the known ones; shapes and hardware are validated."""
    with pytest.raises(ValueError, match="cpu-smollm2-135m-fp32, h100-llama3-8b-bf16"):
        get_profile("tpu")
    with pytest.raises(ValueError, match="num_layers must be >= 1"):
        SimModel("x", 0, 2, 4, 1, 1, 2, 8, 1, 64)
    with pytest.raises(ValueError, match="peak_flops"):
        Hardware("x", 0.0, 1.0, 0.0, 0)
    assert {"h100-llama3-8b-bf16", "cpu-smollm2-135m-fp32"} <= set(PROFILES)
