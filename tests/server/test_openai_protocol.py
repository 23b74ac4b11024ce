"""The OpenAI protocol as pure functions: JSON bodies -> GenerateRequest, outputs -> JSON."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest

from scheduler.output import TokenLogprobs
from scheduler.request import FinishReason
from server import validation
from server.grpc_service import finish_reason_pb
from server.openai.answer import Answer, Choices, finish_reason
from server.openai.fields import COMPLETION_FIELDS, HttpError, http_error
from server.openai.parse import load_body, parse_body
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError, Limits

MODEL = "fake"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
CHAT_PB = {"chat": CHAT}


def _out(
    index: int = 0,
    text: str = "",
    finish: FinishReason | None = None,
    num_output_tokens: int = 0,
    logprobs: tuple[TokenLogprobs, ...] = (),
) -> GenerationOutput:
    return GenerationOutput(
        request_id="o/r",
        index=index,
        token_ids=[],
        text=text,
        finished=finish is not None,
        finish_reason=finish,
        num_prompt_tokens=4,
        num_cached_tokens=2,
        num_output_tokens=num_output_tokens,
        logprobs=list(logprobs),
    )


@pytest.mark.parametrize(
    ("body", "chat", "expected"),
    [
        ({"prompt": "hello"}, False, {"text": "hello"}),
        ({"prompt": ["hello"]}, False, {"text": "hello"}),  # a batch of one
        ({"prompt": [1, 2, 3]}, False, {"token_ids": {"ids": [1, 2, 3]}}),
        (
            {
                **CHAT,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    }
                ],
            },
            True,
            {"chat": {"messages": [{"role": "user", "content": "ab"}]}},
        ),
        (
            {"prompt": "x", "temperature": 0, "top_p": 0.5, "top_k": 3, "seed": 2**64 - 1},
            False,
            {
                "text": "x",
                "sampling": {"temperature": 0.0, "top_p": 0.5, "top_k": 3, "seed": str(2**64 - 1)},
            },
        ),
        (
            {
                "prompt": "x",
                "max_tokens": 7,
                "min_tokens": 2,
                "stop": "\n",
                "stop_token_ids": [5],
                "ignore_eos": True,
            },
            False,
            {
                "text": "x",
                "stopping": {
                    "max_tokens": 7,
                    "min_tokens": 2,
                    "stop": ["\n"],
                    "stop_token_ids": [5],
                    "ignore_eos": True,
                },
            },
        ),
        (
            {**CHAT, "max_tokens": 9, "max_completion_tokens": 3},
            True,
            {**CHAT_PB, "stopping": {"max_tokens": 3}},
        ),
        (
            {"prompt": "x", "max_tokens": 2**31 - 1},
            False,
            {"text": "x", "stopping": {"max_tokens": 2**31 - 1}},
        ),
        (
            {"prompt": "x", "n": 2, "priority": -(2**31), "cache_salt": "s", "model": MODEL},
            False,
            {"text": "x", "n": 2, "priority": -(2**31), "cache_salt": "s"},
        ),
        ({"prompt": "x", "logprobs": 2}, False, {"text": "x", "sampling": {"logprobs": 2}}),
        (
            {"prompt": "x", "slo": {"ttft_ms": 500, "itl_ms": 42.5}},
            False,
            {"text": "x", "slo": {"ttft_ms": 500.0, "itl_ms": 42.5}},
        ),
        ({**CHAT, "slo": {"itl_ms": 40}}, True, {**CHAT_PB, "slo": {"itl_ms": 40.0}}),
        (
            {**CHAT, "logprobs": True, "top_logprobs": 3},
            True,
            {**CHAT_PB, "sampling": {"logprobs": 3}},
        ),
    ],
)
def test_parse_body_builds_the_request(body: dict[str, Any], chat: bool, expected: Any) -> None:
    """Each accepted body becomes exactly this GenerateRequest."""
    from google.protobuf.json_format import MessageToDict

    parsed = parse_body(body, chat, MODEL)
    assert MessageToDict(parsed.request, preserving_proto_field_name=True) == MessageToDict(
        _message(expected), preserving_proto_field_name=True
    )


def _message(fields: dict[str, Any]) -> pb.GenerateRequest:
    from google.protobuf.json_format import ParseDict

    return ParseDict(fields, pb.GenerateRequest())


@pytest.mark.parametrize(
    ("body", "stream", "include_usage", "logprobs"),
    [
        ({"prompt": "x"}, False, False, False),
        ({"prompt": "x", "stream": True}, True, False, False),
        (
            {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}},
            True,
            True,
            False,
        ),
        ({"prompt": "x", "logprobs": 0}, False, False, True),
    ],
)
def test_parse_body_says_how_to_answer(
    body: dict[str, Any], stream: bool, include_usage: bool, logprobs: bool
) -> None:
    """Streaming, usage in the stream and logprobs come from the body."""
    parsed = parse_body(body, False, MODEL)
    assert (parsed.stream, parsed.include_usage, parsed.logprobs) == (
        stream,
        include_usage,
        logprobs,
    )


@pytest.mark.parametrize(
    ("body", "chat", "message"),
    [
        ([1], False, "the request body must be a JSON object"),
        ({}, False, "prompt is required: a string or a list of token ids"),
        ({"prompt": ["a", "b"]}, False, "prompt: batches of prompts are not supported"),
        ({"prompt": [1, -2]}, False, "prompt holds a negative token id: -2"),
        ({"messages": []}, True, "messages must be a non-empty list of {role, content}"),
        ({"messages": ["x"]}, True, "messages[0] must be an object with role, content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            True,
            "messages[0].content[0] is of type 'image_url'; only text parts are supported",
        ),
        ({"prompt": "x", "temperature": "hot"}, False, "temperature must be a number, got 'hot'"),
        ({"prompt": "x", "temperature": True}, False, "temperature must be a number, got True"),
        ({"prompt": "x", "seed": 1.5}, False, "seed must be an integer, got 1.5"),
        ({"prompt": "x", "stop": 3}, False, "stop must be a string or a list of strings"),
        ({"prompt": "x", "stop_token_ids": ["a"]}, False,
         "stop_token_ids must be a list of token ids"),
        ({"prompt": "x", "ignore_eos": 1}, False, "ignore_eos must be true or false, got 1"),
        ({"prompt": "x", "cache_salt": 1}, False, "cache_salt must be a string, got 1"),
        ({**CHAT, "top_logprobs": 2}, True, "top_logprobs needs logprobs: true"),
        ({**CHAT, "logprobs": True, "top_logprobs": -1}, True,
         "top_logprobs must be in [0, 2147483647], got -1"),
        ({"prompt": "x", "stream_options": {}}, False,
         "stream_options is only allowed with stream: true"),
        ({"prompt": "x", "stream": True, "stream_options": 1}, False,
         "stream_options must be an object"),
        ({"prompt": "x", "slo": 500}, False,
         'slo must be an object {"ttft_ms": ..., "itl_ms": ...} of milliseconds, got 500'),
        ({"prompt": "x", "slo": {"ttft": 500}}, False,
         "slo must be an object {\"ttft_ms\": ..., \"itl_ms\": ...} of milliseconds, got "
         "{'ttft': 500}"),
        ({"prompt": "x", "slo": {"itl_ms": "fast"}}, False, "itl_ms must be a number, got 'fast'"),
    ],
)  # fmt: skip
def test_parse_body_refuses_with_a_message(body: Any, chat: bool, message: str) -> None:
    """A body that cannot be served is an invalid request naming what to change."""
    with pytest.raises(InvalidRequestError) as error:
        parse_body(body, chat, MODEL)
    assert message in str(error.value)


INT32, UINT32, UINT64 = (-(2**31), 2**31 - 1), (0, 2**32 - 1), (0, 2**64 - 1)


@pytest.mark.parametrize(
    ("field", "chat", "proto_range", "minimum"),
    [
        ("seed", False, UINT64, None),
        ("top_k", False, INT32, None),
        ("max_tokens", False, INT32, None),
        ("max_completion_tokens", True, INT32, None),
        ("min_tokens", False, INT32, None),
        ("priority", False, INT32, None),
        ("logprobs", False, INT32, None),
        ("top_logprobs", True, INT32, 0),
        ("n", False, UINT32, 1),
    ],
)
def test_integers_outside_their_proto_type_are_refused_by_name(
    field: str, chat: bool, proto_range: tuple[int, int], minimum: int | None
) -> None:
    """Every integer field takes exactly its gRPC type's range (narrowed where the parser
    knows better): one past either end is a 400 naming the field, the range and the value,
    never a value clamped or wrapped (seed -1 once became 2**64 - 1, seed 2**70 its low
    bits)."""
    low, high = proto_range[0] if minimum is None else minimum, proto_range[1]
    base = {**(CHAT if chat else {"prompt": "x"})}
    if field == "top_logprobs":
        base["logprobs"] = True
    for bad in (low - 1, high + 1, 2**70, -(2**70)):
        with pytest.raises(InvalidRequestError) as error:
            parse_body({**base, field: bad}, chat, MODEL)
        assert str(error.value) == f"{field} must be in [{low}, {high}], got {bad}"
    for good in (low, high):
        parse_body({**base, field: good}, chat, MODEL)  # fits the proto: no error


def test_unsupported_field_names_are_shown_bounded() -> None:
    """A client's unknown field names come back in the message, but at most five of them and
    each cut to about 40 characters, whatever the body held."""
    body = {"prompt": "x", **{f"{i}" * 1000: 1 for i in range(9)}}
    with pytest.raises(HttpError) as error:
        parse_body(body, False, MODEL)
    message = str(error.value)
    assert message.startswith(
        f"unsupported field(s) for /v1/completions: {'0' * 17}...{'0' * 18}, 1"
    )
    shown_part, known = message.split(" and 4 more; this server takes ")
    assert len(shown_part) < 300  # the client's part; the rest lists the server's own fields
    assert known.split(", ") == sorted(set(COMPLETION_FIELDS) - {"best_of"})


@pytest.mark.parametrize(
    ("body", "chat", "message"),
    [
        ({"prompt": [1, 2**32]}, False, "prompt[1] = 4294967296 is not a token id (> 4294967295)"),
        ({"prompt": "x", "stop_token_ids": [2**32]}, False,
         "stop_token_ids[0] = 4294967296 is not a token id"),
        ({"prompt": "x", "temperature": 10**400}, False,
         "temperature must be a finite number within [-3.402823e+38, 3.402823e+38], got 1000"),
        ({"prompt": "x", "top_p": 1e39}, False, "top_p must be a finite number within"),
        ({"prompt": "x", "echo": "yes"}, False, "echo must be true or false, got 'yes'"),
        ({"prompt": "x", "echo": True, "logprobs": 1, "n": 2}, False,
         "echo with logprobs scores the prompt once: n must be 1, got 2"),
        ({"prompt": "x", "prompt_logprobs": 0, "n": 3}, False,
         "prompt_logprobs scores the prompt once: n must be 1, got 3"),
        ({"prompt": "x", "prompt_logprobs": 2**31}, False,
         "prompt_logprobs must be in [-2147483648, 2147483647], got 2147483648"),
        ({"prompt": "x", "best_of": True}, False,
         "unsupported field(s) for /v1/completions: best_of"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, True,
         "messages[0].content[0].text must be a string"),
        ({"prompt": "x", "seed": "x" * 10_000}, False,
         "seed must be an integer, got 'xxxxxxxxxxxx"),
    ],
)  # fmt: skip
def test_parse_body_refuses_values_no_proto_field_holds(
    body: Any, chat: bool, message: str
) -> None:
    """Token ids past uint32, floats past float32 (or past what float() takes), a non-boolean
    echo, best_of other than 1, prompt scores with n > 1 and a non-string text part are
    400s naming the field; a value shown in a message is bounded (never the client's 10 kB
    string)."""
    with pytest.raises((InvalidRequestError, HttpError)) as error:
        parse_body(body, chat, MODEL)
    assert message in str(error.value)
    assert len(str(error.value).split("; this server takes ")[0]) < 400  # the client's part


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "the request body nests arrays / objects too deeply"),
        (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nests arrays / objects too deeply"),
        (b'{"prompt": "x", "temperature": NaN}', "not valid JSON: NaN is not a JSON value"),
        (b'{"prompt": "x", "seed": -Infinity}', "not valid JSON: -Infinity is not a JSON value"),
        (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "not valid JSON: Exceeds the limit"),
        (b'{"prompt": "\xff"}', "not valid JSON"),  # not UTF-8
        (b"\xff\xfe{", "not valid JSON"),
        (b"", "not valid JSON"),
    ],
)
def test_load_body_refuses_what_the_json_parser_cannot_take(raw: bytes, message: str) -> None:
    """Any body Python's JSON parser cannot take is an invalid request (a 400), depth
    included: 100,000 nested arrays were a RecursionError and a 500."""
    with pytest.raises(InvalidRequestError) as error:
        load_body(raw)
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("body", "chat", "code", "message", "param"),
    [
        ({"prompt": "x", "model": "gpt-4"}, False, grpc.StatusCode.NOT_FOUND,
         "'gpt-4' does not exist: this server serves 'fake'", "model"),
        ({**CHAT, "functions": [{"name": "f"}]}, True, grpc.StatusCode.INVALID_ARGUMENT,
         "unsupported field(s) for /v1/chat/completions: functions", "functions"),
        ({"prompt": "x", "best_of": 2}, False, grpc.StatusCode.INVALID_ARGUMENT,
         "unsupported field(s) for /v1/completions: best_of", "best_of"),
    ],
)  # fmt: skip
def test_parse_body_http_errors(
    body: Any, chat: bool, code: grpc.StatusCode, message: str, param: str
) -> None:
    """Unknown models and unsupported fields carry their status and the field's name."""
    with pytest.raises(HttpError) as error:
        parse_body(body, chat, MODEL)
    assert (error.value.code, error.value.param) == (code, param)
    assert message in error.value.message


