"""The HTTP front's OpenAPI document: served at /openapi.json, a valid OpenAPI 3.1 document,
in step with the parser (every field it takes, and only those), and a live server checked
against it by schemathesis (schema-valid and schema-invalid requests, bounded)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from server.openai.anthropic import parse_messages
from server.openai.fields import CHAT_FIELDS, COMPLETION_FIELDS, REQUIRED_FIELDS, HttpError
from server.openai.openapi import openapi_document, request_schema
from server.openai.parse import parse_body
from server.openai.responses import parse_responses
from server.openai.tokenize import parse_detokenize, parse_tokenize
from server.validation import InvalidRequestError
from tests.server.helpers import Harness, assert_idle_and_sound, serve_in_thread

MODEL = "fake"
# One value per schema type that fits it, for the field-by-field checks below.
_EXAMPLES = {"integer": 1, "number": 0.5, "boolean": True, "string": "s", "object": {}}


def _example(schema: dict[str, Any]) -> Any:
    if "anyOf" in schema:
        return _example(schema["anyOf"][0])
    if "enum" in schema:
        return schema["enum"][0]
    if schema["type"] == "array":
        return [_example(schema["items"])]
    return _EXAMPLES[schema["type"]]


@pytest.mark.parametrize("chat", [False, True])
def test_schema_and_parser_take_the_same_fields(chat: bool) -> None:
    """Each field of the schema, set to a value of its type, is taken by the parser (it may
    refuse the value's meaning, never the field); a field outside the schema is refused by
    name; the required field is required."""
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    schema = request_schema(chat)
    assert set(schema["properties"]) == set(fields)
    (required,) = schema["required"]
    assert (required,) == REQUIRED_FIELDS[chat]
    base = {required: _example(fields[required])}
    for name, field in fields.items():
        try:
            parse_body({**base, name: _example(field)}, chat, MODEL)
        except (InvalidRequestError, HttpError) as exc:
            assert "unsupported field" not in str(exc), (name, exc)
    with pytest.raises(HttpError, match=r"unsupported field\(s\) for /v1/\S+: logit_bias"):
        parse_body({**base, "logit_bias": {"1": 5}}, chat, MODEL)
    with pytest.raises(InvalidRequestError, match=rf"^{required}"):
        parse_body({}, chat, MODEL)


_NEW_APIS: list[tuple[str, Any, dict[str, Any]]] = [
    ("ResponseRequest", lambda b: parse_responses(b, MODEL), {"input": "x"}),
    ("MessageRequest", lambda b: parse_messages(b, MODEL), {"model": MODEL, "max_tokens": 1,
     "messages": [{"role": "user", "content": "x"}]}),
    ("CountTokensRequest", lambda b: parse_messages(b, MODEL, count_only=True),
     {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
    ("TokenizeRequest", lambda b: parse_tokenize(b, MODEL), {"prompt": "x"}),
    ("DetokenizeRequest", lambda b: parse_detokenize(b, MODEL, 258), {"tokens": [1]}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "parse", "base"), _NEW_APIS, ids=[n for n, _, _ in _NEW_APIS])
def test_new_api_schemas_and_parsers_take_the_same_fields(
    name: str, parse: Any, base: dict[str, Any]
) -> None:
    """Responses, Messages, count_tokens, tokenize, detokenize: each field of the published
    body, set to a value of its type, is taken by the parser (it may refuse the value's
    meaning, never the field); a field outside it is refused by name; each required field
    is required."""
    schema = openapi_document(MODEL)["components"]["schemas"][name]
    parse(base)
    for field, spec in schema["properties"].items():
        value = _example(spec["anyOf"][0] if field not in schema["required"] else spec)
        try:
            parse({**base, field: value})
        except (InvalidRequestError, HttpError) as exc:
            assert "unsupported field" not in str(exc), (field, exc)
    with pytest.raises(HttpError, match=r"unsupported field.*logit_bias"):
        parse({**base, "logit_bias": {"1": 5}})
    for field in schema["required"]:
        with pytest.raises(InvalidRequestError, match=field):
            parse({k: v for k, v in base.items() if k != field})


def test_integer_ranges_in_the_schema_are_the_parsers() -> None:
    """The schema's bounds of an integer field are where the parser starts refusing."""
    for chat, fields in ((False, COMPLETION_FIELDS), (True, CHAT_FIELDS)):
        base = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"}
        if chat:
            base["logprobs"] = True
        for name, field in fields.items():
            if field.get("type") != "integer" or "minimum" not in field:
                continue
            for bad in (field["minimum"] - 1, field["maximum"] + 1):
                with pytest.raises(InvalidRequestError, match=f"^{name} must be in"):
                    parse_body({**base, name: bad}, chat, MODEL)


@pytest.fixture(scope="module")
def server() -> Iterator[Harness]:
    with serve_in_thread(http=True) as h:
        yield h


def test_openapi_json_is_served_and_valid(server: Harness) -> None:
    """GET /openapi.json (no key needed) is the document, and schemathesis loads it as a
    valid OpenAPI 3.1 document."""
    response = httpx.get(f"{server.http_url}/openapi.json")
    assert response.status_code == 200
    assert response.json() == openapi_document(MODEL)
    schema = schemathesis.openapi.from_url(f"{server.http_url}/openapi.json")
    labels = sorted(op.ok().label for op in schema.get_all_operations())
    assert labels == [  # (schemathesis leaves out the path it loaded the document from)
        "GET /health",
        "GET /v1/models",
        "POST /detokenize",
        "POST /tokenize",
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/messages",
        "POST /v1/messages/count_tokens",
        "POST /v1/responses",
    ]


# Loaded from the document the server serves (checked equal above); the base URL is the
# live server's, given at each call. (schemathesis.pytest.from_fixture would load it from the
# server, but reaches into pytest internals that pytest 9 no longer has.)
schema = schemathesis.openapi.from_dict(openapi_document(MODEL))


@schema.parametrize()
@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
def test_live_server_keeps_its_contract(case: Any, server: Harness) -> None:
    """schemathesis' default checks on each operation: no 5xx, documented status codes,
    content types, headers and response bodies that fit the schema, schema-invalid requests
    refused, a 405 with Allow; and no request left holding a block. Left out: "schema-valid
    requests are accepted", which a schema cannot promise here (max_tokens must fit the
    context left after the prompt, min_tokens <= max_tokens, stream_options needs stream)."""
    case.call_and_validate(
        base_url=server.http_url, excluded_checks=[schemathesis.checks.positive_data_acceptance]
    )
    assert_idle_and_sound(server)


def test_405_names_the_allowed_methods(server: Harness) -> None:
    """schemathesis found it: a 405 in OpenAI's error shape had dropped Starlette's Allow
    header, which RFC 9110 requires."""
    response = httpx.request("TRACE", f"{server.http_url}/health")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, HEAD"
    assert response.json()["error"]["message"] == "TRACE is not allowed on /health"
    posted = httpx.get(f"{server.http_url}/v1/completions")
    assert (posted.status_code, posted.headers["allow"]) == (405, "POST")
