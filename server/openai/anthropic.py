"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the
chat completions core (pure: no server).

``parse_messages`` turns a Messages body into the chat completions body it means and reads
that with ``parse.parse_body``: the same chat template, tool machinery, sampling and
validation. ``MessagesWriter`` writes the engine's outputs as a ``message`` or as Anthropic's
event stream::

    message_start, then per content block: content_block_start, content_block_delta
    (thinking_delta then signature_delta / text_delta / input_json_delta)...,
    content_block_stop; message_delta (stop_reason, usage), message_stop

A reasoning model's thought is a ``thinking`` block before the others (its ``signature``
empty: nothing is signed here). ``thinking: {"type": "enabled", "budget_tokens": N}`` bounds
the thought (chat's ``max_thinking_tokens``); ``disabled`` is accepted.

Blocks map to chat messages as follows: ``system`` (a string or text blocks) is the system
message; a user turn's ``tool_result`` blocks are ``tool`` messages (before its text); an
assistant turn's ``tool_use`` blocks are its ``tool_calls``. ``tool_choice`` ``auto`` /
``any`` / ``tool`` / ``none`` is chat's ``auto`` / ``required`` / a named function / ``none``
(``disable_parallel_tool_use``: one call). A tool answer's blocks are sent when its sample
ends (the calls are parsed out of the whole text). ``metadata`` is accepted and unused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from server.openai.answer import Choices, Usage, split_tool_calls
from server.openai.fields import CHAT_FIELDS, HttpError
from server.openai.parse import Parsed, known_fields, parse_body, shown
from server.outputs import GenerationOutput
from server.validation import InvalidRequestError

_STR = {"type": "string"}
_TEXT_BLOCK = {
    "type": "object",
    "properties": {"type": {"enum": ["text"]}, "text": _STR},
    "required": ["type", "text"],
}
_TOOL = {
    "type": "object",
    "properties": {"name": _STR, "description": _STR, "input_schema": {"type": "object"}},
    "required": ["name", "input_schema"],
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"enum": ["user", "assistant"]},
        "content": {"anyOf": [_STR, {"type": "array", "items": {"type": "object"}}]},
    },
    "required": ["role", "content"],
}
# The count_tokens body: what makes the prompt. (Published in /openapi.json: each
# constraint here is one the parser enforces.)
COUNT_FIELDS: dict[str, dict[str, Any]] = {
    "model": _STR,
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
    "system": {"anyOf": [_STR, {"type": "array", "items": _TEXT_BLOCK}]},
    "tools": {"type": "array", "items": _TOOL, "minItems": 1},
    "tool_choice": {
        "type": "object",
        "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}},
        "required": ["type"],
    },
}
MESSAGES_FIELDS: dict[str, dict[str, Any]] = {
    **COUNT_FIELDS,
    **{k: CHAT_FIELDS[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stream")},
    "stop_sequences": {"type": "array", "items": _STR},
    "metadata": {"type": "object"},
    "thinking": {
        "type": "object",
        "properties": {
            "type": {"enum": ["enabled", "disabled"]},
            "budget_tokens": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
        },
        "required": ["type"],
    },
}
MESSAGES_REQUIRED = ("model", "max_tokens", "messages")
COUNT_REQUIRED = ("model", "messages")

# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    503: "overloaded_error",
}  # fmt: skip


def error_body(error: HttpError) -> dict[str, Any]:
    """Anthropic's error shape for ``error``."""
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def event(name: str, data: Mapping[str, Any]) -> str:
    """One named server-sent event, as Anthropic streams them."""
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _text(value: Any, where: str) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(value):
        if not isinstance(block, Mapping) or block.get("type") != "text":
            raise InvalidRequestError(f"{where}[{j}] must be a text block")
        if not isinstance(block.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}].text must be a string")
        texts.append(block["text"])
    return "".join(texts)


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content}")
    chat: list[dict[str, Any]] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or msg.get("role") not in ("user", "assistant"):
            raise InvalidRequestError(f"messages[{i}] must be {{role: user|assistant, content}}")
        role, content = msg["role"], msg.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidRequestError(f"messages[{i}].content must be a string or blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, Mapping) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
                arguments = json.dumps(block.get("input", {}))
                calls.append({"function": {"name": block["name"], "arguments": arguments}})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # an earlier turn's thought, sent back: not part of the prompt
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                text = _text(result, f"{where}.content")
                chat.append({"role": "tool", "content": text})
            else:
                raise InvalidRequestError(
                    f"{where} must be a text block{', a tool_use' if role == 'assistant' else ''}"
                    f"{' or a tool_result' if role == 'user' else ''} block, got {shown(kind)}"
                )
        if texts or calls or not content:
            chat.append({"role": role, "content": "".join(texts), "tool_calls": calls or None})
    return chat


def _tools(body: Mapping[str, Any], tool_format: str | None) -> dict[str, Any]:
    """Messages' ``tools`` / ``tool_choice`` as chat's fields."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return {}
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of {name, input_schema}")
    chat_tools = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping) or not isinstance(tool.get("name"), str):
            raise InvalidRequestError(f"tools[{i}] must be {{name, description, input_schema}}")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping):
            raise InvalidRequestError(f"tools[{i}].input_schema must be a JSON schema object")
        function = {"name": tool["name"], "parameters": schema}
        if tool.get("description") is not None:
            if not isinstance(tool["description"], str):
                raise InvalidRequestError(f"tools[{i}].description must be a string")
            function["description"] = tool["description"]
        chat_tools.append({"type": "function", "function": function})
    choice = {"type": "auto"} if choice is None else choice
    kind = choice.get("type") if isinstance(choice, Mapping) else None
    fields: dict[str, Any] = {"tools": chat_tools}
    if kind == "auto" and tool_format is None:
        raise InvalidRequestError(
            'tool_choice {"type": "auto"} (the default with tools) is not supported: this '
            "model's chat template renders no tools and has no tool-call format; set "
            'tool_choice to {"type": "any"} or {"type": "tool", "name": ...}'
        )
    if kind == "tool":
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif kind in ("auto", "any", "none"):
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise InvalidRequestError(
            f"tool_choice.type must be auto, any, tool or none, got {shown(choice)}"
        )
    if choice.get("disable_parallel_tool_use") is True:
        fields["parallel_tool_calls"] = False
    return fields


def parse_messages(
    body: Any,
    model_name: str,
    tool_format: str | None = None,
    adapters: Sequence[str] = (),
    count_only: bool = False,
) -> Parsed:
    """A Messages (``count_only``: count_tokens) body -> the shared request."""
    if count_only:
        known_fields(body, COUNT_FIELDS, "/v1/messages/count_tokens", COUNT_REQUIRED)
    else:
        known_fields(body, MESSAGES_FIELDS, "/v1/messages", MESSAGES_REQUIRED)
    if not isinstance(body.get("model"), str):
        raise InvalidRequestError(f"model must be a string, got {shown(body.get('model'))}")
    chat: dict[str, Any] = {"model": body["model"], "messages": _chat_messages(body)}
    chat.update(_tools(body, tool_format))
    for key in ("max_tokens", "temperature", "top_p", "top_k", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise InvalidRequestError("stop_sequences must be a list of strings")
        chat["stop"] = stops
    if body.get("metadata") is not None and not isinstance(body["metadata"], Mapping):
        raise InvalidRequestError("metadata must be an object")
    if not count_only:
        chat.update(_thinking(body.get("thinking")))
    return parse_body(chat, True, model_name, tool_format, adapters)


def _thinking(value: Any) -> dict[str, Any]:
    """``thinking``: enabled with ``budget_tokens`` -> the thought's budget; disabled or left
    out: none (a reasoning model's thought still comes as a thinking block)."""
    if value is None:
        return {}
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind == "disabled":
        return {}
    if kind != "enabled":
        raise InvalidRequestError(
            'thinking must be {"type": "enabled", "budget_tokens": N} or '
            f'{{"type": "disabled"}}, got {shown(value)}'
        )
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidRequestError(
            f"thinking.budget_tokens must be an integer >= 1, got {shown(budget)}"
        )
    return {"max_thinking_tokens": budget}


def _blocks(parsed: Parsed, text: str, finish: str | None) -> tuple[list[dict[str, Any]], bool]:
    """The content blocks of a finished answer, and whether they hold tool calls."""
    calls = None
    if parsed.tool_calls is not None and finish == "stop":
        content, calls = split_tool_calls(parsed.tool_calls, text)
        text = content or ""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for call in calls or []:
        arguments = json.loads(call["function"]["arguments"])
        blocks.append(
            {
                "type": "tool_use",
                "id": f"toolu_{call['id'][5:]}",
                "name": call["function"]["name"],
                "input": arguments,
            }
        )
    return blocks, calls is not None


def _stop(finish: str | None, stop_reason: int | str | None, tools: bool) -> dict[str, Any]:
    if tools:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if finish == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.num_prompt_tokens,
        "output_tokens": usage.num_output_tokens,
        "cache_read_input_tokens": usage.num_cached_tokens,
    }


class MessagesWriter:
    """The ``Writer`` of /v1/messages (see the module docstring)."""

    def __init__(self, parsed: Parsed, request_id: str, model: str, num_prompt_tokens: int):
        self.parsed = parsed
        self.id = request_id if request_id.startswith("msg") else f"msg_{request_id}"
        self.model = model
        self.usage = Usage(num_prompt_tokens=num_prompt_tokens)
        self._started = False
        self._text_open = False
        self._thinking_open = False
        self._next_block = 0  # the index of the next content block
        self._buffered: list[str] = []  # a tool answer's text, parsed when it ends

    def _message(self, content: list[dict[str, Any]], stop: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, **stop, "usage": _usage(self.usage),
        }  # fmt: skip

    def whole(self, choices: Choices) -> dict[str, Any]:
        self.usage = choices.usage
        text, finish = "".join(choices.texts.get(0, [])), choices.finish.get(0)
        blocks, tools = _blocks(self.parsed, text, finish)
        thought = "".join(choices.reasoning.get(0, []))
        if thought:
            blocks.insert(0, {"type": "thinking", "thinking": thought, "signature": ""})
        return self._message(blocks, _stop(finish, choices.stop_reason.get(0), tools))

    def events(self, out: GenerationOutput, reasoning: str = "") -> list[str]:
        events = []
        if not self._started:
            self._started = True
            start = self._message([], {"stop_reason": None, "stop_sequence": None})
            events.append(event("message_start", {"type": "message_start", "message": start}))
        if reasoning:
            if not self._thinking_open:
                self._thinking_open = True
                block = {"type": "thinking", "thinking": "", "signature": ""}
                events.append(self._block_start(self._next_block, block))
            events.append(
                self._delta(self._next_block, {"type": "thinking_delta", "thinking": reasoning})
            )
        if self._thinking_open and (out.finished or (out.text and self.parsed.tool_calls is None)):
            events.extend(self._close_thinking())
        if self.parsed.tool_calls is not None:
            self._buffered.append(out.text)
        elif out.text:
            if not self._text_open:
                self._text_open = True
                block = {"type": "text", "text": ""}
                events.append(self._block_start(self._next_block, block))
            events.append(self._delta(self._next_block, {"type": "text_delta", "text": out.text}))
        if not out.finished:
            return events
        self.usage.add(out)
        finish, tools = (out.finish_reason.value if out.finish_reason else None), False
        if self._text_open:
            stop = {"type": "content_block_stop", "index": self._next_block}
            events.append(event("content_block_stop", stop))
        elif self.parsed.tool_calls is not None:
            blocks, tools = _blocks(self.parsed, "".join(self._buffered), finish)
            for index, block in enumerate(blocks, start=self._next_block):
                events.extend(self._whole_block(index, block))
        delta = {
            "type": "message_delta",
            "delta": _stop(finish, out.stop_reason, tools),
            "usage": {"output_tokens": self.usage.num_output_tokens},
        }
        events.append(event("message_delta", delta))
        events.append(event("message_stop", {"type": "message_stop"}))
        return events

    def _close_thinking(self) -> list[str]:
        """The thinking block's end: its (empty: nothing is signed here) signature, its stop."""
        index = self._next_block
        self._thinking_open, self._next_block = False, index + 1
        signature = {"type": "signature_delta", "signature": ""}
        stop = {"type": "content_block_stop", "index": index}
        return [self._delta(index, signature), event("content_block_stop", stop)]

    def _block_start(self, index: int, block: dict[str, Any]) -> str:
        body = {"type": "content_block_start", "index": index, "content_block": block}
        return event("content_block_start", body)

    def _delta(self, index: int, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": index, "delta": delta}
        return event("content_block_delta", body)

    def _whole_block(self, index: int, block: dict[str, Any]) -> list[str]:
        start: dict[str, Any]
        delta: dict[str, Any]
        if block["type"] == "text":
            start = {"type": "text", "text": ""}
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            start = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        stop = {"type": "content_block_stop", "index": index}
        return [
            self._block_start(index, start),
            self._delta(index, delta),
            event("content_block_stop", stop),
        ]

    def end(self) -> list[str]:
        return []

    def failed(self, error: HttpError) -> list[str]:
        return [event("error", error_body(error))]