def test_unsupported_empty_values_pass() -> None:
    """A field the server does not take is accepted while it says nothing (None, false, {})."""
    parse_body(
        {"prompt": "x", "tools": [], "suffix": None, "echo": False, "best_of": 1}, False, MODEL
    )


@pytest.mark.parametrize(
    ("exc", "status", "kind", "message"),
    [
        (InvalidRequestError("sampling.top_p must be <= 1"), 400, "invalid_request_error",
         "top_p must be <= 1"),
        (InvalidRequestError("token_ids.ids holds 3"), 400, "invalid_request_error",
         "prompt holds 3"),
        (HttpError(grpc.StatusCode.UNIMPLEMENTED, "no"), 405, "invalid_request_error", "no"),
        (RuntimeError("boom"), 500, "internal_error", "internal error: RuntimeError('boom')"),
    ],
)  # fmt: skip
def test_http_error_status_and_field_names(
    exc: BaseException, status: int, kind: str, message: str
) -> None:
    """A failure gets the HTTP status of its gRPC code, and OpenAI's field names."""
    error = http_error(exc)
    assert (error.status, error.kind, error.message) == (status, kind, message)


@pytest.mark.parametrize(
    ("reason", "openai", "wire"),
    [
        (FinishReason.STOP, "stop", pb.FINISH_REASON_STOP),
        (FinishReason.LENGTH, "length", pb.FINISH_REASON_LENGTH),
        (FinishReason.ABORT, "abort", pb.FINISH_REASON_ABORT),
        (FinishReason.ERROR, "error", pb.FINISH_REASON_ERROR),
        (None, "error", pb.FINISH_REASON_ERROR),  # finished without a reason: it failed
    ],
)
def test_finish_reason_mapping(reason: FinishReason | None, openai: str, wire: int) -> None:
    """Every finish reason has its OpenAI string and its wire enum; no table to keep."""
    out = _out(finish=reason)
    out.finished = True
    assert finish_reason(out) == openai
    assert finish_reason_pb(reason) == wire
    assert finish_reason(_out()) is None  # not finished yet


