"""The two targets of the edge table (test_edge_table.py): ``kvserve serve`` and a 2-replica
``kvserve cluster serve``, started with the same flags, each a subprocess leading its own
process group (SIGTERM to the group is how ``timeout`` and systemd stop a service)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc as pb_grpc
from tests.cluster.helpers import ROOT
from tests.metrics.helpers import free_port

ALICE, BOB, ADMIN = "key-alice", "key-bob", "key-admin"
TIMEOUT_S = 1.0  # header, body and idle timeouts of the HTTP port
HTTP_CAP = 24  # --http-max-connections
GRACE_S = 5.0  # --grace-period-s
MAX_REQUEST_BYTES = 65536
STEP_S = 0.02  # the fake runner's step
FLAGS = [
    "--runner", "fake", "--host", "127.0.0.1", "--fake-step-sleep-s", str(STEP_S),
    "--api-key", ALICE, "--api-key", BOB, "--admin-api-key", ADMIN,
    "--http-header-timeout-s", str(TIMEOUT_S), "--http-body-timeout-s", str(TIMEOUT_S),
    "--http-idle-timeout-s", str(TIMEOUT_S), "--http-max-connections", str(HTTP_CAP),
    "--grace-period-s", str(GRACE_S), "--max-request-bytes", str(MAX_REQUEST_BYTES),
    "--max-num-seqs", "2", "--max-waiting-requests-per-tenant", "4", "--log-level", "warning",
]  # fmt: skip


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def grpc_auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@dataclass(slots=True)
class Target:
    """A running server: its ports, its process and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    grpc_port: int
    http_port: int
    metrics_port: int
    log: Path

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics_addresses(self) -> list[str]:
        """Every /metrics address: the server's; the cluster's router and its replicas'."""
        own = f"127.0.0.1:{self.metrics_port}"
        if self.name == "single":
            return [own]
        reply = httpx.get(f"http://{own}/targets", headers=auth(ADMIN), timeout=10)
        reply.raise_for_status()
        return list(json.loads(reply.text)[0]["targets"])

    def log_bytes(self) -> int:
        return self.log.stat().st_size

    def stop(self) -> int:
        """SIGTERM to the process group; the exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()


def start_target(name: str, tmp: Path) -> Target:
    """``kvserve serve`` ("single") or ``kvserve cluster serve --replicas 2`` ("cluster")."""
    ports = {k: free_port() for k in ("grpc", "http", "metrics")}
    command = ["serve"] if name == "single" else ["cluster", "serve", "--replicas", "2",
                                                  "--replica-cpus", "0"]  # fmt: skip
    args = [
        sys.executable, "-m", "server.cli", *command, *FLAGS,
        "--port", str(ports["grpc"]), "--http-port", str(ports["http"]),
        "--metrics-port", str(ports["metrics"]), "--http-port-file", str(tmp / "http"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_AUTH_MODE": "disabled"}
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    target = Target(name, proc, ports["grpc"], ports["http"], ports["metrics"], log)
    try:
        _wait_ready(target, tmp / "http", timeout_s=300.0)
    except BaseException:
        target.stop()
        raise
    return target


def _wait_ready(target: Target, http_file: Path, timeout_s: float) -> None:
    """Until both fronts answer: the HTTP port file is written (after both are up), the
    OpenAI front lists the model and a gRPC call is served."""
    deadline = time.monotonic() + timeout_s

    def alive() -> None:
        if target.proc.poll() is not None:
            raise RuntimeError(f"{target.name} exited: {target.log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target.name} not ready: {target.log.read_text()[-3000:]}")

    while not http_file.exists():
        alive()
        time.sleep(0.2)
    while True:
        alive()
        try:
            reply = httpx.get(f"{target.http_url}/v1/models", headers=auth(ALICE), timeout=5)
            if reply.status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    with grpc.insecure_channel(target.grpc_address) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while True:
            alive()
            try:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5, metadata=grpc_auth(ALICE))
                return
            except grpc.RpcError:
                time.sleep(0.2)
