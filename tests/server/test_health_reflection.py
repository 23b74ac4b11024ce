"""Health service, server reflection (a generic client without our stubs), and health latency."""

from __future__ import annotations

import asyncio
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_requests import Client

from tests.server.helpers import (
    collect,
    expected_tokens,
    make_gated_runner,
    serve,
    wait_until,
)


async def test_health_serving_for_server_and_service() -> None:
    """Health answers SERVING for "" and kvserve.v1.Generation, NOT_FOUND for other names."""
    async with serve() as h:
        stub = health_pb2_grpc.HealthStub(h.channel)
        ok = [
            (await stub.Check(health_pb2.HealthCheckRequest(service=name))).status
            for name in ("", "kvserve.v1.Generation")
        ]
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
        except grpc.aio.AioRpcError as exc:
            unknown = exc.code()
    assert ok == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert unknown == grpc.StatusCode.NOT_FOUND


def _reflection_generate(address: str) -> tuple[list[str], list[dict[str, object]]]:
    client = Client.get_by_endpoint(address)  # discovers everything through reflection
    try:
        services = sorted(client.service_names)
        responses = list(
            client.request(
                "kvserve.v1.Generation",
                "Generate",
                {"text": "hello", "request_id": "refl", "stopping": {"max_tokens": 4}},
            )
        )
    finally:
        client.channel.close()
    return services, responses


async def test_generic_reflection_client_calls_generate() -> None:
    """grpc_requests (reflection, JSON-like dicts, not our stubs) streams Generate."""
    async with serve() as h:
        services, responses = await asyncio.to_thread(_reflection_generate, h.address)
    assert "kvserve.v1.Generation" in services and "grpc.health.v1.Health" in services
    tokens = [int(t) for r in responses for t in r.get("token_ids", [])]  # type: ignore[union-attr]
    assert tokens == expected_tokens(h.runner, "refl", 4)
    assert responses[-1]["finished"] is True
    assert responses[-1]["finish_reason"] == "FINISH_REASON_LENGTH"


async def test_health_answers_while_the_engine_is_saturated_and_inside_a_step() -> None:
    """With 96 streams (every one of 64 seats taken), and the engine held inside a step that
    does not end until the test lets it: 20 health checks answer SERVING. Health never waits
    for a step, so it is as fast as the event loop (typically well under 50 ms a check)."""
    runner = make_gated_runner(max_model_len=1024, sleep_s=0.02)
    async with serve(runner, max_num_seqs=64, num_blocks=4096) as h:
        stub = health_pb2_grpc.HealthStub(h.channel)
        streams = [
            asyncio.create_task(
                collect(h.client.generate(f"load {i}", request_id=f"L{i}", max_tokens=200))
            )
            for i in range(96)
        ]
        await wait_until(lambda: h.engine.latest_stats.num_running == 64)  # every seat taken
        runner.close()
        await wait_until(runner.is_held)
        latencies = []
        for _ in range(20):
            start = time.perf_counter()
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            latencies.append(time.perf_counter() - start)
            assert response.status == health_pb2.HealthCheckResponse.SERVING
        held = runner.is_held()
        runner.open()
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
    assert held, "the step ended while the checks ran"
    print(f"health check latencies (s): {sorted(latencies)}")
