"""Tool calls on the OpenAI front: ``tools`` + ``tool_choice`` -> a JSON-schema constraint and a
system note that lists the tools, and a ``ToolCalls`` that tells ``answer`` how the answer's
text becomes OpenAI's ``tool_calls`` (``answer.split_tool_calls``). Pure.

- ``tool_choice: {"type": "function", "function": {"name": N}}``: the output is N's
  arguments, constrained to its ``parameters`` schema; the answer carries one call to N and
  ends with ``finish_reason: "stop"`` (as OpenAI does for a forced function).
- ``tool_choice: "required"``: the output is a JSON array of one or more
  ``{"name": ..., "arguments": {...}}``, each constrained to its tool's schema (one call when
  ``parallel_tool_calls`` is false); ``finish_reason: "tool_calls"``.
- ``"none"``: the tools are ignored.
- ``"auto"`` (OpenAI's default when ``tools`` is set): the model decides, unconstrained. This
  needs a chat template that renders ``tools`` and a known format for the model's calls:
  the Hermes format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the
  templates of Qwen2.5, Hermes 2/3 and others), recognised by a template that renders
  ``tools`` and mentions ``<tool_call>``. The tools go to the template; the calls are parsed
  out of the answer (the rest is its content). Any other template (SmolLM2's ChatML renders
  no tools) gets a 400 that says to use ``"required"`` or a named function.

For "required" and a named function the tools reach the model as a system note (the
template may render no tools).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from server.validation import InvalidRequestError

MAX_PARALLEL_CALLS = 8
HERMES = "hermes"


def tool_call_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template speaks (``"hermes"``), None when it renders no
    tools (then tool_choice "auto" is refused)."""
    if chat_template and "tools" in chat_template and "<tool_call>" in chat_template:
        return HERMES
    return None


@dataclass(frozen=True, slots=True)
class ToolCalls:
    """How a chat answer's text becomes ``tool_calls`` (``answer.split_tool_calls``): the
    named function's arguments (``name`` set), a JSON array of calls (tool_choice
    required), or Hermes-format calls inside free text (``auto``)."""

    name: str | None
    auto: bool = False

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """What ``parse_tools`` makes of a body: the schema the output must follow and the
    system note that lists the tools (both None for auto), the tools for the chat template
    (auto), and how to answer."""

    schema: dict[str, Any] | None
    note: str | None
    calls: ToolCalls
    template_tools: str = ""  # JSON list for ChatMessages.tools


def _functions(tools: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of {type: function, function}")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if (
            not isinstance(tool, Mapping)
            or tool.get("type") != "function"
            or not isinstance(fn, Mapping)
        ):
            raise InvalidRequestError(f"tools[{i}] must be {{type: function, function: {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string")
        parameters = fn.get("parameters", {"type": "object"})
        if not isinstance(parameters, Mapping):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema")
        functions[name] = {"description": fn.get("description", ""), "parameters": parameters}
    return functions


def parse_tools(body: Mapping[str, Any], tool_format: str | None = None) -> ToolRequest | None:
    """The tool request of a chat body (None: no tools, or ``tool_choice: "none"``).
    ``tool_format``: the served chat template's (``tool_call_format``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice needs tools")
        return None
    functions = _functions(tools)
    if choice == "none":
        return None
    listing = json.dumps([{"name": n, **f} for n, f in functions.items()], separators=(", ", ": "))
    if (choice is None or choice == "auto") and tool_format == HERMES:
        return ToolRequest(None, None, ToolCalls(None, auto=True), json.dumps(tools))
    if choice is None or choice == "auto":
        raise InvalidRequestError(
            'tool_choice "auto" (the default with tools) is not supported: this model\'s chat '
            "template renders no tools and has no tool-call format; set tool_choice to "
            '"required" or {"type": "function", "function": {"name": ...}}'
        )
    if choice == "required":
        parallel = body.get("parallel_tool_calls", True) is not False
        item = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": f["parameters"]},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for n, f in functions.items()
            ]
        }
        schema = {
            "type": "array",
            "items": item,
            "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
        }
        note = (
            f"You can call these functions: {listing}\nAnswer only with a JSON array of "
            'calls, each {"name": <function name>, "arguments": {...}}.'
        )
        return ToolRequest(schema, note, ToolCalls(None))
    name = None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice must be "none", "required" or {"type": "function", "function": '
            f'{{"name": ...}}}}, got {choice!r}'
        )
    if name not in functions:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not in tools "
            f"({', '.join(functions)})"
        )
    note = (
        f"You can call these functions: {listing}\nCall {name}: answer only with its "
        "arguments as a JSON object."
    )
    return ToolRequest(dict(functions[name]["parameters"]), note, ToolCalls(name))
