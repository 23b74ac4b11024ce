"""The front-end core without a server: which status each failure gets."""

from __future__ import annotations

import grpc
import pytest

from scheduler.errors import OverloadError
from server.auth import AuthError
from server.engine import EngineDeadError, StalledStreamError
from server.engine_client import DeadlineExceededError, DuplicateRequestError
from server.frontend import RpcError, status_of
from server.validation import InvalidRequestError

CODE = grpc.StatusCode


@pytest.mark.parametrize(
    ("exc", "code", "details"),
    [
        (RpcError(CODE.UNAVAILABLE, "server is shutting down"), CODE.UNAVAILABLE,
         "server is shutting down"),
        (AuthError("no API key"), CODE.UNAUTHENTICATED, "no API key"),
        (DuplicateRequestError("request_id 'x' is already in flight"), CODE.ALREADY_EXISTS,
         "request_id 'x' is already in flight"),
        (InvalidRequestError("top_p must be <= 1"), CODE.INVALID_ARGUMENT, "top_p must be <= 1"),
        (ValueError("prompt too long"), CODE.INVALID_ARGUMENT, "prompt too long"),
        (OverloadError("queue full"), CODE.RESOURCE_EXHAUSTED,
         "server overloaded, retry later: queue full"),
        (EngineDeadError("runner died"), CODE.UNAVAILABLE, "runner died"),
        (DeadlineExceededError("late"), CODE.DEADLINE_EXCEEDED, "late"),
        (StalledStreamError("not reading"), CODE.ABORTED, "not reading"),
        (KeyError("bug"), CODE.INTERNAL, "internal error: KeyError('bug')"),
    ],
)  # fmt: skip
def test_status_of_each_failure(exc: BaseException, code: grpc.StatusCode, details: str) -> None:
    """Every failure a front end can see maps to one gRPC code and message, in one place."""
    assert status_of(exc) == (code, details)
