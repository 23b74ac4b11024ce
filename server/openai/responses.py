"""OpenAI's Responses API (``POST /v1/responses``) over the chat completions core (pure: no
server).

``parse_responses`` turns a Responses body into the chat completions body it means and reads
that with ``parse.parse_body``: the same chat template, tool machinery, structured outputs
and validation. ``ResponsesWriter`` writes the engine's outputs as a ``response`` object or
as Responses' event stream, each event with its ``sequence_number``::

    response.created, response.in_progress,
    (a reasoning model's thought, output_index 0: response.output_item.added (reasoning),
    response.content_part.added, response.reasoning_text.delta...,
    response.reasoning_text.done, response.content_part.done, response.output_item.done),
    response.output_item.added, response.content_part.added, response.output_text.delta...,
    response.output_text.done, response.content_part.done, response.output_item.done,
    (function calls: response.output_item.added, response.function_call_arguments.delta,
    response.function_call_arguments.done, response.output_item.done), then
    response.completed (or response.incomplete when max_output_tokens cut the answer)

Items map to chat messages: ``instructions`` is the system message; ``message`` items
(``input_text`` / ``output_text`` parts; role ``developer`` is ``system``) are messages;
``function_call`` items are the assistant's ``tool_calls``; ``function_call_output`` items
are ``tool`` messages. Function ``tools`` (Responses' flat shape) and ``tool_choice`` are
chat's; ``text.format`` json_schema / json_object is chat's ``response_format``. A tool
answer's items are sent when its sample ends.

``reasoning.effort`` is chat's ``reasoning_effort`` (a thought budget).

No responses are stored: ``previous_response_id`` and ``store: true`` are a 400 (send the
whole conversation in ``input``); answers say ``"store": false``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from server.openai.answer import Choices, Usage, split_tool_calls
from server.openai.fields import CHAT_FIELDS, HttpError, error_body
from server.openai.parse import Parsed, known_fields, parse_body, shown
from server.outputs import GenerationOutput
from server.validation import InvalidRequestError

_STR = {"type": "string"}
_OBJECT = {"type": "object"}
# Published in /openapi.json: each constraint here is one the parser enforces.
RESPONSES_FIELDS: dict[str, dict[str, Any]] = {
    "model": _STR,
    "input": {"anyOf": [_STR, {"type": "array", "items": _OBJECT, "minItems": 1}]},
    "instructions": _STR,
    "max_output_tokens": CHAT_FIELDS["max_tokens"],
    "temperature": CHAT_FIELDS["temperature"],
    "top_p": CHAT_FIELDS["top_p"],
    "tools": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"type": {"enum": ["function"]}, "name": _STR, "parameters": _OBJECT},
            "required": ["type", "name"],
        },
    },
    "tool_choice": {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "properties": {"type": {"enum": ["function"]}, "name": _STR},
                "required": ["type", "name"],
            },
        ]
    },
    "parallel_tool_calls": {"type": "boolean"},
    "text": {
        "type": "object",
        "properties": {
            "format": {
                "type": "object",
                "properties": {"type": {"enum": ["text", "json_object", "json_schema"]}},
                "required": ["type"],
            }
        },
    },
    "stream": {"type": "boolean"},
    "reasoning": {
        "type": "object",
        "properties": {"effort": {"enum": ["minimal", "low", "medium", "high"]}},
    },
    "store": {"enum": [False]},
    "metadata": _OBJECT,
    "user": _STR,
}
RESPONSES_REQUIRED = ("input",)


def _check(body: Any) -> None:
    if not isinstance(body, Mapping):
        raise InvalidRequestError("the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise InvalidRequestError(
            "previous_response_id is not supported: this server stores no responses; send "
            "the whole conversation in input"
        )
    if body.get("store") is not None and body["store"] is not False:
        raise InvalidRequestError(
            "store must be false or left out: this server stores no responses, got "
            f"{json.dumps(body['store']) if body['store'] is True else shown(body['store'])}"
        )
    known_fields(body, RESPONSES_FIELDS, "/v1/responses")
    if body.get("input") is None:
        raise InvalidRequestError("input is required: a string or a list of input items")


def _content(value: Any, where: str) -> str:
    """A message item's content: a string, or input_text / output_text parts joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a string or a list of input_text parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidRequestError(
                f"{where}[{j}] is of type {shown(kind)}; only input_text and output_text parts "
                "are supported"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "".join(texts)


