"""The OpenAI-compatible API through Ray Serve's HTTP proxy (``cluster.openai_ingress``): a local
Ray cluster in this process, 2 replicas of the fake runner, compared with a single server."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from model_runner.constraints import ConstraintCompiler, ConstraintTracker
from server.auth import Security
from server.fake_tokenizer import ByteTokenizer
from tests.cluster.helpers import (
    ROOT,
    LocalCluster,
    replica_actor,
    replica_targets,
    running_by_replica,
    scrape,
    start_local_cluster,
    total,
    wait_for,
)
from tests.server.helpers import make_fake_runner, serve
from tests.server.test_structured_outputs import SCHEMA, TOOLS

pytestmark = pytest.mark.slow

ALICE, BOB = "key-alice", "key-bob"
KEYS = [ALICE, BOB]
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from start_local_cluster()


def sdk(url: str, key: str = ALICE) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def engine(**more: Any) -> dict[str, Any]:
    # /metrics open: the tests here read them (the admin key's rule: test_edge_table.py).
    return {
        "runner": "fake", "api_key": KEYS, "max_model_len": MAX_MODEL_LEN,
        "metrics_require_key": False, **more,
    }  # fmt: skip


async def answers(url: str) -> list[Any]:
    """One of each kind of call, each with a fixed request id (the fake runner's tokens depend
    on it and on the key): a completion, a streamed chat, a JSON-schema answer, a tool call,
    and a streamed completion read with curl."""
    client = sdk(url)
    chat = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
    out: list[Any] = []
    done = await client.completions.create(
        model="fake", prompt="hello", max_tokens=12, extra_headers={"X-Request-Id": "c-1"}
    )
    out.append((done.choices[0].text, done.choices[0].finish_reason, done.usage))
    stream = await client.chat.completions.create(
        **chat, max_tokens=10, stream=True, extra_headers={"X-Request-Id": "c-2"}
    )
    out.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    shaped = await client.chat.completions.create(
        **chat,
        max_tokens=80,
        response_format=schema,
        extra_headers={"X-Request-Id": "c-3"},  # type: ignore[arg-type]
    )
    content = shaped.choices[0].message.content or ""
    jsonschema.validate(json.loads(content), SCHEMA)
    out.append(content)
    tool = await client.chat.completions.create(
        **chat, max_tokens=600, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        temperature=1.0, extra_headers={"X-Request-Id": "c-4"},
    )  # fmt: skip
    calls = tool.choices[0].message.tool_calls or []
    out.append([(c.function.name, c.function.arguments) for c in calls])  # type: ignore[union-attr]
    await client.close()
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sN", f"{url}/v1/completions", "-H", f"Authorization: Bearer {ALICE}",
        "-H", "Content-Type: application/json", "-H", "X-Request-Id: c-5",
        "-d", json.dumps({"model": "fake", "prompt": "sse", "max_tokens": 6, "stream": True}),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, _ = await asyncio.wait_for(curl.communicate(), 120)
    assert curl.returncode == 0
    events = [line[6:] for line in stdout.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    out.append("".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]))
    return out


async def test_openai_api_through_the_cluster_answers_as_one_server(
    cluster: LocalCluster,
) -> None:
    """The openai SDK (a completion, a streamed chat, response_format with a JSON schema, a
    tool call) and curl's SSE through 2 replicas get exactly a single server's answers (same
    keys, same request ids); a wrong key is 401 and the OpenAPI document is served."""
    metrics_port = cluster.deploy_openai("oa-same", engine=engine(), num_replicas=2)
    url = cluster.http_url
    got = await answers(url)
    tracker = ConstraintTracker(ConstraintCompiler(ByteTokenizer()))
    runner = make_fake_runner(max_model_len=MAX_MODEL_LEN, constraints=tracker)
    security = Security(api_keys=frozenset(KEYS))
    async with serve(runner, http=True, security=security, num_blocks=1024) as h:
        want = await answers(h.http_url)
    assert got == want
    with pytest.raises(openai.AuthenticationError) as wrong:
        await sdk(url, key="key-mallory").completions.create(model="fake", prompt="x")
    assert wrong.value.status_code == 401
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        document = (await http.get("/openapi.json")).json()
    assert "/v1/chat/completions" in document["paths"]
    # Each call ran on a replica, counted there.
    served = [
        total([scrape(u)], "kvserve_requests_finished_total")
        for u in replica_targets(metrics_port, 2)
    ]
    assert sum(served) == 5


async def test_one_keys_flood_is_refused_while_another_key_is_admitted(
    cluster: LocalCluster,
) -> None:
    """Each replica runs one request and lets each key queue 2: Alice's requests fill both
    replicas (2 x (1 + 2)), her next one is a 429 naming her share, and Bob's is admitted
    and answered; driven by the replicas' own counts, not by time."""
    metrics_port = cluster.deploy_openai(
        "oa-flood",
        engine=engine(max_num_seqs=1, max_waiting_requests_per_tenant=2, fake_step_sleep_s=0.05),
        num_replicas=2,
    )
    urls = replica_targets(metrics_port, 2)

    def in_flight() -> float:
        samples = [scrape(u) for u in urls]
        return total(samples, "kvserve_requests_running") + total(
            samples, "kvserve_requests_waiting"
        )

    alice, bob = sdk(cluster.http_url), sdk(cluster.http_url, BOB)
    flood = []
    for i in range(6):
        flood.append(
            asyncio.ensure_future(
                alice.completions.create(model="fake", prompt=f"flood {i}", max_tokens=1500)
            )
        )
        await wait_for(lambda n=i + 1: in_flight() == n)  # type: ignore[misc]
    with pytest.raises(openai.RateLimitError) as refused:
        await alice.completions.create(model="fake", prompt="one more", max_tokens=1)
    assert "max_waiting_requests_per_tenant=2" in refused.value.message
    admitted = asyncio.ensure_future(bob.completions.create(model="fake", prompt="b", max_tokens=2))
    await wait_for(lambda: in_flight() == 7 or admitted.done())
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    answer = await admitted
    assert answer.choices[0].finish_reason == "length"
    await alice.close()
    await bob.close()


