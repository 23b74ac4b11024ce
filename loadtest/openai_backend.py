"""The load generator's OpenAI-HTTP backend: streaming ``POST /v1/completions`` (httpx).

One tool then drives kvserve and any OpenAI-compatible server (llama.cpp's ``llama-server``,
vLLM, ...) with the same workloads and the same report.

A request is::

    POST {target}/v1/completions
    {"model": <id from GET /v1/models, if any>, "prompt": <token ids, or the text>,
     "max_tokens": N, "stream": true, "stream_options": {"include_usage": true},
     "ignore_eos": true, "temperature": ..., "top_p": ..., ...}

Token-id prompts are sent as a list of ints (the completions API takes them, so the server
sees exactly the workload's prompt length); text prompts as text. ``ignore_eos``, ``top_k``,
``min_p`` and ``repetition_penalty`` are extensions that llama.cpp and vLLM read (OpenAI's own
API ignores them); the others are OpenAI's.

The reply is server-sent events: ``data: {json}`` lines, then ``data: [DONE]``.
Token accounting (one chunk carries one token on llama.cpp and vLLM):

- a chunk whose choice has non-empty ``text`` is one token arriving at that moment;
- the chunk with a non-null ``finish_reason`` ends the request (``stop`` or ``length``); a
  final ``usage`` object (``include_usage``, or llama.cpp's own) gives the prompt tokens,
  the cached prompt tokens and ``completion_tokens``;
- when ``completion_tokens`` exceeds the chunks counted (a server that held back a token, say
  an incomplete UTF-8 sequence, and sent it with the next), the difference arrives with the
  finishing event, so output token totals are the server's exact count.

Failures: an HTTP status >= 400 is ``HTTP_<status>``; an ``error`` object in the stream is
``SERVER_ERROR``; a read timeout or the request's deadline passing is ``DEADLINE_EXCEEDED``;
a refused or broken connection is ``UNAVAILABLE``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import httpx

from loadtest import server_stats
from loadtest.backend import RequestFailed, StreamEvent
from loadtest.workload import RequestSpec

# Workload sampling keys sent as they are (OpenAI's names, plus the common extensions).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def base_url(target: str) -> str:
    """``http://host:port`` from ``host:port`` or a URL (a trailing ``/`` or ``/v1`` dropped)."""
    url = target.strip()
    if "://" not in url:
        url = f"http://{url}"
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def completion_body(spec: RequestSpec, model: str | None) -> dict[str, Any]:
    """The JSON body of ``spec``'s streaming completion request."""
    prompt: list[int] | str
    if spec.prompt_token_ids is not None:
        prompt = list(spec.prompt_token_ids)
    else:
        assert spec.prompt_text is not None
        prompt = spec.prompt_text
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    if spec.adapter is not None:  # a LoRA adapter is named as the model (vLLM, kvserve)
        body["model"] = spec.adapter
    if spec.ignore_eos:
        body["ignore_eos"] = True
    body.update({k: spec.sampling[k] for k in SAMPLING_FIELDS if k in spec.sampling})
    for kind, value in (spec.constraint or {}).items():  # vLLM's structured_outputs names
        body["structured_outputs"] = {"json" if kind == "json_schema" else kind: value}
    return body


