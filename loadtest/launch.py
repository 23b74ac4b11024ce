"""Start a ``kvserve serve`` subprocess on loopback and stop it again (tests and benchmarks).

    with ServerProcess(["--runner", "fake"]) as server:
        print(server.target, server.metrics_url)

Both ports are 0: the server picks them and writes them to ``--port-file`` and
``--metrics-port-file``. Output goes to a log file, shown in the error when the server does
not come up.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

REPO_ROOT = Path(__file__).resolve().parents[1]


class ChildServer:
    """A server child process with a private temporary folder and a log file (in it unless
    ``log_path`` says where: a log there outlives the folder); as a context manager
    ``start()`` on entry, ``stop()`` and the folder's removal on exit. Subclasses set
    ``proc`` in ``start()``."""

    def __init__(self, prefix: str, log_path: Path | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.log_path = log_path if log_path is not None else Path(self._tmp.name) / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Self:
        raise NotImplementedError

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL after ``timeout_s``; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        self._tmp.cleanup()


class ServerProcess(ChildServer):
    """A ``python -m server.cli serve`` child bound to 127.0.0.1; a context manager."""

    def __init__(
        self,
        serve_args: Sequence[str],
        *,
        metrics: bool = True,
        startup_timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.serve_args = list(serve_args)
        self.metrics = metrics
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        super().__init__("kvserve-server-", log_path)
        self.port_file = Path(self._tmp.name) / "port"
        self.metrics_port_file = Path(self._tmp.name) / "metrics-port"
        self.http_port_file = Path(self._tmp.name) / "http-port"
        self.port = 0
        self.metrics_port = 0
        self.http_port = 0  # the OpenAI-compatible front, on a free port of its own

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str | None:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else None

    def start(self) -> Self:
        metrics_args = (
            ["--metrics-port", "0", "--metrics-port-file", str(self.metrics_port_file)]
            if self.metrics
            else ["--no-metrics"]
        )
        cmd = [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--port-file",
            str(self.port_file),
            "--metrics-host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--http-port-file",
            str(self.http_port_file),
            *metrics_args,
            *self.serve_args,
        ]
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while (
            not self.port_file.exists()
            or not self.http_port_file.exists()
            or (self.metrics and not self.metrics_port_file.exists())
        ):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(
                    f"kvserve serve exited with {code} before serving:\n{self.log()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"kvserve serve did not write {self.port_file} within "
                    f"{self.startup_timeout_s:g}s:\n{self.log()}"
                )
            time.sleep(0.05)
        self.port = int(self.port_file.read_text().strip())
        self.http_port = int(self.http_port_file.read_text().strip())
        if self.metrics:
            self.metrics_port = int(self.metrics_port_file.read_text().strip())
        return self


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), printed beside every benchmark figure."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
