"""The OpenAI protocol: a JSON body -> a ``GenerateRequest``, engine outputs -> OpenAI's JSON
and server-sent events, failures -> OpenAI's error shape. Pure functions and small builders,
with no server: ``server.openai_app`` serves them, and tests table-test them directly.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the
status from the gRPC code the same failure gets (``frontend.status_of``): 400 invalid,
401 no or a wrong key, 404 unknown model, 409 duplicate id, 429 overloaded, 503 shutting
down, 504 deadline, 500 a failed request.

Fields a request may carry are listed below; any other field with a value is refused with a
400 that names it, so a client never gets silently different behaviour.
"""

from __future__ import annotations

import json
import math
import reprlib
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor

from scheduler.request import FinishReason
from server.frontend import status_of
from server.openai_tools import ToolCalls, parse_tools, tool_call
from server.outputs import GenerationOutput
from server.rpc import generation_pb2 as pb
from server.validation import CHAT_ROLES, InvalidRequestError

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


_TOKEN_ID = _proto_int(pb.TokenIds, "ids")
_STRING = {"type": "string"}
_BOOLEAN = {"type": "boolean"}

# Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its
# older guided_* fields (aliases); tools on chat.
_GUIDED_FIELDS = {
    "guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
    "guided_grammar": "grammar",
}  # fmt: skip
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
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
# naming it) and reads its integer ranges here; ``server.openapi`` writes the OpenAPI document
# from the same tables, so the contract cannot drift from the parser.
COMMON_FIELDS: dict[str, dict[str, Any]] = {
    "model": {**_STRING, "description": "the served model's name (GET /v1/models); optional"},
    "stream": {**_BOOLEAN, "description": "answer as server-sent events"},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": ["boolean", "null"]}},
        "description": "with stream: true only; include_usage adds a final usage chunk",
    },
    "max_tokens": {**_proto_int(pb.StoppingOptions, "max_tokens"),
                   "description": "at most this many output tokens (>= 1, within the context)"},
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
    "stop_token_ids": {"type": "array", "items": _TOKEN_ID,
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
        "anyOf": [_STRING, {"type": "array", "items": _TOKEN_ID, "minItems": 1}, _ONE_STRING],
        "description": "a string, a list of token ids, or a batch of one string",
    },
    "logprobs": {**_proto_int(pb.SamplingOptions, "logprobs"),
                 "description": "return the sampled tokens' logprobs and this many top ones "
                                "(0..20)"},
    "echo": {"type": "boolean", "enum": [False], "description": "not supported: false only"},
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
    **_TOOL_FIELDS,
}  # fmt: skip
REQUIRED_FIELDS = {False: ("prompt",), True: ("messages",)}
# Integer fields -> their (minimum, maximum); chat's ``logprobs`` is a boolean.
_INT_RANGES = {
    name: (schema["minimum"], schema["maximum"])
    for fields in (COMPLETION_FIELDS, CHAT_FIELDS)
    for name, schema in fields.items()
    if schema.get("type") == "integer" and "minimum" in schema
}
_SAMPLING_FLOATS = tuple(k for k, v in COMMON_FIELDS.items() if v.get("type") == "number")


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


def finish_reason(out: GenerationOutput) -> str | None:
    """OpenAI's ``finish_reason`` of an output: None until the sample ends."""
    if not out.finished:
        return None
    return (out.finish_reason or FinishReason.ERROR).value


