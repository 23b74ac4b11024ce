"""kvserve on Ray Serve: a local Ray cluster in this process, 2 replicas of the fake runner,
kvserve's gRPC API through Ray Serve's gRPC proxy."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from server.build import build_engine
from server.client import KVServeClient
from server.config import build_config
from server.rpc import generation_pb2 as pb
from tests.cluster.helpers import (
    LocalCluster,
    replica_actor,
    replica_id_of,
    replica_targets,
    running_by_replica,
    scrape,
    start_local_cluster,
    total,
    wait_for,
    wait_http,
    wait_served,
)
from tests.metrics.helpers import free_port
from tests.server.helpers import LOCAL_OWNER, expected_tokens

pytestmark = pytest.mark.slow

FAKE = {"runner": "fake"}
YAML_PATH = Path(__file__).resolve().parents[2] / "cluster" / "kvserve.yaml"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from start_local_cluster()


def fake_tokens(request_id: str, num_tokens: int, owner: str = LOCAL_OWNER) -> list[int]:
    """The fake runner's tokens for a client's request, scoped by its owner (the peer seen
    through the proxy: this machine)."""
    runner = build_engine(build_config(FAKE, environ={})).runner
    return expected_tokens(runner, request_id, num_tokens, owner)  # type: ignore[arg-type]


async def collect(
    client: KVServeClient, prompt: str, request_id: str, max_tokens: int
) -> list[int]:
    """Every token id of one streamed generation."""
    return [
        t
        async for r in client.generate(prompt, request_id=request_id, max_tokens=max_tokens)
        for t in r.token_ids
    ]


async def test_generate_streams_and_cancel_reaches_the_replica(cluster: LocalCluster) -> None:
    """Generate streams the fake runner's exact tokens through the proxy; a bad request gets
    the replica's INVALID_ARGUMENT; closing a stream aborts its request in the replica (reason
    client_cancel) and frees its blocks."""
    engine = {**FAKE, "fake_step_sleep_s": 0.02}
    metrics_port = cluster.deploy("kv-stream", engine=engine, num_replicas=2)
    async with KVServeClient(cluster.address) as client:
        chunks = [r async for r in client.generate("hello", request_id="s-1", max_tokens=6)]
        assert [t for r in chunks for t in r.token_ids] == fake_tokens("s-1", 6)
        assert len(chunks) > 1  # streamed, not one reply
        assert chunks[-1].finished and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH

        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await collect(client, "", "empty", 4)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the prompt is empty" in (bad.value.details() or "")

        stream = client.generate("a long one", request_id="c-1", max_tokens=2000)
        received: list[int] = []
        async for response in stream:
            received.extend(response.token_ids)
            if len(received) >= 3:
                break
        await stream.aclose()  # cancels the call
    assert received[:3] == fake_tokens("c-1", 3)
    urls = replica_targets(metrics_port, 2)

    def settled() -> bool:
        # The abort is counted when it happens, the blocks at the engine's next snapshot:
        # wait for both, not for the first alone.
        samples = [scrape(u) for u in urls]
        return (
            total(samples, "kvserve_request_aborts_total", reason="client_cancel") == 1
            and total(samples, "kvserve_requests_running") == 0
            and total(samples, "kvserve_kv_cache_blocks", state="used") == 0
        )

    await wait_for(settled)
    samples = [scrape(u) for u in urls]
    assert total(samples, "kvserve_request_aborts_total", reason="client_cancel") == 1
    assert total(samples, "kvserve_requests_finished_total", finish_reason="length") == 1


async def test_both_replicas_metrics_are_listed_with_their_labels(cluster: LocalCluster) -> None:
    """The router's /targets lists both replicas; each one's series carry its replica label;
    the router counts its decisions by reason."""
    metrics_port = cluster.deploy("kv-metrics", engine=FAKE, num_replicas=2)
    async with KVServeClient(cluster.address) as client:
        for i in range(4):
            assert len(await collect(client, f"tenant {i} " * 8, f"m-{i}", 2)) == 2
    urls = replica_targets(metrics_port, 2)
    samples = [scrape(u) for u in urls]
    labels = []
    for s in samples:
        values = {got["replica"] for series in s.values() for got, _ in series}
        assert len(values) == 1  # every series of one replica carries its one label
        labels.append(values.pop())
    assert sorted(labels) == ["0", "1"]
    assert total(samples, "kvserve_requests_finished_total", finish_reason="length") == 4
    assert len({replica_id_of(s) for s in samples}) == 2
    router = scrape(f"127.0.0.1:{metrics_port}")
    assert total([router], "kvserve_router_decisions_total", router="cost") == 4
    assert total([router], "kvserve_router_decisions_total", reason="prefix_miss") == 4
    # Each prompt: BOS + 72 bytes, 4 full blocks of 16 before its last token, none cached.
    assert total([router], "kvserve_router_prefix_blocks_total", tier="none") == 4 * 4


def shared_prefix_prompts(seed: int) -> list[tuple[str, str]]:
    """6 tenants x 5 rounds, each prompt = the tenant's 160-token system prompt + its own
    20-token question; tenants come in a shuffled order every round."""
    rng = random.Random(seed)
    systems = [f"[tenant {t:02d}] " + chr(ord("a") + t) * 148 for t in range(6)]
    prompts = []
    for round_ in range(5):
        order = list(range(6))
        rng.shuffle(order)
        prompts += [
            (f"r{round_}-t{t}", systems[t] + f"question {round_}-{t}?".ljust(20)) for t in order
        ]
    return prompts


async def hit_rate(cluster: LocalCluster, router: str) -> float:
    # 40 blocks of 16 tokens per replica: 4 tenants' system prompts fit in one, all 6 do not.
    engine = {**FAKE, "num_blocks": 40}
    metrics_port = cluster.deploy(f"kv-{router}", engine=engine, num_replicas=2, router=router)
    # The proxy's router learns of the replicas asynchronously: both reported before the
    # workload, or the first prompts all go to the one it knows.
    urls = replica_targets(metrics_port, 2)
    async with KVServeClient(cluster.address) as client:
        for request_id, prompt in shared_prefix_prompts(seed=7):
            assert await collect(client, prompt, request_id, 2) == fake_tokens(request_id, 2)
    samples = [scrape(u) for u in urls]
    hits = total(samples, "kvserve_prefix_cache_hits_tokens_total")
    queries = total(samples, "kvserve_prefix_cache_queries_tokens_total")
    decisions = {
        got["reason"]: int(value)
        for got, value in scrape(f"127.0.0.1:{metrics_port}").get(
            "kvserve_router_decisions_total", []
        )
        if value
    }
    split = [int(total([s], "kvserve_prefix_cache_queries_tokens_total")) // 181 for s in samples]
    seen = f"{router}: decisions {decisions}, prompts per replica {split}, hit tokens {hits:g}"
    print(seen)
    assert queries == 30 * (1 + 180), seen  # every prompt (BOS + 180 bytes) looked up once
    assert sum(decisions.values()) >= 30, seen  # none routed without its keys
    return hits / queries


async def test_prefix_routing_hit_rate_beats_round_robin(cluster: LocalCluster) -> None:
    """On the same shared-prefix workload, prefix routing's hit rate is >= 1.6x round robin's:
    each replica keeps its tenants' system prompts instead of every replica cycling all."""
    prefix = await hit_rate(cluster, "prefix")
    round_robin = await hit_rate(cluster, "round-robin")
    print(f"prefix-cache hit rate: prefix {prefix:.3f}, round-robin {round_robin:.3f}")
    assert prefix >= 1.6 * round_robin, (prefix, round_robin)
    assert prefix > 0.5


