"""``kvserve loadtest --api openai`` against a fake OpenAI-compatible SSE server on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from loadtest.cli import main
from loadtest.openai_backend import base_url, completion_body
from loadtest.workload import RequestSpec, Workload
from tests.loadtest.test_live import SUMMARY_KEYS, TOP_LEVEL_KEYS

VOCAB_SIZE = 1000
CACHED_TOKENS = 3  # every usage object reports this many cached prompt tokens

WORKLOAD = {
    "name": "openai-live",
    "seed": 7,
    "num_requests": 24,
    "prompt": {"source": "random", "len": 16},
    "output": {"len": {"type": "uniform", "min": 4, "max": 12}, "ignore_eos": True},
    "sampling": {"temperature": 0.0, "top_k": 5},
    "cancel": {"fraction": 0.25, "after_tokens": 2},
}


class FakeOpenAIServer(ThreadingHTTPServer):
    """Streams ``max_tokens`` one-token chunks (`` t0``, `` t1``, ...), then a finish chunk, a
    usage chunk and ``[DONE]``, like llama.cpp's server. Prompt tokens: the ids sent, or the
    words of a text prompt. ``merge_at = i`` sends tokens i and i+1 in one chunk (a held-back
    token); ``fail_status`` answers every completion with that HTTP status."""

    daemon_threads = True
    block_on_close = False

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.merge_at: int | None = None
        self.fail_status: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeOpenAIServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send_json(self, status: int, doc: Any) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _event(self, doc: Any) -> None:
        self._chunk(f"data: {json.dumps(doc)}\n\n".encode())

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            self._send_json(404, {"error": {"message": "not found"}})
            return
        self._send_json(
            200, {"object": "list", "data": [{"id": "fake-model", "meta": {"n_vocab": VOCAB_SIZE}}]}
        )

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.bodies.append(body)
        if self.path != "/v1/completions" or self.server.fail_status is not None:
            self._send_json(self.server.fail_status or 404, {"error": {"message": "busy"}})
            return
        prompt = body["prompt"]
        num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        num_out = body["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            i = 0
            while i < num_out:
                k = 2 if self.server.merge_at == i and i + 1 < num_out else 1
                text = "".join(f" t{j}" for j in range(i, i + k))
                self._event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})
                i += k
                time.sleep(0.001)
            self._event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            usage = {
                "prompt_tokens": num_prompt,
                "completion_tokens": num_out,
                "total_tokens": num_prompt + num_out,
                "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
            }
            self._event({"choices": [], "usage": usage})
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client closed the stream: a cancel


@pytest.fixture
def fake() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def _run(fake: FakeOpenAIServer, tmp_path: Path, spec: dict[str, Any], *extra: str) -> Any:
    wl_path = tmp_path / "workload.json"
    wl_path.write_text(json.dumps(spec))
    out = tmp_path / "report.json"
    argv = ["--api", "openai", "--target", fake.url, "--workload", str(wl_path),
            "--out", str(out), "--no-progress", *extra]  # fmt: skip
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_report_counts_tokens_and_sends_token_id_prompts(
    fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    """4 users, 24 requests (6 cancelled after 2 tokens): exact counts, keys and request bodies."""
    report = _run(fake, tmp_path, WORKLOAD, "--users", "4", "--slo-ttft-ms", "60000")
    specs = Workload.from_dict(WORKLOAD).build(vocab_size=VOCAB_SIZE)
    ok = [s for s in specs if s.cancel_after_tokens is None]
    assert len(ok) == 18

    assert set(report) == TOP_LEVEL_KEYS
    assert report["load"]["api"] == "openai" and report["load"]["target"] == fake.url
    assert report["requests"] == {
        "planned": 24,
        "sent": 24,
        "ok": 18,
        "cancelled": 6,
        "failed": 0,
        "interrupted": 0,
        "not_sent": 0,
        "by_code": {"CANCELLED": 6, "OK": 18},
    }
    assert report["input_tokens_total"] == 24 * 16
    assert report["output_tokens_total"] == sum(s.max_tokens for s in ok) + 2 * 6
    assert report["cached_prompt_tokens_total"] == 18 * CACHED_TOKENS
    lat = report["latency_s"]
    assert all(set(v) == SUMMARY_KEYS for v in lat.values())
    assert lat["ttft"]["count"] == lat["tpot"]["count"] == lat["e2e"]["count"] == 18
    assert lat["itl"]["count"] == sum(s.max_tokens - 1 for s in ok)
    assert report["goodput"]["num_ok_within_slo"] == 18
    assert report["goodput"]["slo_ttft_s"] == 60.0
    assert report["server"] is None
    assert report["output_token_throughput_tps"] == pytest.approx(
        report["output_tokens_total"] / report["duration_s"]
    )

    by_prompt = {tuple(b["prompt"]): b for b in fake.bodies}
    assert len(fake.bodies) == 24
    for s in specs:
        body = by_prompt[s.prompt_token_ids]
        assert body == {
            "model": "fake-model",
            "prompt": list(s.prompt_token_ids or ()),
            "max_tokens": s.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "temperature": 0.0,
            "top_k": 5,
        }
        assert all(VOCAB_SIZE // 8 <= t < 7 * VOCAB_SIZE // 8 for t in body["prompt"])


def test_text_prompts_are_sent_as_text_and_usage_gives_prompt_tokens(
    fake: FakeOpenAIServer, tmp_path: Path
) -> None:
    """A file workload sends its texts; the server's usage counts the prompt tokens."""
    (tmp_path / "prompts.json").write_text(json.dumps({"prompts": ["a b c", "d e f g h"]}))
    spec = {
        "name": "texts",
        "num_requests": 4,
        "prompt": {"source": "file", "path": "prompts.json"},
        "output": {"len": 5, "ignore_eos": False},
        "sampling": {"temperature": 0.5, "seed": 3},
    }
    report = _run(fake, tmp_path, spec, "--users", "2")
    assert report["requests"]["ok"] == 4
    assert report["input_tokens_total"] == 3 + 5 + 3 + 5
    assert report["output_tokens_total"] == 4 * 5
    assert sorted(b["prompt"] for b in fake.bodies) == ["a b c"] * 2 + ["d e f g h"] * 2
    assert all("ignore_eos" not in b and b["seed"] == 3 for b in fake.bodies)