# ---------------------------------------------------------------------- JSON -> request
def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def load_body(raw: bytes) -> Any:
    """The JSON value of a request body; an ``InvalidRequestError`` for anything Python's
    parser cannot take (bad syntax or encoding, NaN / Infinity, an integer of more than 4,300
    digits, nesting past the interpreter's recursion limit)."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise InvalidRequestError(
            "the request body nests arrays / objects too deeply to parse; no field of this "
            "API nests more than 4 levels"
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too many digits
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 40, 40, 40


def shown(value: Any) -> str:
    """A value in an error message: bounded in length and depth, whatever the client sent."""
    return _SHOWN.repr(value)


def _typed(body: Mapping[str, Any], key: str, ok: Callable[[Any], bool], what: str) -> Any:
    value = body.get(key)
    if value is None or ok(value):
        return value
    raise InvalidRequestError(f"{key} must be {what}, got {shown(value)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_float32(value: Any) -> bool:
    """A finite number a proto ``float`` holds without turning it into infinity."""
    if isinstance(value, float):
        return math.isfinite(value) and abs(value) <= FLOAT32_MAX
    return _is_int(value) and abs(value) <= FLOAT32_MAX


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = _typed(body, key, lambda v: _is_int(v) or isinstance(v, float), "a number")
    if value is None:
        return None
    if not _is_float32(value):
        raise InvalidRequestError(
            f"{key} must be a finite number within [-{FLOAT32_MAX:.7g}, {FLOAT32_MAX:.7g}], "
            f"got {shown(value)}"
        )
    return float(value)


def _int(body: Mapping[str, Any], key: str) -> int | None:
    """An integer field, within the range of the proto field it goes to (``_INT_RANGES``)."""
    value: int | None = _typed(body, key, _is_int, "an integer")
    low, high = _INT_RANGES[key]
    if value is not None and not low <= value <= high:
        raise InvalidRequestError(f"{key} must be in [{low}, {high}], got {shown(value)}")
    return value


def _bool(body: Mapping[str, Any], key: str) -> bool | None:
    value: bool | None = _typed(body, key, lambda v: isinstance(v, bool), "true or false")
    return value


def _str(body: Mapping[str, Any], key: str) -> str | None:
    value: str | None = _typed(body, key, lambda v: isinstance(v, str), "a string")
    return value


def _token_ids(value: Any, key: str) -> list[int] | None:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return None
    low, high = _TOKEN_ID["minimum"], _TOKEN_ID["maximum"]
    for i, t in enumerate(value):
        if t < low:
            raise InvalidRequestError(f"{key} holds a negative token id: {t}")
        if t > high:
            raise InvalidRequestError(f"{key}[{i}] = {shown(t)} is not a token id (> {high})")
    return value


def _is_blank(value: Any) -> bool:
    """A value that asks for nothing: null, false, {} or [] (an SDK's default for a field)."""
    return value is None or value is False or (isinstance(value, (dict, list)) and not value)


def _check_fields(body: Mapping[str, Any], allowed: Mapping[str, Any], endpoint: str) -> None:
    """Refuse fields this server does not implement, instead of ignoring them."""
    unsupported = sorted(str(k) for k, v in body.items() if k not in allowed and not _is_blank(v))
    if not (body.get("echo") is None or body.get("echo") is False):
        unsupported.append("echo")
    best_of = body.get("best_of")
    if not (best_of is None or (_is_int(best_of) and best_of == 1)):
        unsupported.append("best_of")
    if unsupported:
        unsupported = [shown(k)[1:-1] if len(k) > 40 else k for k in unsupported]
        more = f" and {len(unsupported) - 5} more" if len(unsupported) > 5 else ""
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"unsupported field(s) for {endpoint}: {', '.join(unsupported[:5])}{more}; this "
            "server takes "
            f"{', '.join(sorted(set(allowed) - {'echo', 'best_of'}))}",
            unsupported[0],
        )