class OpenAIBackend:
    """Streaming completions over one ``httpx.AsyncClient`` (no connection limit)."""

    api = "openai"

    def __init__(self, target: str) -> None:
        self.target = base_url(target)
        self._client: httpx.AsyncClient | None = None
        self._model: str | None = None
        self._vocab_size: int | None = None

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "open() first"
        return self._client

    async def open(self, wait_s: float) -> None:
        """Polls ``GET /v1/models`` until it answers 200 (llama.cpp answers 503 while loading)."""
        self._client = httpx.AsyncClient(
            base_url=self.target,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )
        deadline = time.monotonic() + wait_s
        last = "no answer"
        while True:
            try:
                reply = await self.client.get("/v1/models", timeout=5.0)
                if reply.status_code == 200:
                    self._read_models(reply.json())
                    return
                last = f"HTTP {reply.status_code}"
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                await self.close()
                raise ConnectionError(
                    f"no OpenAI-compatible server answered GET {self.target}/v1/models "
                    f"within {wait_s:g}s ({last})"
                )
            await asyncio.sleep(0.2)

    def _read_models(self, doc: Any) -> None:
        """The first model's id (sent as ``model``) and, where given, its vocabulary size."""
        data = doc.get("data") if isinstance(doc, Mapping) else None
        if not data or not isinstance(data[0], Mapping):
            return
        first = data[0]
        self._model = str(first["id"]) if "id" in first else None
        meta = first.get("meta")
        if isinstance(meta, Mapping) and isinstance(meta.get("n_vocab"), int):
            self._vocab_size = int(meta["n_vocab"])  # llama.cpp's extension

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def vocab_size(self) -> int | None:
        return self._vocab_size

    async def generate(
        self,
        spec: RequestSpec,
        request_id: str,
        timeout_s: float | None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """``cache_salt`` is not sent: the OpenAI API has no such field (vLLM's extension is
        not one llama.cpp knows), so runs against these servers may share prefix caches."""
        body = completion_body(spec, self._model)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        headers = {"X-Request-Id": request_id}
        num_tokens = 0
        finish_reason: str | None = None
        usage: Mapping[str, Any] | None = None
        try:
            async with self.client.stream(
                "POST",
                "/v1/completions",
                json=body,
                headers=headers,
                timeout=httpx.Timeout(timeout_s, connect=10.0),
            ) as reply:
                if reply.status_code >= 400:
                    text = (await reply.aread()).decode("utf-8", errors="replace")
                    raise RequestFailed(f"HTTP_{reply.status_code}", text[:500])
                async for line in reply.aiter_lines():
                    if deadline is not None and time.monotonic() > deadline:
                        raise RequestFailed("DEADLINE_EXCEEDED", f"after {timeout_s:g}s")
                    payload = _sse_data(line)
                    if payload is None:
                        continue
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        raise RequestFailed("SERVER_ERROR", json.dumps(chunk["error"])[:500])
                    if isinstance(chunk.get("usage"), Mapping):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        if choice.get("text"):
                            num_tokens += 1
                            yield StreamEvent(num_tokens=1)
                        if choice.get("finish_reason") is not None:
                            finish_reason = str(choice["finish_reason"])
        except httpx.TimeoutException as e:
            raise RequestFailed("DEADLINE_EXCEEDED", f"{type(e).__name__}: {e}") from None
        except httpx.HTTPError as e:
            raise RequestFailed("UNAVAILABLE", f"{type(e).__name__}: {e}") from None
        except json.JSONDecodeError as e:
            raise RequestFailed("BAD_STREAM", f"not JSON: {e}") from None
        if finish_reason is None:
            return  # the stream ended without a finish: the generator counts it incomplete
        completion_tokens = _int_or_none(usage, "completion_tokens")
        yield StreamEvent(
            num_tokens=max(0, (completion_tokens or 0) - num_tokens),
            finish_reason=finish_reason,
            num_prompt_tokens=_int_or_none(usage, "prompt_tokens"),
            num_cached_tokens=_cached_tokens(usage),
        )

    async def read_server(self) -> server_stats.Samples | None:
        return None  # no standard stats endpoint: pass --metrics-url for Prometheus counters


def _sse_data(line: str) -> str | None:
    """The payload of an SSE ``data:`` line; None for comments, blank and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:") :].strip()


def _int_or_none(obj: Mapping[str, Any] | None, key: str) -> int | None:
    value = None if obj is None else obj.get(key)
    return int(value) if isinstance(value, int) else None


def _cached_tokens(usage: Mapping[str, Any] | None) -> int | None:
    details = None if usage is None else usage.get("prompt_tokens_details")
    return _int_or_none(details, "cached_tokens") if isinstance(details, Mapping) else None