def test_whole_answer_joins_the_samples_and_sums_the_usage() -> None:
    """A non-streamed completion: each sample's text joined, finish reasons, usage once."""
    choices = Choices()
    for out in (
        _out(0, "a"),
        _out(1, "x", FinishReason.LENGTH, 1),
        _out(0, "b", FinishReason.STOP, 2),
    ):
        choices.add(out)
    answer = Answer(parse_body({"prompt": "p"}, False, MODEL), False, "cmpl-1", MODEL, 4, str)
    body = answer.whole(choices)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ab", "stop"),
        (1, "x", "length"),
    ]
    assert body["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_chat_stream_opens_with_the_role_and_ends_with_usage() -> None:
    """Chat chunks: the role first, then deltas with the finish reason, then the usage."""
    parsed = parse_body(
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, True, MODEL
    )
    answer = Answer(parsed, True, "chatcmpl-1", MODEL, 4, str)
    events = answer.chunks(_out(0, "hi")) + answer.chunks(_out(0, "", FinishReason.STOP, 1))
    bodies = [json.loads(e.removeprefix("data: ")) for e in events]
    assert [b["choices"][0]["delta"] for b in bodies] == [
        {"role": "assistant", "content": ""},
        {"content": "hi"},
        {},
    ]
    assert [b["choices"][0]["finish_reason"] for b in bodies] == [None, None, "stop"]
    assert all(b["object"] == "chat.completion.chunk" and b["usage"] is None for b in bodies)
    assert answer.usage_chunk()["usage"]["completion_tokens"] == 1


def test_logprobs_in_both_shapes() -> None:
    """Completions list tokens and their logprobs; chat nests the top ones per token."""
    lp = TokenLogprobs(token_id=7, logprob=-0.5, top=((7, -0.5), (8, -1.0)))
    choices = Choices()
    choices.add(_out(0, "t", FinishReason.STOP, 1, logprobs=(lp,)))
    completion = Answer(
        parse_body({"prompt": "p", "logprobs": 1}, False, MODEL), False, "c", MODEL, 1, str
    )
    assert completion.whole(choices)["choices"][0]["logprobs"] == {
        "tokens": ["7"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"7": -0.5, "8": -1.0}],
        "text_offset": [0],
    }
    chat = Answer(parse_body({**CHAT, "logprobs": True}, True, MODEL), True, "c", MODEL, 1, str)
    content = chat.whole(choices)["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "7" and content[0]["bytes"] == [55]
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.0]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"prompt": "x", "top_k": 0}, "top_k must be >= 1 (or unset to disable), got 0"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"prompt": "x", "max_tokens": -5}, "max_tokens must be >= 1, got -5"),
        ({"prompt": "x", "min_tokens": -1}, "min_tokens must be in [0, max_tokens=16], got -1"),
        ({"prompt": "x", "logprobs": -1}, "logprobs must be in [0, 20], got -1"),
    ],
)
def test_ranges_are_checked_once_by_sampling_params(body: dict[str, Any], message: str) -> None:
    """parse_body passes a value out of range through; validation (SamplingParams' ranges,
    the gRPC path's) refuses it, and the HTTP error names the field as OpenAI does."""
    parsed = parse_body(body, False, MODEL)
    limits = Limits(vocab_size=100, max_model_len=64)
    with pytest.raises(InvalidRequestError) as error:
        validation.sampling_params(parsed.request, 1, limits)
    assert http_error(error.value).message == message


def test_per_request_targets_are_range_checked_as_the_grpc_ones() -> None:
    """An slo target of 0 ms parses, and validation refuses it as it does on gRPC."""
    parsed = parse_body({"prompt": "x", "slo": {"ttft_ms": 0}}, False, MODEL)
    with pytest.raises(InvalidRequestError) as error:
        validation.latency_targets(parsed.request.slo)
    assert http_error(error.value).message.startswith(
        "slo.ttft_ms must be a number of milliseconds in (0, 86400000], got 0"
    )
