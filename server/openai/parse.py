"""A completions / chat completions JSON body -> a ``GenerateRequest`` (pure: no server).

``parse_body`` checks the body against ``fields``' tables, then reads each group of fields
with one ``_set_*``; tool requests go through ``tools.parse_tools`` and come back as the
constraint and system note they need. Errors are ``InvalidRequestError`` (400) or
``HttpError``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from server.openai.fields import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    FLOAT32_MAX,
    GUIDED_FIELDS,
    INT_RANGES,
    SAMPLING_FLOATS,
    STRUCTURED_KEYS,
    TOKEN_ID,
    HttpError,
)
from server.openai.reasoning import EFFORT_BUDGETS
from server.openai.tools import ToolCalls, parse_tools
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError


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


def known_fields(
    body: Any, fields: Mapping[str, Any], path: str, required: Sequence[str] = ()
) -> Mapping[str, Any]:
    """``body`` as a JSON object of ``fields`` (one set to null counts as left out), each of
    ``required`` set; else a 400 that names the first unknown field and lists the known
    ones (the Responses, Messages and tokenize routes)."""
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    unknown = sorted(str(k) for k in body if k not in fields and body[k] is not None)
    if unknown:
        raise HttpError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"unsupported field(s) for {path}: {', '.join(shown(k) for k in unknown[:5])}; "
            f"this server takes {', '.join(fields)}",
            unknown[0],
        )
    for key in required:
        if body.get(key) is None:
            raise InvalidRequestError(f"{key} is required")
    return body


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
    """An integer field, within the range of the proto field it goes to (``INT_RANGES``)."""
    value: int | None = _typed(body, key, _is_int, "an integer")
    low, high = INT_RANGES[key]
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
    low, high = TOKEN_ID["minimum"], TOKEN_ID["maximum"]
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
            f"{', '.join(sorted(set(allowed) - {'best_of'}))}",
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
    tool_calls: ToolCalls | None = None  # the answer's text is tool calls (``tools``)
    echo: bool = False  # completions: the prompt (and its logprobs) before the text
    score_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs: choices[].prompt_logprobs
    thinking_budget: int | None = None  # the thought's tokens at most (a reasoning model)
    reasoning: bool = False  # the answer's thought is split off (set by the HTTP front)
    # What the Responses answer repeats of its request (its settings: store, temperature ...).
    request_settings: dict[str, Any] = dataclasses.field(default_factory=dict)


def parse_body(
    body: Any,
    chat: bool,
    model_name: str,
    tool_format: str | None = None,
    adapters: Sequence[str] = (),
) -> Parsed:
    """Translate a completions / chat completions body into a ``GenerateRequest``.
    ``tool_format``: the chat template's tool-call format (``tools.tool_call_format``;
    None: tool_choice auto is refused). ``adapters``: the LoRA adapters' names, in
    ``/lora-adapters`` order (a ``model`` may name one; llama.cpp's ``lora`` ids index it)."""
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, endpoint)
    request = pb.GenerateRequest()
    _set_adapter(request, body, model_name, adapters)
    tools = parse_tools(body, tool_format) if chat else None
    if chat:
        _set_messages(request, body, tools.note if tools is not None else None)
        if tools is not None:
            request.chat.tools = tools.template_tools
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None:
            if not isinstance(kwargs, Mapping):
                raise InvalidRequestError("chat_template_kwargs must be an object")
            request.chat.chat_template_kwargs = json.dumps(kwargs)
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
    echo, score_only, prompt_logprobs = (False, False, False) if chat else _set_echo(request, body)
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
        request,
        stream,
        include_usage,
        logprobs,
        tools.calls if tools is not None else None,
        echo,
        score_only,
        prompt_logprobs,
        _thinking_budget(body) if chat else None,
    )


def _thinking_budget(body: Mapping[str, Any]) -> int | None:
    """The thought's budget in tokens: ``max_thinking_tokens`` (wins), else
    ``reasoning_effort``'s (``reasoning.EFFORT_BUDGETS``); None: unbounded."""
    budget = _int(body, "max_thinking_tokens")
    if budget is not None:
        return budget
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise InvalidRequestError(
            f"reasoning_effort must be one of {', '.join(EFFORT_BUDGETS)}, got {shown(effort)}"
        )
    return EFFORT_BUDGETS[effort]