def _chat_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    chat: list[dict[str, Any]] = []
    if body.get("instructions") is not None:
        if not isinstance(body["instructions"], str):
            raise InvalidRequestError("instructions must be a string")
        chat.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        return [*chat, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InvalidRequestError("input must be a string or a non-empty list of input items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{where} must be an input item object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(
                    f"{where}.role must be user, assistant, system or developer, got {shown(role)}"
                )
            content = _content(item.get("content"), f"{where}.content")
            chat.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise InvalidRequestError(f"{where} must have a name and arguments (strings)")
            call = {"function": {"name": name, "arguments": arguments}}
            if chat and chat[-1]["role"] == "assistant":
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            chat.append({"role": "tool", "content": _content(output, f"{where}.output")})
        else:
            raise InvalidRequestError(
                f"{where}.type must be message, function_call or function_call_output, "
                f"got {shown(kind)}"
            )
    return chat


def _tools(body: Mapping[str, Any], tool_format: str | None) -> dict[str, Any]:
    tools, choice = body.get("tools"), body.get("tool_choice")
    fields: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequestError("tools must be a list of {type: function, name, ...}")
        chat_tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping) or tool.get("type") != "function":
                raise InvalidRequestError(
                    f"tools[{i}] must be {{type: function, name, parameters}}; only function "
                    "tools are supported"
                )
            function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
            chat_tools.append({"type": "function", "function": function})
        fields["tools"] = chat_tools
    if isinstance(choice, Mapping):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", '
                f'"name": ...}}, got {shown(choice)}'
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif tools and choice in (None, "auto") and tool_format is None:
        raise InvalidRequestError(
            'tool_choice "auto" (the default with tools) is not supported: this model\'s chat '
            "template renders no tools and has no tool-call format; set tool_choice to "
            '"required" or {"type": "function", "name": ...}'
        )
    if choice is not None:
        fields["tool_choice"] = choice
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise InvalidRequestError(
                f"parallel_tool_calls must be true or false, got {shown(parallel)}"
            )
        fields["parallel_tool_calls"] = parallel
    return fields


def _format(body: Mapping[str, Any]) -> dict[str, Any]:
    """``text.format`` as chat's ``response_format``."""
    text = body.get("text")
    if text is None:
        return {}
    if not isinstance(text, Mapping) or not set(text) <= {"format"}:
        raise InvalidRequestError(f'text must be {{"format": {{"type": ...}}}}, got {shown(text)}')
    spec = text.get("format")
    if spec is None:
        return {}
    if not isinstance(spec, Mapping):
        raise InvalidRequestError("text.format must be an object with a type")
    kind = spec.get("type")
    if kind == "json_schema":
        if not isinstance(spec.get("schema"), Mapping):
            raise InvalidRequestError("text.format.schema is required: the JSON schema object")
        return {
            "response_format": {"type": "json_schema", "json_schema": {"schema": spec["schema"]}}
        }
    if kind in ("text", "json_object"):
        return {"response_format": {"type": kind}}
    raise InvalidRequestError(
        f"text.format.type must be text, json_object or json_schema, got {shown(kind)}"
    )


def parse_responses(
    body: Any, model_name: str, tool_format: str | None = None, adapters: Sequence[str] = ()
) -> Parsed:
    """A Responses body -> the shared request (see the module docstring)."""
    _check(body)
    chat: dict[str, Any] = {"messages": _chat_messages(body)}
    chat.update(_tools(body, tool_format))
    chat.update(_format(body))
    renamed = {"max_output_tokens": "max_tokens"}
    for key in ("model", "max_output_tokens", "temperature", "top_p", "stream", "user"):
        if body.get(key) is not None:
            chat[renamed.get(key, key)] = body[key]
    if body.get("metadata") is not None and not isinstance(body["metadata"], Mapping):
        raise InvalidRequestError("metadata must be an object")
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, Mapping):
            raise InvalidRequestError('reasoning must be an object: {"effort": ...}')
        chat["reasoning_effort"] = reasoning.get("effort")
    parsed = parse_body(chat, True, model_name, tool_format, adapters)
    parsed.request_settings = {
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "user": body.get("user"),
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": None},
        "store": False,
        "previous_response_id": None,
    }
    return parsed


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.num_cached_tokens},
        "output_tokens": usage.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.num_prompt_tokens + usage.num_output_tokens,
    }