def _chat_content(content: Any, i: int) -> str:
    """A message's text: a string, or a list of ``{"type": "text", "text": ...}`` parts."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{i}].content[{j}] is of type {shown(kind)}; only text parts are "
                    "supported"
                )
            text = part.get("text", "")
            if not isinstance(text, str):
                raise InvalidRequestError(f"messages[{i}].content[{j}].text must be a string")
            texts.append(text)
        return "".join(texts)
    raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts")


@dataclass(slots=True)
class Parsed:
    """An HTTP request as the engine will see it, and how to answer it."""

    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: bool
    tool_calls: ToolCalls | None = None  # the answer's text is tool calls (server.openai_tools)


def parse_body(body: Any, chat: bool, model_name: str, tool_format: str | None = None) -> Parsed:
    """Translate a completions / chat completions body into a ``GenerateRequest``.
    ``tool_format``: the chat template's tool-call format (``openai_tools.tool_call_format``;
    None: tool_choice auto is refused)."""
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, endpoint)
    model = _str(body, "model")
    if model is not None and model not in (model_name, ""):
        raise HttpError(
            grpc.StatusCode.NOT_FOUND,
            f"the model {shown(model)} does not exist: this server serves {model_name!r}",
            "model",
        )
    request = pb.GenerateRequest()
    tools = parse_tools(body, tool_format) if chat else None
    if chat:
        _set_messages(request, body, tools.note if tools is not None else None)
        if tools is not None:
            request.chat.tools = tools.template_tools
    else:
        _set_prompt(request, body)
    _set_sampling(request.sampling, body)
    _set_stopping(request.stopping, body, chat)
    _set_constraint(request, body, tools.schema if tools is not None else None)
    n = _int(body, "n")
    if n is not None:
        request.n = n
    request.priority = _int(body, "priority") or 0
    request.cache_salt = _str(body, "cache_salt") or ""
    _set_slo(request.slo, body)
    logprobs = _set_logprobs(request.sampling, body, chat)
    _str(body, "user")  # accepted (OpenAI's end-user id); kvserve scopes by key or peer
    stream = bool(_bool(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise InvalidRequestError("stream_options must be an object")
        if not stream:
            raise InvalidRequestError("stream_options is only allowed with stream: true")
        include_usage = bool(_bool(options, "include_usage"))
    return Parsed(
        request, stream, include_usage, logprobs, tools.calls if tools is not None else None
    )


def _set_slo(slo: pb.LatencyTargets, body: Mapping[str, Any]) -> None:
    """The request's own latency targets, a vLLM-style extra field (``extra_body`` in
    OpenAI's clients) shaped as the gRPC ``GenerateRequest.slo``:
    ``"slo": {"ttft_ms": 500, "itl_ms": 50}``; either may be left out (the server's
    default). Their range is checked with every request's (``validation``)."""
    value = body.get("slo")
    if value is None:
        return
    if not isinstance(value, Mapping) or not set(value) <= {"ttft_ms", "itl_ms"}:
        raise InvalidRequestError(
            f'slo must be an object {{"ttft_ms": ..., "itl_ms": ...}} of milliseconds, '
            f"got {shown(value)}"
        )
    for key in ("ttft_ms", "itl_ms"):
        target = _number(value, key)
        if target is not None:
            setattr(slo, key, target)


