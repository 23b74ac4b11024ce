"""`kvserve serve --runner fake` as a real process: start-up, generate, SIGTERM, runner death."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path

import pytest

from model_runner.fake import FakeRunner
from server import cli
from server.client import KVServeClient
from server.fake_tokenizer import ByteTokenizer
from server.rpc import generation_pb2 as pb
from tests.metrics.helpers import free_port
from tests.server.helpers import collect, engine_id, fake_info

REPO_ROOT = Path(__file__).resolve().parents[2]


def _kvserve() -> list[str]:
    """The installed console script when present, else the module (same entry point)."""
    script = Path(sys.executable).with_name("kvserve")
    return [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]


@contextmanager
def serve_process(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Start `kvserve serve --runner fake --port 0` and wait for its --port-file."""
    port_file = tmp_path / "port"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
    env["PYTHONPATH"] = str(REPO_ROOT)  # this checkout's code, whichever one the script names
    proc = subprocess.Popen(
        [*_kvserve(), "serve", "--runner", "fake", "--port", "0", "--port-file",
         str(port_file), "--metrics-port", "0", "--http-port", "0", *flags],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None:
                raise AssertionError(
                    f"serve exited early:\n{proc.stdout.read() if proc.stdout else ''}"
                )
            assert time.monotonic() < deadline, "serve did not write its port file in 60 s"
            time.sleep(0.05)
        yield proc, int(port_file.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _output(proc: subprocess.Popen[str]) -> str:
    return proc.stdout.read() if proc.stdout else ""


@pytest.mark.slow
def test_serve_prints_startup_and_drains_on_sigterm(tmp_path: Path) -> None:
    """serve prints model/KV/address; SIGTERM lets an in-flight request finish, then exit 0."""
    with serve_process(tmp_path, "--fake-step-sleep-s", "0.02", "--grace-period-s", "20") as (
        proc, port,
    ):  # fmt: skip

        async def scenario() -> tuple[list[pb.GenerateResponse], str]:
            async with KVServeClient(f"127.0.0.1:{port}") as client:
                stream = client.generate("hello", request_id="inflight", max_tokens=60)
                first = await anext(stream)
                proc.send_signal(signal.SIGTERM)
                rest = await collect(stream)
                return [first, *rest], "ok"

        msgs, _ = asyncio.run(scenario())
        assert proc.wait(timeout=30) == 0
        out = _output(proc)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in msgs) == 60
    assert "model: fake" in out and "dtype: float32" in out and "device: cpu" in out
    assert "kv cache: 4096 blocks x 16 tokens" in out
    assert f"listening on 127.0.0.1:{port}" in out
    assert "SIGTERM: draining" in out and "stopped" in out


def _samples(exposition: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus exposition: name -> value."""
    return {
        name: float(value)
        for name, _, value in (line.partition(" ") for line in exposition.splitlines())
        if name and not name.startswith("#") and "{" not in name
    }


@pytest.mark.slow
def test_generate_command_streams_from_a_served_process(tmp_path: Path) -> None:
    """`kvserve generate` prints the streamed text; --chat sends a chat message; the
    Prometheus endpoint counts the calls."""
    metrics_port = free_port()
    with serve_process(tmp_path, "--metrics-port", str(metrics_port)) as (proc, port):
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            idle = _samples(response.read().decode())
        out = io.StringIO()
        with redirect_stdout(out):
            code = cli.main(["generate", "--address", f"127.0.0.1:{port}", "--max-tokens", "5",
                             "--request-id", "cli-1", "hello"])  # fmt: skip
        chat_out = io.StringIO()
        with redirect_stdout(chat_out):
            chat_code = cli.main(
                ["generate", "--address", f"127.0.0.1:{port}", "--chat", "--max-tokens", "3",
                 "What is the capital of France?"]
            )  # fmt: skip
        bad = cli.main(["generate", "--address", f"127.0.0.1:{port}", "--max-tokens", "0", "x"])
        with urllib.request.urlopen(url, timeout=10) as response:
            metrics = response.read().decode()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    assert (code, chat_code, bad) == (0, 0, 1)
    # The served fake runner: vocabulary 258 (bytes + BOS/EOS), seed 0.
    runner = FakeRunner(fake_info(max_model_len=4096))
    tokens = [runner.default_token(engine_id("cli-1"), i) for i in range(5)]
    assert out.getvalue() == ByteTokenizer().decode(tokens, skip_special_tokens=True) + "\n"
    assert chat_out.getvalue().endswith("\n")
    assert 'kvserve_rpcs_total{code="OK",method="Generate"} 2.0' in metrics
    assert 'kvserve_rpcs_total{code="INVALID_ARGUMENT",method="Generate"} 1.0' in metrics
    assert 'model="fake"' in metrics
    # The pool's sizes are exported from start-up, before any request.
    blocks = idle["kvserve_kv_cache_capacity_blocks"]
    assert idle["kvserve_kv_cache_block_size_bytes"] > 0 and blocks > 0
    assert (
        idle["kvserve_kv_cache_memory_bytes"] == blocks * idle["kvserve_kv_cache_block_size_bytes"]
    )


def test_engine_death_exits_nonzero(tmp_path: Path) -> None:
    """A dead device with --max-step-failures 1: the first call gets INTERNAL (a failed
    step is survived), the next UNAVAILABLE (two in a row: the engine dies), serve exits 1."""
    import grpc

    flags = ("--fake-crash-at-step", "3", "--max-step-failures", "1")
    with serve_process(tmp_path, *flags) as (proc, port):

        async def scenario() -> list[grpc.StatusCode]:
            codes = []
            async with KVServeClient(f"127.0.0.1:{port}") as client:
                for i in range(3):
                    try:
                        await collect(client.generate("x", request_id=f"r{i}", max_tokens=50))
                        codes.append(grpc.StatusCode.OK)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())
            return codes

        codes = asyncio.run(scenario())
        assert proc.wait(timeout=60) == 1
        out = _output(proc)
    assert codes == [
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNAVAILABLE,
    ]
    assert "runner died" in out and "2 steps in a row failed" in out
    assert "fake runner died at step 3" in out


def test_bad_serve_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """A bad setting is reported with its name and exit status 2, before loading anything."""
    assert cli.main(["serve", "--runner", "fake", "--kv-memory", "lots"]) == 2
    assert "not a memory size" in capsys.readouterr().err


def test_missing_checkpoint_exits_1_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """serve with a model path that does not exist says so and exits 1 (no traceback)."""
    missing = "/nonexistent/model.gguf"
    assert cli.main(["serve", "--model", missing, "--metrics-port", "0", "--port", "0"]) == 1
    err = capsys.readouterr().err
    assert "cannot start" in err and missing in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("command", "module"), [("simulate", "loadtest.simulate"), ("loadtest", "loadtest.cli")]
)
def test_dispatch_subcommands_to_their_packages(
    command: str, module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """simulate / loadtest hand their arguments to the owning module's main()."""
    if importlib.util.find_spec(module) is None:
        assert cli.main([command, "--help"]) == 2
        assert f"{module} is not installed" in capsys.readouterr().err
        return
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def _gone(pid: int) -> bool:
    """The process exited (a zombie nobody reaped yet counts: it runs nothing, holds no port)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "\nState:\tZ" in status


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_parent_death_stops_serve_started_with_exit_with_parent(tmp_path: Path) -> None:
    """serve --exit-with-parent, started by a wrapper process that is then SIGKILLed, exits
    on its own within 30 s and its port closes; without the flag it keeps serving."""

    def start(name: str, *flags: str) -> tuple[subprocess.Popen[str], int, int]:
        port_file = tmp_path / f"{name}.port"
        server = [
            sys.executable, "-m", "server.cli", "serve", "--runner", "fake", "--port", "0",
            "--port-file", str(port_file), "--no-metrics", "--no-http", "--grace-period-s",
            "1", *flags,
        ]  # fmt: skip
        wrapper = (
            "import subprocess, sys, time\n"
            f"log = open({str(tmp_path / name)!r} + '.log', 'w')\n"
            f"p = subprocess.Popen({server!r}, stdout=log, stderr=log)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSERVE_")}
        env["PYTHONPATH"] = str(REPO_ROOT)
        proc = subprocess.Popen(
            [sys.executable, "-c", wrapper], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert not _gone(child), (tmp_path / f"{name}.log").read_text()
            assert time.monotonic() < deadline, "serve did not write its port file in 60 s"
            time.sleep(0.05)
        return proc, child, int(port_file.read_text())

    watched = start("watched", "--exit-with-parent")
    unwatched = start("unwatched")
    try:
        for wrapper, _, _ in (watched, unwatched):
            wrapper.kill()
            wrapper.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(watched[1]):
            assert time.monotonic() < deadline, "serve outlived its parent by 30 s"
            time.sleep(0.05)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", watched[2]), timeout=5).close()
        socket.create_connection(("127.0.0.1", unwatched[2]), timeout=5).close()
        assert not _gone(unwatched[1])
    finally:
        for _, child, _ in (watched, unwatched):
            if not _gone(child):
                os.kill(child, signal.SIGKILL)
    log = (tmp_path / "watched.log").read_text()
    assert "exited: draining in-flight requests" in log and "stopped" in log


def test_engine_death_exit_is_bounded_by_exit_within() -> None:
    """exit_within ends a process that a non-daemon thread would keep alive for 10 min,
    with the given status, long before that."""
    script = (
        "import threading, time\n"
        "from server.cli import exit_within\n"
        "threading.Thread(target=time.sleep, args=(600,)).start()\n"
        "exit_within(0.2, 3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 3
    assert "forcing exit 3 after 0.2s" in proc.stderr
