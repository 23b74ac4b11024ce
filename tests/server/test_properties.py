"""Property tests at both edges, on one live server (FakeRunner): any JSON value as the body
of each HTTP endpoint, and any GenerateRequest built from random fields on gRPC, gets a 4xx /
INVALID_ARGUMENT or a valid answer. Never a 5xx, never an error logged, never a block left
held (the cache manager's invariants are checked after every example)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from server.openai.anthropic import COUNT_FIELDS, MESSAGES_FIELDS
from server.openai.fields import CHAT_FIELDS, COMPLETION_FIELDS
from server.openai.responses import RESPONSES_FIELDS
from server.openai.tokenize import DETOKENIZE_FIELDS, TOKENIZE_FIELDS
from server.rpc import generation_pb2 as pb
from server.rpc import generation_pb2_grpc
from server.validation import CHAT_ROLES
from tests.server.helpers import Harness, assert_idle_and_sound, serve_in_thread

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples in every run: CI never flakes on a new one
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.fixture(scope="module")
def server() -> Iterator[Harness]:
    with serve_in_thread(http=True) as h:
        yield h


# ---------------------------------------------------------------------- HTTP
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 40)
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _valid(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that fit a field's JSON Schema (the subset the field tables use), small ones
    most of the time so that a request can also be served."""
    if "anyOf" in schema:
        return st.one_of([_valid(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([_valid({"type": k}) for k in kind])
    if kind == "integer":
        low, high = schema["minimum"], schema["maximum"]
        return st.integers(max(low, -2), min(high, 40)) | st.integers(low, high)
    if kind == "number":
        return st.floats(-2.5, 2.5)
    if kind == "array":
        return st.lists(
            _valid(schema["items"]),
            min_size=schema.get("minItems", 0),
            max_size=schema.get("maxItems", 3),
        )
    if kind == "object":
        properties = {k: _valid(v) for k, v in schema.get("properties", {}).items()}
        required = schema.get("required", [])
        return st.fixed_dictionaries(
            {k: v for k, v in properties.items() if k in required},
            optional={k: v for k, v in properties.items() if k not in required},
        )
    return {"boolean": st.booleans(), "string": st.text(max_size=12), "null": st.none()}[kind]


def _bodies(fields: dict[str, Any], required: str, typed: bool) -> Any:
    """Objects with this endpoint's fields: each of a value that fits its schema (``typed``,
    so that many are served) or of any JSON value, now and then with an unknown field."""
    values = {k: _valid(v) if typed else ANY_JSON for k, v in fields.items()}
    if not typed:
        values[required] = _valid(fields[required]) | ANY_JSON
    return st.fixed_dictionaries(
        {required: values.pop(required)} if typed else {},
        optional={**values, "unknown": ANY_JSON},
    )


NEW_ROUTES = ["/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/tokenize",
              "/detokenize"]  # fmt: skip
ENDPOINT_BODIES = st.one_of(
    *(
        st.tuples(st.just(path), _bodies(fields, required, typed))
        for path, fields, required in (
            ("/v1/completions", COMPLETION_FIELDS, "prompt"),
            ("/v1/chat/completions", CHAT_FIELDS, "messages"),
            ("/v1/responses", RESPONSES_FIELDS, "input"),
            ("/v1/messages", MESSAGES_FIELDS, "messages"),
            ("/v1/messages/count_tokens", COUNT_FIELDS, "messages"),
            ("/tokenize", TOKENIZE_FIELDS, "prompt"),
            ("/detokenize", DETOKENIZE_FIELDS, "tokens"),
        )
        for typed in (True, False)
    ),
    st.tuples(
        st.sampled_from(
            ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", *NEW_ROUTES]
        ),
        ANY_JSON,
    ),
)


def _check_answer(path: str, response: httpx.Response, body: Any) -> None:
    status = response.status_code
    event(f"HTTP {status}")
    assert status < 500, (status, response.text, body)
    if status >= 400:
        error = response.json()["error"]
        if path.startswith("/v1/messages"):  # Anthropic's shape
            assert set(error) == {"type", "message"} and response.json()["type"] == "error"
        else:
            assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        return
    assert status == 200, (status, body)
    if path in NEW_ROUTES:
        _check_new_answer(path, response)
    elif path in ("/v1/models", "/health"):
        assert response.json()
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.split("\n") if line]
        assert events[-1] == "data: [DONE]"
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    else:
        answer = response.json()
        assert answer["choices"] and all(c["finish_reason"] for c in answer["choices"])
        assert answer["usage"]["completion_tokens"] >= len(answer["choices"])


def _check_new_answer(path: str, response: httpx.Response) -> None:
    """A served answer of the Responses, Messages or tokenize routes: whole, or a stream
    that ends with its API's last event and holds no error event."""
    if response.headers["content-type"].startswith("text/event-stream"):
        names = [line[7:] for line in response.text.split("\n") if line.startswith("event: ")]
        assert "error" not in names, response.text
        last = {"/v1/responses": ("response.completed", "response.incomplete"),
                "/v1/messages": ("message_stop",)}[path]  # fmt: skip
        assert names[-1] in last, names
        return
    answer = response.json()
    keys = {"/v1/responses": "output", "/v1/messages": "stop_reason", "/tokenize": "tokens",
            "/v1/messages/count_tokens": "input_tokens", "/detokenize": "prompt"}  # fmt: skip
    assert answer[keys[path]] is not None, answer


@SETTINGS
@given(case=ENDPOINT_BODIES)
def test_any_json_body_gets_a_4xx_or_an_answer(
    server: Harness, case: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Any JSON value (or an object of the endpoint's fields holding any values) as the body
    of each endpoint: a 4xx in OpenAI's error shape or a complete answer."""
    path, body = case
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        method = "GET" if path in ("/v1/models", "/health") else "POST"
        response = httpx.request(
            method,
            server.http_url + path,
            content=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        _check_answer(path, response, body)
        assert_idle_and_sound(server)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []


# ---------------------------------------------------------------------- gRPC
def _mostly(small: st.SearchStrategy[Any], anything: st.SearchStrategy[Any]) -> Any:
    """``small`` seven times in eight: values a request can be served with, mostly."""
    # (hypothesis favours the bounds of a range: the middle value is the rare one)
    return st.integers(0, 7).flatmap(lambda i: anything if i == 3 else small)


INT32 = _mostly(st.integers(0, 20), st.integers(-(2**31), 2**31 - 1))
UINT32 = _mostly(st.integers(0, 20), st.integers(0, 2**32 - 1))
UINT64 = st.integers(0, 2**64 - 1)
FLOAT32 = _mostly(st.floats(0.125, 1, width=32), st.floats(width=32))
DOUBLE = _mostly(st.floats(1, 1e6), st.floats())
TEXT = st.text(max_size=24)


def _maybe(draw: Any, strategy: st.SearchStrategy[Any]) -> Any:
    """A value one time in three, else None (the field stays unset)."""
    return draw(strategy) if draw(st.integers(0, 2)) == 1 else None


@st.composite
def generate_requests(draw: Any) -> pb.GenerateRequest:
    """A GenerateRequest with every field random (in its proto type), or unset."""
    r = pb.GenerateRequest()
    kind = draw(st.sampled_from(["text", "text", "token_ids", "chat", None]))
    if kind == "text":
        r.text = draw(TEXT)
    elif kind == "token_ids":
        r.token_ids.ids.extend(draw(st.lists(_mostly(st.integers(0, 257), UINT32), max_size=8)))
    elif kind == "chat":
        for _ in range(draw(st.integers(0, 3))):
            role = draw(_mostly(st.sampled_from(CHAT_ROLES), st.sampled_from(["", "bot"])))
            r.chat.messages.add(role=role, content=draw(TEXT))
        if (gen := _maybe(draw, st.booleans())) is not None:
            r.chat.add_generation_prompt = gen
    s = r.sampling
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):  # fmt: skip
        if (value := _maybe(draw, FLOAT32)) is not None:
            setattr(s, name, value)
    for name, ints in (("top_k", INT32), ("seed", UINT64), ("logprobs", INT32)):
        if (value := _maybe(draw, ints)) is not None:
            setattr(s, name, value)
    t = r.stopping
    for name, low, high in (("max_tokens", 1, 20), ("min_tokens", 0, 2)):
        if (value := _maybe(draw, _mostly(st.integers(low, high), INT32))) is not None:
            setattr(t, name, value)
    t.stop.extend(draw(_mostly(st.lists(st.text(max_size=6), max_size=3), st.lists(TEXT))))
    t.stop_token_ids.extend(draw(st.lists(_mostly(st.integers(0, 257), UINT32), max_size=4)))
    t.ignore_eos = draw(st.booleans())
    r.request_id = draw(_mostly(st.text(max_size=8), st.text(min_size=250, max_size=300)))
    r.priority = draw(INT32)
    r.cache_salt = draw(_mostly(st.text(max_size=8), st.text(min_size=250, max_size=300)))
    if (n := _maybe(draw, _mostly(st.integers(1, 4), UINT32))) is not None:
        r.n = n
    for name in ("ttft_ms", "itl_ms"):
        if (value := _maybe(draw, DOUBLE)) is not None:
            setattr(r.slo, name, value)
    return r


@pytest.fixture(scope="module")
def stub(server: Harness) -> Iterator[generation_pb2_grpc.GenerationStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@SETTINGS
@given(request=generate_requests())
def test_any_generate_request_is_invalid_argument_or_served(
    server: Harness,
    stub: generation_pb2_grpc.GenerationStub,
    request: pb.GenerateRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Any GenerateRequest: INVALID_ARGUMENT with a message, or a stream in which every one
    of the n samples finishes (stop or length)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        try:
            responses = list(stub.Generate(request, timeout=30))
        except grpc.RpcError as exc:
            event(f"gRPC {exc.code().name}")
            assert exc.code() is grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
            assert exc.details()
        else:
            event("gRPC OK")
            finished = {m.index: m.finish_reason for m in responses if m.finished}
            assert set(finished) == set(range(request.n if request.HasField("n") else 1))
            assert set(finished.values()) <= {pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH}
        assert_idle_and_sound(server)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info] == []