def _set_messages(
    request: pb.GenerateRequest, body: Mapping[str, Any], system_note: str | None = None
) -> None:
    """The chat messages; ``system_note`` (the tools) goes at the end of the system message,
    or in a new one first. An assistant turn's earlier ``tool_calls`` follow its content as
    JSON, so the model sees them."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object with role, content")
        role = str(msg.get("role") or "")
        content = _chat_content(msg.get("content"), i)
        if msg.get("tool_calls"):
            calls = [c.get("function") for c in msg["tool_calls"] if isinstance(c, Mapping)]
            content = (content + "\n" + json.dumps(calls)).strip()
        if system_note is not None and i == 0 and role == "system":
            content, system_note = f"{content}\n\n{system_note}", None
        request.chat.messages.add(role=role, content=content)
    if system_note is not None:
        request.chat.messages.insert(0, pb.ChatMessage(role="system", content=system_note))


def _set_prompt(request: pb.GenerateRequest, body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of one
    ids = _token_ids(prompt, "prompt")
    if isinstance(prompt, str):
        request.text = prompt
    elif ids is not None and ids:
        request.token_ids.ids.extend(ids)
    elif isinstance(prompt, list) and prompt:
        raise InvalidRequestError(
            "prompt: batches of prompts are not supported; send one request per prompt"
        )
    else:
        raise InvalidRequestError("prompt is required: a string or a list of token ids")


def _set_sampling(sampling: pb.SamplingOptions, body: Mapping[str, Any]) -> None:
    for key in _SAMPLING_FLOATS:
        value = _number(body, key)
        if value is not None:
            setattr(sampling, key, value)
    # Ranges are SamplingParams' (one home): a bad value fails in validation, named as here.
    top_k = _int(body, "top_k")
    if top_k is not None:
        sampling.top_k = top_k
    seed = _int(body, "seed")
    if seed is not None:
        sampling.seed = seed


def _set_stopping(stopping: pb.StoppingOptions, body: Mapping[str, Any], chat: bool) -> None:
    max_tokens = _int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens")
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    min_tokens = _int(body, "min_tokens")
    if min_tokens is not None:
        stopping.min_tokens = min_tokens
    stop = body.get("stop")
    if isinstance(stop, str):
        stopping.stop.append(stop)
    elif isinstance(stop, list) and all(isinstance(x, str) for x in stop):
        stopping.stop.extend(stop)
    elif stop is not None:
        raise InvalidRequestError("stop must be a string or a list of strings")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        ids = _token_ids(stop_ids, "stop_token_ids")
        if ids is None:
            raise InvalidRequestError("stop_token_ids must be a list of token ids")
        stopping.stop_token_ids.extend(ids)
    if _bool(body, "ignore_eos"):
        stopping.ignore_eos = True


def _set_constraint(
    request: pb.GenerateRequest, body: Mapping[str, Any], tool_schema: Any = None
) -> None:
    """At most one of ``response_format`` (json_object / json_schema), ``structured_outputs``
    (vLLM: one of json, regex, choice, grammar, json_object), a ``guided_*`` alias, or the
    schema of the forced tool calls."""
    found: list[tuple[str, str, Any]] = []  # (field, kind, value)
    if tool_schema is not None:
        found.append(("tool_choice", "json", tool_schema))
    response_format = body.get("response_format")
    if response_format is not None:
        found.extend(_response_format(response_format))
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, Mapping):
            raise InvalidRequestError("structured_outputs must be an object")
        unknown = sorted(set(structured) - set(_STRUCTURED_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs: unsupported key(s) {', '.join(unknown)}; this server "
                f"takes one of {', '.join(_STRUCTURED_KEYS)}"
            )
        for key in _STRUCTURED_KEYS:
            value = structured.get(key)
            if value is not None and value is not False:
                found.append((f"structured_outputs.{key}", key, value))
    for field, kind in _GUIDED_FIELDS.items():
        if body.get(field) is not None:
            found.append((field, kind, body[field]))
    if not found:
        return
    if len(found) > 1:
        raise InvalidRequestError(
            f"at most one constraint per request, got {', '.join(f for f, _, _ in found)}"
        )
    field, kind, value = found[0]
    if kind == "json":
        if isinstance(value, Mapping):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise InvalidRequestError(f"{field} must be a JSON schema (an object or its text)")
        request.json_schema = value
    elif kind == "json_object":
        request.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(f"{field} must be a list of strings")
        request.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise InvalidRequestError(f"{field} must be a string")
        setattr(request, kind, value)


def _response_format(value: Any) -> list[tuple[str, str, Any]]:
    """OpenAI's ``response_format``: text (no constraint), json_object or json_schema."""
    if not isinstance(value, Mapping):
        raise InvalidRequestError("response_format must be an object with a type")
    kind = value.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", True)]
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidRequestError(
                "response_format.json_schema.schema is required: the JSON schema object"
            )
        return [("response_format", "json", schema)]
    raise InvalidRequestError(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}"
    )


def _set_logprobs(sampling: pb.SamplingOptions, body: Mapping[str, Any], chat: bool) -> bool:
    """Whether the answer carries logprobs (``sampling.logprobs``: how many top ones)."""
    if chat:
        if _bool(body, "logprobs"):
            # Checked here: SamplingParams would name it logprobs, OpenAI's chat top_logprobs.
            sampling.logprobs = _int(body, "top_logprobs") or 0
            return True
        if body.get("top_logprobs") is not None:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        return False
    top = _int(body, "logprobs")
    if top is None:
        return False
    sampling.logprobs = top
    return True


# ---------------------------------------------------------------------- outputs -> JSON
@dataclass(slots=True)
class Usage:
    """Token counts of one answer (the samples' outputs summed, the prompt's once)."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, out: GenerationOutput) -> None:
        """Count a finished sample's last output."""
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_output_tokens += out.num_output_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


