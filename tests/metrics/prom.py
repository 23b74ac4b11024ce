"""A real Prometheus on 127.0.0.1 for tests: temporary config + storage, HTTP API queries."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.metrics.helpers import free_port, require_binary


class PrometheusProcess:
    """``prometheus`` scraping ``targets`` every ``scrape_interval_s``; stop() kills it."""

    def __init__(self, workdir: Path, targets: list[str], scrape_interval_s: float = 1.0) -> None:
        self.binary = require_binary("prometheus")
        self.workdir = workdir
        self.targets = targets
        self.scrape_interval_s = scrape_interval_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = workdir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> None:
        interval = f"{int(self.scrape_interval_s * 1000)}ms"
        config = self.workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {interval}\n"
            f"  scrape_timeout: {interval}\n"
            f"  evaluation_interval: {interval}\n"
            "scrape_configs:\n"
            "  - job_name: kvserve\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(self.targets)}\n",
            encoding="utf-8",
        )
        # Prometheus cannot bind port 0 and report it: take a free port, retry on a race.
        for _attempt in range(3):
            self.port = free_port()
            log = self.log_path.open("ab")
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1h",
                    "--web.enable-admin-api",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
            )
            log.close()
            if self._wait_ready(timeout_s):
                return
            self.stop()
        raise AssertionError(f"prometheus did not become ready; log:\n{self.log_tail()}")

    def _wait_ready(self, timeout_s: float) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError:
            return "(no log)"

    def api(self, path: str, params: dict[str, str]) -> Any:
        """GET /api/v1/<path>; returns ``data``; fails with Prometheus's error message."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector (a scalar is returned as one unlabeled sample)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", f"{expr}: result type {data['resultType']}"
        return list(data["result"])

    def targets_health(self) -> list[dict[str, Any]]:
        return list(self.api("targets", {"state": "active"})["activeTargets"])