async def test_a_killed_replica_ends_its_http_streams_with_an_error_that_says_retry(
    cluster: LocalCluster,
) -> None:
    """Four SSE streams over both replicas; killing one replica ends each of its streams with
    an SSE error event (service_unavailable, "retry") then [DONE]; the other replica's streams
    finish, and a new request is answered."""
    import ray

    metrics_port = cluster.deploy_openai(
        "oa-kill", engine=engine(fake_step_sleep_s=0.02), num_replicas=2
    )
    urls = replica_targets(metrics_port, 2)
    outcomes: dict[int, list[dict[str, Any]]] = {}

    async def stream(i: int) -> None:
        body = {"model": "fake", "prompt": f"stream {i} " * 4, "max_tokens": 400, "stream": True}
        headers = {"Authorization": f"Bearer {ALICE}"}
        events: list[dict[str, Any]] = []
        async with (
            httpx.AsyncClient(base_url=cluster.http_url, timeout=300) as http,
            http.stream("POST", "/v1/completions", json=body, headers=headers) as reply,
        ):
            async for line in reply.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        outcomes[i] = events

    tasks = [asyncio.create_task(stream(i)) for i in range(4)]

    def all_running() -> bool:
        return total([scrape(u) for u in urls], "kvserve_requests_running") == 4

    await wait_for(all_running)
    by_replica = running_by_replica(urls)
    assert min(by_replica.values()) >= 1  # both replicas stream (the router spread them)
    victim = sorted(by_replica)[0]
    ray.kill(replica_actor(victim), no_restart=True)
    await asyncio.gather(*tasks)
    errors = [events[-1]["error"] for events in outcomes.values() if "error" in events[-1]]
    assert len(errors) == by_replica[victim]
    for error in errors:
        assert error["type"] == "service_unavailable" and "retry" in error["message"]
    finished = [e for e in outcomes.values() if "error" not in e[-1]]
    assert [e[-1]["choices"][0]["finish_reason"] for e in finished] == ["length"] * (
        4 - len(errors)
    )
    client = sdk(cluster.http_url)
    after = await client.completions.create(model="fake", prompt="after", max_tokens=3)
    assert after.choices[0].finish_reason == "length"
    await client.close()


