"""``kvserve cluster serve``: its flags, and an end-to-end run with 2 replicas of the embedded
SmolLM2 (a real Ray cluster in a child process)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from cluster.cli import build_parser, cluster_config
from server.client import KVServeClient
from tests.cluster.helpers import ROOT, replica_targets, scrape, total, wait_for, wait_served
from tests.metrics.helpers import free_port


def parse(*argv: str) -> tuple[object, object]:
    return cluster_config(build_parser().parse_args(["serve", *argv]))


def test_flags_map_to_the_cluster_and_engine_settings() -> None:
    """--port is the proxy's, --metrics-port the router's; engine flags reach every replica."""
    cfg, engine = parse(
        "--replicas", "3", "--router", "round-robin", "--runner", "fake", "--port", "6000",
        "--metrics-port", "6001", "--num-blocks", "64", "--imbalance-abs", "2",
    )  # fmt: skip
    assert (cfg.num_replicas, cfg.router, cfg.imbalance_abs) == (3, "round-robin", 2)  # type: ignore[attr-defined]
    assert cfg.router_metrics_port == 6001  # type: ignore[attr-defined]
    assert cfg.engine["runner"] == "fake" and cfg.engine["num_blocks"] == 64  # type: ignore[attr-defined]
    assert engine.port == 6000  # type: ignore[attr-defined]
    cfg, _ = parse("--no-metrics")
    assert cfg.router_metrics_port is None  # type: ignore[attr-defined]


def test_bad_settings_say_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    """Zero replicas and an unknown router are refused with the reason."""
    from cluster.cli import main

    assert main(["serve", "--replicas", "0", "--runner", "fake"]) == 2
    assert "replicas must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--router", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
]


async def greedy(address: str, prompt: str, request_id: str) -> list[int]:
    async with KVServeClient(address) as client:
        return [
            t
            async for r in client.generate(
                chat=[("user", prompt)], request_id=request_id, max_tokens=12, temperature=0.0
            )
            for t in r.token_ids
        ]


async def openai_answers(url: str) -> list[Any]:
    """Greedy answers through the openai SDK: a completion, a streamed chat, a JSON-schema
    answer and a forced tool call."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id
    chat: dict[str, Any] = {"model": model, "temperature": 0.0}
    out: list[Any] = []
    done = await client.completions.create(prompt="The capital of France is", max_tokens=8, **chat)
    out.append(done.choices[0].text)
    stream = await client.chat.completions.create(
        messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=12, stream=True, **chat
    )
    out.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))
    shaped = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Is Paris in France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
        max_tokens=40, **chat,
    )  # fmt: skip
    out.append(json.loads(shaped.choices[0].message.content or ""))
    tool = await client.chat.completions.create(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "weather", "parameters": CITY}}],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=40, **chat,
    )  # fmt: skip
    calls = tool.choices[0].message.tool_calls or []
    out.append([(c.function.name, json.loads(c.function.arguments)) for c in calls])  # type: ignore[union-attr]
    await client.close()
    return out


