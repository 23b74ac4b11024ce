"""The OpenAI API's field tables and error shape: what a request may carry, and how a
failure reaches the client.

A new request field is a row here (its JSON schema: ``openapi`` publishes it, ``parse``
checks and reads it) plus one ``_set_*`` in ``parse``. Any other field with a value is
refused with a 400 that names it, so a client never gets silently different behaviour.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status from the gRPC code the same failure gets (``frontend.status_of``): 400 invalid,
401 no or a wrong key, 404 unknown model, 409 duplicate id, 429 overloaded, 503 shutting
down, 504 deadline, 500 a failed request.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor

from server.frontend import status_of
from server.rpc import generation_pb2 as pb
from server.validation import CHAT_ROLES

# gRPC code -> (HTTP status, OpenAI error type).
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.ABORTED: (409, "stalled_stream_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNIMPLEMENTED: (405, "invalid_request_error"),
}
# Validation names gRPC field paths; an HTTP client knows OpenAI's names.
_FIELD_NAMES = {
    "sampling.": "",
    "stopping.": "",
    "chat.messages": "messages",
    "token_ids.ids": "prompt",
}

# gRPC integer types -> the JSON integers that fit them (anything else is a 400 naming the
# field: a value the proto cannot hold is never clamped or wrapped behind the client's back).
_PROTO_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}
FLOAT32_MAX = 3.4028234663852886e38


def _proto_int(message: Any, name: str, minimum: int | None = None) -> dict[str, Any]:
    """The JSON Schema of an integer that goes into ``message.name``: the proto type's range
    (narrowed by ``minimum``)."""
    low, high = _PROTO_INT_RANGES[message.DESCRIPTOR.fields_by_name[name].type]
    return {"type": "integer", "minimum": low if minimum is None else max(low, minimum),
            "maximum": high}  # fmt: skip


def _number_schema(what: str) -> dict[str, Any]:
    return {"type": "number", "minimum": -FLOAT32_MAX, "maximum": FLOAT32_MAX, "description": what}


TOKEN_ID = _proto_int(pb.TokenIds, "ids")
_STRING = {"type": "string"}
_BOOLEAN = {"type": "boolean"}

# Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its
# older guided_* fields (aliases); tools on chat.
GUIDED_FIELDS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # fmt: skip
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
_OBJECT = {"type": "object"}
_SCHEMA = {"anyOf": [_OBJECT, _STRING]}  # a JSON schema, or its text
_STRINGS = {"type": "array", "items": _STRING, "minItems": 1}
_STRUCTURED_FIELDS: dict[str, dict[str, Any]] = {
    "response_format": {
        "type": "object",
        "properties": {
            "type": {"enum": ["text", "json_object", "json_schema"]},
            "json_schema": {"type": "object", "properties": {
                "name": _STRING, "schema": _OBJECT, "strict": {"type": ["boolean", "null"]}}},
        },
        "required": ["type"],
        "description": "OpenAI's: json_object (any JSON) or json_schema (json_schema.schema)",
    },
    "structured_outputs": {
        "type": "object",
        "properties": {"json": _SCHEMA, "regex": _STRING, "choice": _STRINGS,
                       "grammar": _STRING, "json_object": _BOOLEAN},
        "additionalProperties": False,
        "description": "vLLM's: one of json, regex, choice, grammar (Lark), json_object",
    },
    "guided_json": {**_SCHEMA, "description": "vLLM's older name of structured_outputs.json"},
    "guided_regex": {**_STRING, "description": "older name of structured_outputs.regex"},
    "guided_choice": {**_STRINGS, "description": "older name of structured_outputs.choice"},
    "guided_grammar": {**_STRING, "description": "older name of structured_outputs.grammar"},
}  # fmt: skip
_FUNCTION = {
    "type": "object",
    "properties": {"type": {"enum": ["function"]}, "function": {
        "type": "object", "properties": {"name": _STRING}, "required": ["name"]}},
    "required": ["type", "function"],
}  # fmt: skip
_TOOL_FIELDS: dict[str, dict[str, Any]] = {
    "tools": {"type": "array", "items": {
        "type": "object",
        "properties": {"type": {"enum": ["function"]}, "function": {
            "type": "object",
            "properties": {"name": _STRING, "description": _STRING, "parameters": _OBJECT},
            "required": ["name"]}},
        "required": ["type", "function"]},
        "description": "functions the model may call (answers carry tool_calls)"},
    "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required"]}, _FUNCTION],
                    "description": "required or a named function constrain the output to the "
                                   "call's JSON; auto needs a template that renders tools"},
    "parallel_tool_calls": {**_BOOLEAN, "description": "with required: more than one call"},
}  # fmt: skip

# The fields of a request body: name -> JSON Schema of its value. A field absent or null takes
# the server's default. The parser takes exactly these fields (any other with a value is a 400
# naming it) and reads its integer ranges here; ``openapi`` writes the OpenAPI document
# from the same tables, so the contract cannot drift from the parser.
COMMON_FIELDS: dict[str, dict[str, Any]] = {
    "model": {**_STRING, "description": "the served model's name, or a loaded LoRA adapter's "
                                        "(GET /v1/models); optional"},
    "lora": {"type": "array",
             "items": {"type": "object",
                       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
                                      "scale": _number_schema("the adapter's scale")},
                       "required": ["id"]},
             "description": "llama.cpp's: [{id, scale}] over GET /lora-adapters' ids; one "
                            "non-zero scale (one adapter per request), the rest 0"},
    "stream": {**_BOOLEAN, "description": "answer as server-sent events"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": ["boolean", "null"]}},
        "description": "with stream: true only; include_usage adds a final usage chunk",
    },
    "max_tokens": {**_proto_int(pb.StoppingOptions, "max_tokens"),
                   "description": "at most this many output tokens (>= 1, within the "
                                  "context; 0 with echo: score the prompt only)"},
    "stop": {
        "anyOf": [_STRING, {"type": "array", "items": _STRING}],
        "description": "stop strings (at most 16 of at most 256 characters), cut from the text",
    },
    "n": {**_proto_int(pb.GenerateRequest, "n", minimum=1),
          "description": "parallel samples sharing the prompt (up to the server's --max-n)"},
    "user": {**_STRING, "description": "OpenAI's end-user id: accepted, not used"},
    "cache_salt": {**_STRING, "description": "isolates this tenant's prefix cache (<= 256 bytes)"},
    "priority": {**_proto_int(pb.GenerateRequest, "priority"),
                 "description": "lower runs first; default 0"},
    "ignore_eos": {**_BOOLEAN, "description": "keep generating past the end-of-sequence token"},
    "min_tokens": {**_proto_int(pb.StoppingOptions, "min_tokens"),
                   "description": "stops and EOS are ignored before this many tokens"},
    "stop_token_ids": {"type": "array", "items": TOKEN_ID,
                       "description": "token ids that end the output"},
    "temperature": _number_schema(">= 0; 0 = greedy; default 1"),
    "top_p": _number_schema("(0, 1]; default 1"),
    "min_p": _number_schema("[0, 1]; default 0"),
    "presence_penalty": _number_schema("[-2, 2]; default 0"),
    "frequency_penalty": _number_schema("[-2, 2]; default 0"),
    "repetition_penalty": _number_schema("> 0; default 1"),
    "top_k": {**_proto_int(pb.SamplingOptions, "top_k"), "description": ">= 1; unset: disabled"},
    "seed": {**_proto_int(pb.SamplingOptions, "seed"),
             "description": "same seed, same tokens, whatever the batch"},
    "slo": {"type": "object",
            "properties": {"ttft_ms": _number_schema("time to first token target, ms"),
                           "itl_ms": _number_schema("inter-token latency target, ms")},
            "additionalProperties": False,
            "description": "this request's latency targets (the slo policy); default the "
                           "server's"},
    **_STRUCTURED_FIELDS,
}  # fmt: skip
_ONE_STRING = {"type": "array", "items": _STRING, "minItems": 1, "maxItems": 1}
COMPLETION_FIELDS: dict[str, dict[str, Any]] = {
    **COMMON_FIELDS,
    "prompt": {
        "anyOf": [_STRING, {"type": "array", "items": TOKEN_ID, "minItems": 1}, _ONE_STRING],
        "description": "a string, a list of token ids, or a batch of one string",
    },
    "logprobs": {**_proto_int(pb.SamplingOptions, "logprobs"),
                 "description": "return the sampled tokens' logprobs and this many top ones "
                                "(0..20)"},
    "echo": {**_BOOLEAN, "description": "the prompt before the text; with logprobs, the "
                                        "prompt tokens' logprobs (the first null) too"},
    "prompt_logprobs": {**_proto_int(pb.SamplingOptions, "prompt_logprobs"),
                        "description": "vLLM's: each prompt token's logprob and this many top "
                                       "ones (0..20), in choices[].prompt_logprobs"},
    "best_of": {"type": "integer", "enum": [1], "description": "not supported: 1 only"},
}  # fmt: skip
_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"enum": ["text"]}, "text": _STRING},
    "required": ["type"],
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"anyOf": [_STRING, {"type": "array", "items": _TEXT_PART}, {"type": "null"}]},
    },
    "required": ["role"],
}
CHAT_FIELDS: dict[str, dict[str, Any]] = {
    **COMMON_FIELDS,
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1,
                 "description": "the conversation, rendered with the model's chat template"},
    "max_completion_tokens": {**_proto_int(pb.StoppingOptions, "max_tokens"),
                              "description": "max_tokens under its newer name (wins over it)"},
    "logprobs": {**_BOOLEAN, "description": "return the sampled tokens' logprobs"},
    "top_logprobs": {**_proto_int(pb.SamplingOptions, "logprobs", minimum=0),
                     "description": "with logprobs: true, this many top alternatives (0..20)"},
    "chat_template_kwargs": {**_OBJECT, "description": "extra chat template variables, as "
                             "vLLM's (Qwen3's {\"enable_thinking\": false})"},
    **_TOOL_FIELDS,
    "max_thinking_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1,
                            "description": "a reasoning model's thought budget: at it, the "
                                           "thought is closed and the answer follows"},
    "reasoning_effort": {"enum": ["minimal", "low", "medium", "high"],
                         "description": "a thought budget of 256, 1024, 4096 or 16384 tokens"},
}  # fmt: skip
REQUIRED_FIELDS = {False: ("prompt",), True: ("messages",)}
# Integer fields -> their (minimum, maximum); chat's ``logprobs`` is a boolean.
INT_RANGES = {
    name: (schema["minimum"], schema["maximum"])
    for fields in (COMPLETION_FIELDS, CHAT_FIELDS)
    for name, schema in fields.items()
    if schema.get("type") == "integer" and "minimum" in schema
}
SAMPLING_FLOATS = tuple(k for k, v in COMMON_FIELDS.items() if v.get("type") == "number")


class HttpError(Exception):
    """Ends an HTTP request with an OpenAI error body; the status comes from ``code``, the
    gRPC code the same failure gets (metrics count both front ends by it)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        param: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.status, self.kind = _HTTP_STATUS.get(code, (500, "internal_error"))
        if status is not None:  # an HTTP-only failure (413) counted under its gRPC code
            self.status = status


def body_too_large(num_bytes: int, max_request_bytes: int, declared: bool) -> HttpError:
    """413 for a body over ``--max-request-bytes`` (declared by Content-Length, or streamed
    past it); the body is refused before it is buffered."""
    size = f"declares {num_bytes} bytes" if declared else f"runs past {max_request_bytes} bytes"
    return HttpError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"the request body {size}; this server takes at most {max_request_bytes} bytes "
        "(--max-request-bytes)",
        status=413,
    )


def error_body(message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def http_error(exc: BaseException) -> HttpError:
    if isinstance(exc, HttpError):
        return exc
    code, details = status_of(exc)
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        for grpc_name, http_name in _FIELD_NAMES.items():
            details = details.replace(grpc_name, http_name)
    return HttpError(code, details)