async def test_killed_replica_fails_only_its_own_streams(cluster: LocalCluster) -> None:
    """Killing a replica mid-stream ends its streams with UNAVAILABLE; the other replica's
    streams complete with their exact tokens, new requests succeed, Ray restarts it."""
    from ray import serve

    engine = {**FAKE, "fake_step_sleep_s": 0.02}
    metrics_port = cluster.deploy("kv-fault", engine=engine, num_replicas=2)
    num_tokens = 400  # >= 8 s of steps: still streaming when the test kills the victim
    outcomes: dict[str, object] = {}
    async with KVServeClient(cluster.address) as client:

        async def run(i: int) -> None:
            rid = f"k-{i}"
            try:
                outcomes[rid] = await collect(client, f"stream {i} " * 4, rid, num_tokens)
            except grpc.aio.AioRpcError as exc:
                outcomes[rid] = exc

        tasks = [asyncio.create_task(run(i)) for i in range(4)]
        urls = replica_targets(metrics_port, 2)

        def all_running() -> bool:
            return total([scrape(u) for u in urls], "kvserve_requests_running") == 4

        await wait_for(all_running)
        by_replica = running_by_replica(urls)
        assert min(by_replica.values()) >= 1  # both replicas stream (the router spread them)
        victim = sorted(by_replica)[0]
        import ray

        ray.kill(replica_actor(victim), no_restart=True)
        await asyncio.gather(*tasks)

        failed = {rid: o for rid, o in outcomes.items() if isinstance(o, grpc.aio.AioRpcError)}
        assert len(failed) == by_replica[victim]
        for exc in failed.values():
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            assert "replica" in (exc.details() or "")
        for rid, got in outcomes.items():
            if rid not in failed:
                assert got == fake_tokens(rid, num_tokens)
        # A new request goes to the live replica at once.
        assert await collect(client, "after", "after-1", 3) == fake_tokens("after-1", 3)

    def restarted() -> bool:
        status = serve.status().applications["kv-fault"].deployments["KVServeReplica"]
        return status.replica_states.get("RUNNING", 0) == 2

    await wait_for(restarted, timeout_s=120)
    ids = {replica_id_of(scrape(u)) for u in replica_targets(metrics_port, 2)}
    assert victim not in ids and len(ids) == 2