@pytest.mark.parametrize("api", ["grpc", "http"])
async def test_vanish_16_streams_on_the_cluster_whose_client_process_is_killed(
    cluster: LocalCluster, api: str
) -> None:
    """A client process with 16 long streams open through the cluster (both replicas serve
    some) is SIGKILLed once each has a token: on every replica each request is aborted
    (client_cancel, 16 in all), none runs or waits, and no KV block stays in use."""
    metrics_port = cluster.deploy_openai(
        f"vanish-{api}", engine=engine(fake_step_sleep_s=0.02), num_replicas=2
    )
    urls = replica_targets(metrics_port, 2)
    target = cluster.address if api == "grpc" else cluster.http_url
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.server.vanishing_client", api, target, "16", "1000", ALICE,
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line == b"ready\n", line
        by_replica = running_by_replica(urls)
    finally:
        proc.kill()
        await proc.wait()
    assert sum(by_replica.values()) == 16 and min(by_replica.values()) >= 1

    def settled() -> bool:
        samples = [scrape(u) for u in urls]
        busy = total(samples, "kvserve_requests_running") + total(
            samples, "kvserve_requests_waiting"
        )
        used = total(samples, "kvserve_kv_cache_blocks", state="used")
        cancelled = total(samples, "kvserve_request_aborts_total", reason="client_cancel")
        return busy == 0 and used == 0 and cancelled == 16

    await wait_for(settled, timeout_s=120)


async def test_a_killed_ingress_ends_its_streams_saying_retry_while_the_other_serves(
    cluster: LocalCluster,
) -> None:
    """Two OpenAI ingress replicas (--http-ingress-replicas 2), four SSE streams: killing the
    ingress that serves some of them ends each of those with a service_unavailable event and
    [DONE] (the proxy's edge writes them), the others finish, and a new request is answered
    by the live ingress."""
    import ray
    from ray.util import list_named_actors

    cluster.deploy_openai(
        "oa-ingress", engine=engine(fake_step_sleep_s=0.02), num_replicas=2, num_http_ingress=2
    )
    outcomes: dict[int, list[str]] = {i: [] for i in range(4)}

    async def stream(i: int) -> None:
        body = {"model": "fake", "prompt": f"stream {i} " * 4, "max_tokens": 400, "stream": True}
        headers = {"Authorization": f"Bearer {ALICE}"}
        async with (
            httpx.AsyncClient(base_url=cluster.http_url, timeout=300) as http,
            http.stream("POST", "/v1/completions", json=body, headers=headers) as reply,
        ):
            async for line in reply.aiter_lines():
                if line:
                    outcomes[i].append(line)

    tasks = [asyncio.create_task(stream(i)) for i in range(4)]
    await wait_for(lambda: all(outcomes.values()))  # every stream has begun
    ingresses = [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in list_named_actors(all_namespaces=True)
        if "oa-ingress-openai#OpenAIIngress" in a["name"]
    ]
    assert len(ingresses) == 2

    def ongoing() -> list[int]:
        return [ray.get(a.get_num_ongoing_requests.remote()) for a in ingresses]

    await wait_for(lambda: sum(ongoing()) == 4)
    counts = ongoing()
    victim = max(range(2), key=lambda k: counts[k])
    ray.kill(ingresses[victim], no_restart=True)
    await asyncio.gather(*tasks)
    cut = [lines for lines in outcomes.values() if "service_unavailable" in lines[-2]]
    assert len(cut) == counts[victim]
    for lines in outcomes.values():
        assert lines[-1] == "data: [DONE]"
    for lines in cut:
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert error["type"] == "service_unavailable" and "retry" in error["message"]
    client = sdk(cluster.http_url)
    after = await client.completions.create(model="fake", prompt="after", max_tokens=3)
    assert after.choices[0].finish_reason == "length"
    await client.close()
