"""The slo policy end to end on the fake runner: a request's own targets reach the scheduler,
the engine feeds the step-cost model every step, and goodput is counted per priority."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from metrics.prometheus import PrometheusSink
from scheduler.cost_model import StepCostModel
from server.build import build_engine
from server.client import KVServeClient
from server.config import ServerConfig
from server.lifecycle import KVServeServer
from server.rpc import generation_pb2 as pb


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_slo_policy_serves_and_counts_goodput_per_priority() -> None:
    """A server under --policy slo serves, keeps calibrating, and counts goodput by priority."""
    cfg = ServerConfig(runner="fake", policy="slo", itl_slo_ms=500, ttft_slo_ms=5000)
    built = build_engine(cfg)
    cost = built.engine.cost_model
    assert isinstance(cost, StepCostModel)
    calibrated = cost.num_observations
    registry = CollectorRegistry()
    built.engine.sink = PrometheusSink(registry, slo_targets_s=(5.0, 0.5))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    port = await server.start("127.0.0.1", 0)
    try:
        async with KVServeClient(f"127.0.0.1:{port}") as client:
            # Priority 0 with the server's loose targets; priority 1 with an impossible TTFT.
            relaxed = pb.GenerateRequest(text="hello", stopping=pb.StoppingOptions(max_tokens=4))
            strict = pb.GenerateRequest(
                text="hello there",
                priority=1,
                stopping=pb.StoppingOptions(max_tokens=4),
                slo=pb.LatencyTargets(ttft_ms=1e-6, itl_ms=1e5),
            )
            for request in (relaxed, strict):
                msgs = [m async for m in client.stub.Generate(request)]
                assert sum(len(m.token_ids) for m in msgs) == 4
    finally:
        await server.shutdown(grace_s=0.5)
    assert cost.num_observations > calibrated  # fed by the engine, every step
    assert _value(registry, "kvserve_slo_requests_total", priority="0") == 1
    assert _value(registry, "kvserve_slo_attained_total", priority="0", target="both") == 1
    assert _value(registry, "kvserve_slo_requests_total", priority="1") == 1
    assert _value(registry, "kvserve_slo_attained_total", priority="1", target="ttft") == 0
    assert _value(registry, "kvserve_slo_attained_total", priority="1", target="itl") == 1
    assert _value(registry, "kvserve_slo_attained_total", priority="1", target="both") == 0
    assert _value(registry, "kvserve_step_predicted_seconds_count") > 0
    assert _value(registry, "kvserve_step_prediction_error_ratio_count") > 0
