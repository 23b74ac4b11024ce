"""The small interface between the load generator and a server's API.

The generator (``loadtest.generator``) owns the loops, the clock and every ``RequestResult``; a
backend only speaks the wire protocol. Two implement it:

- ``loadtest.grpc_backend.GrpcBackend``: kvserve's ``kvserve.v1.Generation`` service (default);
- ``loadtest.openai_backend.OpenAIBackend``: ``POST /v1/completions`` with ``stream: true`` on
  any OpenAI-compatible HTTP server (kvserve's peers: llama.cpp's ``llama-server``, vLLM, ...).

A request's stream is an async generator of ``StreamEvent``s. The generator stops iterating it
when the request finishes, when the workload cancels the request, or when the run's time bound
cancels the task; it always closes the stream (``contextlib.aclosing``), and a backend's
generator must then close the call or connection, so the server stops the request at once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from loadtest.server_stats import Samples
    from loadtest.workload import RequestSpec


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One message of a response stream, reduced to what the load generator records.

    ``finish_reason`` is set on the last event only (the stream finished); ``failed`` says that
    this finish is a failure the server reported in-stream (the finish reason names it).
    Usage counts are None when the server did not report them.
    """

    num_tokens: int = 0  # output tokens this message carried
    finish_reason: str | None = None
    failed: bool = False
    num_prompt_tokens: int | None = None
    num_cached_tokens: int | None = None


class RequestFailed(Exception):
    """The server refused or broke off one request; ``code`` says how, as the report counts it.

    gRPC: the status code name (``RESOURCE_EXHAUSTED``). OpenAI HTTP: ``HTTP_<status>``, an
    ``error`` object in the stream (``SERVER_ERROR``), ``DEADLINE_EXCEEDED`` or ``UNAVAILABLE``.
    """

    def __init__(self, code: str, error: str = "") -> None:
        super().__init__(f"{code}: {error}" if error else code)
        self.code = code
        self.error = error


class Backend(Protocol):
    """One server API, as the load generator drives it (``open`` first, ``close`` last)."""

    api: str  # "grpc" | "openai": also the report's ``server.source`` without a metrics URL
    target: str

    async def open(self, wait_s: float) -> None:
        """Connect and wait until the server serves; ``ConnectionError`` after ``wait_s``
        (gRPC: ``server.client.NoServerError``, which says how to start one)."""
        ...

    async def close(self) -> None: ...

    async def vocab_size(self) -> int | None:
        """The model's vocabulary size (random prompts draw from it); None when unknown."""
        ...

    def generate(
        self,
        spec: RequestSpec,
        request_id: str,
        timeout_s: float | None,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[StreamEvent, None]:
        """Send ``spec`` (with ``cache_salt`` where the API has one) and yield its stream's
        events; raises ``RequestFailed``.

        Closing the iterator early (``aclose``) stops the request on the server.
        """
        ...

    async def read_server(self) -> Samples | None:
        """The server's own counters through its API (no metrics URL); None if it has none."""
        ...