async def test_shipped_yaml_config_deploys(cluster: LocalCluster) -> None:
    """cluster/kvserve.yaml is a valid Ray Serve config whose two apps (engine switched to the
    fake runner) serve Generate through the gRPC proxy with the servicer function it names,
    and the OpenAI API through the HTTP proxy."""
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import GENERATION_SERVICER, app_builder, openai_app_builder

    config = yaml.safe_load(YAML_PATH.read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.grpc_options.grpc_servicer_functions == [GENERATION_SERVICER]
    replicas, ingress = schema.applications
    assert replicas.import_path == "cluster.app:app_builder"
    assert ingress.import_path == "cluster.app:openai_app_builder"
    assert ingress.route_prefix == "/" and ingress.args["replicas_app"] == replicas.name
    args = dict(replicas.args)
    assert args["router"] == "cost"
    args["engine"] = {**args["engine"], **FAKE}
    args["router_metrics_port"] = free_port()
    for name in list(serve.status().applications):
        serve.delete(name)
    serve.run(app_builder(args), name=replicas.name, route_prefix=replicas.route_prefix)
    ingress_args = {**ingress.args, "engine": args["engine"]}
    serve.run(openai_app_builder(ingress_args), name=ingress.name, route_prefix="/")
    wait_served(cluster.address)
    wait_http(cluster.http_url)
    async with KVServeClient(cluster.address) as client:
        assert await collect(client, "from yaml", "y-1", 4) == fake_tokens("y-1", 4)
    async with httpx.AsyncClient(base_url=cluster.http_url, timeout=60) as http:
        reply = await http.post("/v1/completions", json={"prompt": "from yaml", "max_tokens": 4})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    with pytest.raises(ValueError, match="unknown kvserve cluster setting"):
        app_builder({"replicas": 2})


async def test_a_deployment_handle_streams_generate_for_an_http_ingress(
    cluster: LocalCluster,
) -> None:
    """The hook an HTTP front end uses: the replicas' handle streams Generate from a plain
    GenerateRequest, routed by the same router, with the fake runner's exact tokens."""
    from ray import serve

    from server.client import build_generate_request

    cluster.deploy("kv-handle", engine=FAKE, num_replicas=2)
    handle = serve.get_app_handle("kv-handle").options(stream=True, method_name="Generate")
    request = build_generate_request("from a handle", request_id="h-1", max_tokens=5)
    tokens = [t async for response in handle.remote(request) for t in response.token_ids]
    # No gRPC context on a handle call: the owner is an unknown peer ("peer:").
    assert tokens == fake_tokens("h-1", 5, owner="peer:")