def _set_adapter(
    request: pb.GenerateRequest, body: Mapping[str, Any], model_name: str, adapters: Sequence[str]
) -> None:
    """The adapter the request runs with: its ``model`` when that names an adapter, or
    llama.cpp's ``lora`` list (ids into ``adapters``; the one entry with a non-zero scale).
    An unknown model is a 404 naming what is served."""
    model = _str(body, "model")
    if model is not None and model not in (model_name, "", *adapters):
        listed = ", ".join(repr(a) for a in adapters)
        also = f" and the adapters {listed}" if adapters else ""
        raise HttpError(
            grpc.StatusCode.NOT_FOUND,
            f"the model {shown(model)} does not exist: this server serves {model_name!r}{also}",
            "model",
        )
    if model and model != model_name:
        request.adapter = model
    entries = body.get("lora")
    if entries is None:
        return
    if not isinstance(entries, list):
        raise InvalidRequestError(
            f'lora must be a list of {{"id": ..., "scale": ...}}, got {shown(entries)}'
        )
    chosen: dict[int, float] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, Mapping) or not set(entry) <= {"id", "scale"}:
            raise InvalidRequestError(
                f'lora[{i}] must be {{"id": ..., "scale": ...}}, got {shown(entry)}'
            )
        index = entry.get("id")
        if not _is_int(index) or not 0 <= index < len(adapters):
            raise InvalidRequestError(
                f"lora[{i}].id must be an adapter's id, 0..{len(adapters) - 1} "
                f"(GET /lora-adapters), got {shown(index)}"
            )
        scale = _number(entry, "scale")
        chosen[index] = 1.0 if scale is None else scale
    nonzero = {index: scale for index, scale in chosen.items() if scale != 0}
    if len(nonzero) > 1:
        raise InvalidRequestError(
            f"lora: {len(nonzero)} adapters have a non-zero scale; kvserve applies one adapter "
            "per request"
        )
    if not nonzero:
        request.adapter_scale = 0.0  # every adapter at 0: the base model, whatever the default
        return
    ((index, scale),) = nonzero.items()
    if request.adapter and request.adapter != adapters[index]:
        raise InvalidRequestError(
            f"model names the adapter {request.adapter!r} and lora the adapter "
            f"{adapters[index]!r}: name one"
        )
    request.adapter = adapters[index]
    request.adapter_scale = scale


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
    or in a new one first. An assistant turn's earlier ``tool_calls`` and a tool message's
    ``tool_call_id`` travel beside the content (``validation.chat_messages`` gives them to
    the template)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object with role, content")
        role = str(msg.get("role") or "")
        content = _chat_content(msg.get("content"), i)
        calls = msg.get("tool_calls")
        if calls and not (isinstance(calls, list) and all(isinstance(c, Mapping) for c in calls)):
            raise InvalidRequestError(f"messages[{i}].tool_calls must be a list of tool calls")
        call_id = msg.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise InvalidRequestError(f"messages[{i}].tool_call_id must be a string")
        if system_note is not None and i == 0 and role == "system":
            content, system_note = f"{content}\n\n{system_note}", None
        request.chat.messages.add(
            role=role,
            content=content,
            tool_calls=json.dumps(calls) if calls else "",
            tool_call_id=call_id or "",
        )
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
    for key in SAMPLING_FLOATS:
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
        unknown = sorted(set(structured) - set(STRUCTURED_KEYS))
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs: unsupported key(s) {', '.join(unknown)}; this server "
                f"takes one of {', '.join(STRUCTURED_KEYS)}"
            )
        for key in STRUCTURED_KEYS:
            value = structured.get(key)
            if value is not None and value is not False:
                found.append((f"structured_outputs.{key}", key, value))
    for field, kind in GUIDED_FIELDS.items():
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


def _set_echo(request: pb.GenerateRequest, body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """Completions' ``echo`` and vLLM's ``prompt_logprobs``: (echo, score_only,
    prompt_logprobs). Echo with logprobs scores the prompt with as many top ones; echo with
    max_tokens 0 scores it without generating (one token is computed and dropped, as vLLM
    does: the prompt's last position is computed anyway)."""
    echo = bool(_bool(body, "echo"))
    sampling, stopping = request.sampling, request.stopping
    asked = _int(body, "prompt_logprobs")
    if asked is not None:
        sampling.prompt_logprobs = asked
    if echo and sampling.HasField("logprobs") and (asked is None or asked >= 0):
        # The echoed prompt's top_logprobs: as many as the generated tokens' (or more).
        sampling.prompt_logprobs = max(sampling.logprobs, asked or 0)
    if sampling.HasField("prompt_logprobs") and request.HasField("n") and request.n > 1:
        what = "prompt_logprobs" if asked is not None else "echo with logprobs"
        raise InvalidRequestError(f"{what} scores the prompt once: n must be 1, got {request.n}")
    # Without echo, max_tokens 0 goes on to SamplingParams' range check (>= 1).
    score_only = echo and stopping.HasField("max_tokens") and stopping.max_tokens == 0
    if score_only:
        stopping.max_tokens = 1
    return echo, score_only, asked is not None