ANSWER = {
    "type": "object",
    "properties": {"yes": {"type": "boolean"}},
    "required": ["yes"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.slow
async def test_two_replicas_of_the_embedded_model_answer_as_one_server(tmp_path: Path) -> None:
    """kvserve cluster serve --replicas 2 with SmolLM2: both replicas serve, and every greedy
    answer equals a single in-process server's, on gRPC and on the OpenAI API (the openai SDK:
    a completion, a streamed chat, a JSON-schema answer, a tool call); SIGINT stops the
    cluster with status 0."""
    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    port, metrics_port = free_port(), free_port()
    log = (tmp_path / "cluster.log").open("w")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "cluster", "serve", "--replicas", "2",
         "--replica-cpus", "0", "--threads", "1", "--kv-memory", "32MiB", "--router", "round-robin",
         "--port", str(port), "--metrics-port", str(metrics_port), "--http-port", "0",
         "--port-file", str(tmp_path / "port"), "--http-port-file", str(tmp_path / "http")],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        await asyncio.to_thread(wait_served, f"127.0.0.1:{port}", 240.0)
        port_file, http_file = tmp_path / "port", tmp_path / "http"
        await wait_for(http_file.exists)  # written once both apps are up
        assert port_file.read_text() == f"{port}\n"
        got = [await greedy(f"127.0.0.1:{port}", p, f"c-{i}") for i, p in enumerate(PROMPTS)]
        got_http = await openai_answers(f"http://127.0.0.1:{int(http_file.read_text())}")
        urls = replica_targets(metrics_port, 2)
        finished = [
            total([scrape(u)], "kvserve_requests_finished_total", finish_reason="length")
            + total([scrape(u)], "kvserve_requests_finished_total", finish_reason="stop")
            for u in urls
        ]
        # Round robin, so both replicas answer (prefix routing sends every chat to one: they
        # share the chat template's system prompt, a cached prefix).
        assert sorted(finished) == [4, 4]  # 4 gRPC calls and 4 HTTP calls
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
        print((tmp_path / "cluster.log").read_text()[-4000:])
    # The reference: one kvserve server in this process, with the same engine settings.
    built = build_engine(build_config({"threads": 1, "kv_memory": "32MiB"}, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    single = await server.start("127.0.0.1", 0, http_port=0)
    try:
        want = [await greedy(f"127.0.0.1:{single}", p, f"r-{i}") for i, p in enumerate(PROMPTS)]
        want_http = await openai_answers(f"http://127.0.0.1:{server.http_port}")
    finally:
        await server.shutdown(0.5)
    assert got == want
    assert got_http == want_http
    print(f"OpenAI answers through the cluster: {got_http}")
    text = built.tokenizer.decode(got[0])
    assert "Paris" in text


def test_replicas_that_ray_cannot_place_are_named_with_the_flag(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3 replicas (1 prefill + 2 decode) x --replica-cpus 1 on a Ray of 2 CPUs: the CLI says
    how many CPUs it needs and has, and which flag to change; 0 CPUs a replica always fits."""
    import ray

    from cluster.cli import cpu_shortfall

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    cfg, _ = parse("--prefill-replicas", "1", "--replicas", "2", "--kv-disk-dir", "/tmp/x")
    said = cpu_shortfall(cfg)
    assert said is not None
    assert "3 replicas x --replica-cpus 1 = 3 CPUs" in said and "has 2" in said
    assert "lower --replica-cpus" in said
    cfg, _ = parse("--prefill-replicas", "1", "--replicas", "2", "--kv-disk-dir", "/tmp/x",
                   "--replica-cpus", "0")  # fmt: skip
    assert cpu_shortfall(cfg) is None


@pytest.mark.slow
def test_a_pd_split_that_cannot_be_placed_exits_1_within_60_s(tmp_path: Path) -> None:
    """kvserve cluster serve --prefill-replicas 1 --replicas 2 whose replicas need more CPUs
    than this machine's Ray has (1,000 each) exits 1 at start-up, saying why, within 60 s (it
    used to wait for ever)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "server.cli", "cluster", "serve", "--runner", "fake",
         "--prefill-replicas", "1", "--replicas", "2", "--kv-disk-dir", str(tmp_path),
         "--replica-cpus", "1000",
         "--port", str(free_port()), "--http-port", str(free_port()), "--no-metrics"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    took_s = time.monotonic() - started
    assert done.returncode == 1, done.stderr[-2000:]
    assert "--replica-cpus" in done.stderr and "CPUs" in done.stderr
    assert took_s < 60, took_s


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _alive(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (a zombie nobody reaped yet runs nothing)."""
    alive = set()
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if "\nState:\tZ" not in status:
            alive.add(pid)
    return alive


def _refused(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
async def test_parent_death_sigkill_of_a_replica_worker_then_of_cluster_serve(
    tmp_path: Path,
) -> None:
    """kvserve cluster serve --replicas 1 (fake runner): SIGKILL of the replica's Ray worker
    closes its metrics port and Serve starts a new replica that answers; SIGKILL of the CLI
    alone (not its group: the cluster runs in its child, which the kernel then sends SIGTERM)
    leaves no process of kvserve or Ray within 60 s (a drain of --grace-period-s 2, then Ray
    stops) and closes every port (gRPC, HTTP, the router's and the replica's metrics)."""
    from cluster.app import descendants

    port, http_port, metrics_port = free_port(), free_port(), free_port()
    log = tmp_path / "cluster.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server.cli", "cluster", "serve", "--runner", "fake",
             "--replicas", "1", "--replica-cpus", "0", "--grace-period-s", "2",
             "--port", str(port),
             "--http-port", str(http_port), "--metrics-port", str(metrics_port),
             "--http-port-file", str(tmp_path / "http")],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    address = f"127.0.0.1:{port}"
    started: set[int] = set()
    try:
        await asyncio.to_thread(wait_served, address, 240.0)
        await wait_for((tmp_path / "http").exists, timeout_s=240)
        (replica_url,) = replica_targets(metrics_port, 1)
        workers = [p for p in descendants(proc.pid) if ":KVServeReplica" in _cmdline(p)]
        assert len(workers) == 1, [_cmdline(p) for p in descendants(proc.pid)]
        os.kill(workers[0], signal.SIGKILL)
        replica_port = int(replica_url.rsplit(":", 1)[1])
        await wait_for(lambda: _refused(replica_port), timeout_s=60)

        async def answered() -> list[int]:
            async with KVServeClient(address) as client:
                return [t async for m in client.generate("again", max_tokens=3)
                        for t in m.token_ids]  # fmt: skip

        deadline = time.monotonic() + 180
        while True:  # Serve notices the dead replica and starts another
            try:
                assert len(await answered()) == 3
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1)
        (new_url,) = replica_targets(metrics_port, 1)
        started |= descendants(proc.pid)
        assert _alive(started) and workers[0] not in _alive(started)
        proc.kill()  # the CLI alone
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while left := _alive(started):
            assert time.monotonic() < deadline, [_cmdline(p) for p in left]
            await asyncio.sleep(0.5)
        ports = [port, http_port, metrics_port, int(new_url.rsplit(":", 1)[1])]
        assert all(_refused(p) for p in ports), [p for p in ports if not _refused(p)]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in _alive(started):  # what a failed run left
            os.kill(pid, signal.SIGKILL)
        print(log.read_text()[-3000:])