class Choices:
    """Per-sample text, logprobs and finish reason of a non-streamed answer, and the usage."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.finish: dict[int, str | None] = {}
        self.usage = Usage()

    def add(self, out: GenerationOutput) -> None:
        self.texts.setdefault(out.index, []).append(out.text)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.finished:
            self.finish[out.index] = finish_reason(out)
            self.usage.add(out)


def sse(obj: Mapping[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Answer:
    """Builds one request's response objects (whole, or as stream chunks)."""

    def __init__(
        self,
        parsed: Parsed,
        chat: bool,
        request_id: str,
        model_name: str,
        num_prompt_tokens: int,
        token: Callable[[int], str],
    ) -> None:
        self.id = request_id
        self.chat = chat
        self.parsed = parsed
        self.created = int(time.time())
        self.model = model_name
        self.started: set[int] = set()
        self.usage = Usage(num_prompt_tokens=num_prompt_tokens)
        self._token = token
        self._tool_text: dict[int, list[str]] = {}  # streamed tool-call text per choice

    def _logprobs(self, lps: Iterable[Any]) -> dict[str, Any] | None:
        lps = list(lps)
        if not self.parsed.logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self._token(lp.token_id).encode()),
                        "top_logprobs": [
                            {
                                "token": self._token(t),
                                "logprob": p,
                                "bytes": list(self._token(t).encode()),
                            }
                            for t, p in lp.top
                        ],
                    }
                    for lp in lps
                ]
            }
        return {
            "tokens": [self._token(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(t): p for t, p in lp.top} for lp in lps],
        }

    def _base(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, choices: Choices) -> dict[str, Any]:
        body = self._base(chunk=False)
        items = []
        tools = self.parsed.tool_calls
        for index in sorted(choices.texts):
            text = "".join(choices.texts[index])
            item: dict[str, Any] = {"index": index}
            finish = choices.finish.get(index)
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
                content, calls = (
                    tools.split(text) if tools is not None and finish == "stop" else (text, None)
                )
                if tools is not None and calls is not None:
                    item["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = tools.finish_reason
            else:
                item["text"] = text
            item["logprobs"] = self._logprobs(choices.logprobs[index])
            item["finish_reason"] = finish
            items.append(item)
        body["choices"] = items
        body["usage"] = choices.usage.body()
        return body

    def chunks(self, out: GenerationOutput) -> list[str]:
        """The SSE events for one engine output (chat opens each choice with its role)."""
        events = []
        if self.chat and out.index not in self.started:
            self.started.add(out.index)
            events.append(self._chunk(out.index, {"role": "assistant", "content": ""}))
        reason = finish_reason(out)
        if out.finished:
            self.usage.add(out)
        if self.chat and self.parsed.tool_calls is not None:
            return events + self._tool_chunks(out, self.parsed.tool_calls, reason)
        if out.text or out.logprobs or reason is not None:
            delta = {"content": out.text} if out.text else {}
            events.append(
                self._chunk(out.index, delta if self.chat else out.text, out.logprobs, reason)
            )
        return events

    def _tool_chunks(
        self, out: GenerationOutput, tools: ToolCalls, reason: str | None
    ) -> list[str]:
        """A streamed tool-call answer. A named function's arguments stream as they come
        (the first delta opens the call with its id and name); "required" calls come whole
        when the sample ends (their names are only known then)."""
        buffered = self._tool_text.setdefault(out.index, [])
        buffered.append(out.text)
        events = []
        if tools.name is not None and out.text:
            fn: dict[str, Any] = {"arguments": out.text}
            call: dict[str, Any] = {"index": 0, "function": fn}
            if len(buffered) == 1 or not "".join(buffered[:-1]):
                call = {"index": 0, **tool_call(tools.name, out.text)}
            events.append(self._chunk(out.index, {"tool_calls": [call]}, out.logprobs))
        if reason is None:
            return events
        delta: dict[str, Any] = {}
        text = "".join(buffered)
        content, calls = tools.split(text) if reason == "stop" else (text, None)
        if tools.name is None and content:
            delta["content"] = content  # auto's text around the calls, or no calls after all
        if calls is not None:
            reason = tools.finish_reason
            if tools.name is None:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        events.append(self._chunk(out.index, delta, (), reason))
        return events

    def _chunk(
        self,
        index: int,
        content: Any,
        logprobs: Iterable[Any] = (),
        finish_reason: str | None = None,
    ) -> str:
        body = self._base(chunk=True)
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self.chat else "text"] = content
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        if self.parsed.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self) -> dict[str, Any]:
        body = self._base(chunk=True)
        body["choices"] = []
        body["usage"] = self.usage.body()
        return body