class ResponsesWriter:
    """The ``Writer`` of /v1/responses (see the module docstring)."""

    def __init__(self, parsed: Parsed, request_id: str, model: str, num_prompt_tokens: int):
        self.parsed = parsed
        self.id = request_id if request_id.startswith("resp") else f"resp_{request_id}"
        self.model = model
        self.created_at = int(time.time())
        self.usage = Usage(num_prompt_tokens=num_prompt_tokens)
        self._sequence_number = 0
        self._text: list[str] = []
        self._message_open = False
        self._thought: list[str] = []  # the reasoning item's text (a reasoning model)
        self._thought_open = False  # its item streams (until the message, or the end)
        self._message_index = 0  # the message's output_index: 1 after a reasoning item

    def _response(
        self, status: str, output: list[dict[str, Any]], finish: str | None = None
    ) -> dict[str, Any]:
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            **self.parsed.request_settings, "usage": _usage(self.usage) if done else None,
        }  # fmt: skip

    def _message(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "output_text", "text": text, "annotations": []}]
        return {
            "type": "message", "id": f"msg_{self.id[5:]}", "status": status,
            "role": "assistant", "content": content if status == "completed" else [],
        }  # fmt: skip

    def _reasoning(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {
            "type": "reasoning", "id": f"rs_{self.id[5:]}", "status": status,
            "summary": [], "content": content,
        }  # fmt: skip

    def _items(self, text: str, finish: str | None, thought: str = "") -> list[dict[str, Any]]:
        calls = None
        if self.parsed.tool_calls is not None and finish == "stop":
            content, calls = split_tool_calls(self.parsed.tool_calls, text)
            text = content or ""
        items = [self._reasoning(thought)] if thought else []
        if text or not calls:
            items.append(self._message(text))
        for call in calls or []:
            items.append(
                {
                    "type": "function_call", "id": f"fc_{call['id'][5:]}",
                    "call_id": call["id"], "name": call["function"]["name"],
                    "arguments": call["function"]["arguments"], "status": "completed",
                }
            )  # fmt: skip
        return items

    @staticmethod
    def _status(finish: str | None) -> str:
        return "incomplete" if finish == "length" else "completed"

    def whole(self, choices: Choices) -> dict[str, Any]:
        self.usage = choices.usage
        text, finish = "".join(choices.texts.get(0, [])), choices.finish.get(0)
        thought = "".join(choices.reasoning.get(0, []))
        return self._response(self._status(finish), self._items(text, finish, thought), finish)

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def events(self, out: GenerationOutput, reasoning: str = "") -> list[str]:
        events = []
        if self._sequence_number == 0:
            started = self._response("in_progress", [])
            events.append(self._event("response.created", response=started))
            events.append(self._event("response.in_progress", response=started))
        if reasoning:
            if not self._thought:
                self._thought_open = True
                events.extend(self._open_reasoning())
            self._thought.append(reasoning)
            at = self._at_reasoning()
            events.append(self._event("response.reasoning_text.delta", **at, delta=reasoning))
        self._text.append(out.text)
        if self._thought_open and (out.finished or (out.text and self.parsed.tool_calls is None)):
            events.extend(self._close_reasoning())
        if self.parsed.tool_calls is None and out.text:
            if not self._message_open:
                self._message_open = True
                events.extend(self._open_message())
            events.append(self._event("response.output_text.delta", **self._at(), delta=out.text))
        if not out.finished:
            return events
        self.usage.add(out)
        finish = out.finish_reason.value if out.finish_reason else None
        items = self._items("".join(self._text), finish, "".join(self._thought))
        for index, item in enumerate(items):
            if item["type"] == "reasoning":
                continue  # streamed, closed above
            if item["type"] == "message":
                self._message_index = index
                if not self._message_open:  # a tool answer's text, known only now
                    events.extend(self._open_message())
                    text = item["content"][0]["text"]
                    if text:
                        events.append(
                            self._event("response.output_text.delta", **self._at(), delta=text)
                        )
                events.extend(self._close_message(item))
            else:
                events.extend(self._call(index, item))
        status = self._status(finish)
        events.append(
            self._event(f"response.{status}", response=self._response(status, items, finish))
        )
        return events

    def _at(self) -> dict[str, Any]:
        index = self._message_index
        return {"item_id": f"msg_{self.id[5:]}", "output_index": index, "content_index": 0}

    def _at_reasoning(self) -> dict[str, Any]:
        return {"item_id": f"rs_{self.id[5:]}", "output_index": 0, "content_index": 0}

    def _open_reasoning(self) -> list[str]:
        item = self._reasoning("", "in_progress")
        part = {"type": "reasoning_text", "text": ""}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._at_reasoning(), part=part),
        ]

    def _close_reasoning(self) -> list[str]:
        self._thought_open, self._message_index = False, 1
        item = self._reasoning("".join(self._thought))
        (part,) = item["content"]
        at = self._at_reasoning()
        return [
            self._event("response.reasoning_text.done", **at, text=part["text"]),
            self._event("response.content_part.done", **at, part=part),
            self._event("response.output_item.done", output_index=0, item=item),
        ]

    def _open_message(self) -> list[str]:
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event(
                "response.output_item.added",
                output_index=self._message_index,
                item=self._message("", "in_progress"),
            ),
            self._event("response.content_part.added", **self._at(), part=part),
        ]

    def _close_message(self, item: dict[str, Any]) -> list[str]:
        (part,) = item["content"]
        return [
            self._event("response.output_text.done", **self._at(), text=part["text"]),
            self._event("response.content_part.done", **self._at(), part=part),
            self._event("response.output_item.done", output_index=self._message_index, item=item),
        ]

    def _call(self, index: int, item: dict[str, Any]) -> list[str]:
        at = {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        arguments = item["arguments"]
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", **at, delta=arguments),
            self._event("response.function_call_arguments.done", **at, arguments=arguments),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def end(self) -> list[str]:
        return []

    def failed(self, error: HttpError) -> list[str]:
        body = error_body(error.message, error.kind, error.param)["error"]
        return [
            self._event("error", code=body["type"], message=body["message"], param=body["param"])
        ]