def test_a_held_back_token_is_counted_from_usage(fake: FakeOpenAIServer, tmp_path: Path) -> None:
    """Tokens 2 and 3 in one chunk: totals still follow usage.completion_tokens exactly."""
    fake.merge_at = 2
    spec = {**WORKLOAD, "num_requests": 3, "output": {"len": 8}, "cancel": {"fraction": 0}}
    report = _run(fake, tmp_path, spec)
    assert report["requests"]["by_code"] == {"OK": 3}
    assert report["output_tokens_total"] == 3 * 8
    assert report["latency_s"]["itl"]["count"] == 3 * 7


def test_http_errors_are_failed_requests(fake: FakeOpenAIServer, tmp_path: Path) -> None:
    """Every completion answered 503: each request fails with code HTTP_503, none times out."""
    fake.fail_status = 503
    spec = {**WORKLOAD, "num_requests": 5, "cancel": {"fraction": 0}}
    report = _run(fake, tmp_path, spec, "--users", "2")
    assert report["requests"]["failed"] == 5
    assert report["requests"]["by_code"] == {"HTTP_503": 5}
    assert report["output_tokens_total"] == 0


def test_openai_needs_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    """--api openai without --target exits 2 with a message naming the flag."""
    assert main(["--api", "openai", "--no-progress"]) == 2
    assert "--target http://HOST:PORT" in capsys.readouterr().err


def test_base_url_and_body_helpers() -> None:
    """host:port gains http://, a trailing /v1 is dropped; no model, no ignore_eos unless set."""
    assert base_url("127.0.0.1:8080") == "http://127.0.0.1:8080"
    assert base_url("http://h:1/v1/") == "http://h:1"
    spec = RequestSpec(
        index=0,
        prompt_text="hi",
        prompt_token_ids=None,
        max_tokens=3,
        ignore_eos=False,
        sampling={"temperature": 0.0, "repetition_penalty": 1.1},
    )
    assert completion_body(spec, None) == {
        "prompt": "hi",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0.0,
        "repetition_penalty": 1.1,
    }
