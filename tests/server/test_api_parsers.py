"""The Responses, Messages and tokenize parsers as pure functions: a body -> the shared chat
request (messages, adapter, sampling, stopping, constraint), exactly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from server.openai.anthropic import parse_messages
from server.openai.fields import HttpError
from server.openai.responses import parse_responses
from server.openai.tokenize import parse_detokenize, parse_tokenize
from server.validation import InvalidRequestError, chat_messages

ADAPTERS = ["sql"]


def _messages(request: Any) -> list[tuple[str, str]]:
    """(role, content) as a template that renders no tool_calls sees them."""
    return [(m["role"], m["content"]) for m in chat_messages(request.chat)]


def test_messages_body_becomes_the_chat_request() -> None:
    """system blocks, an assistant's text + tool_use, a user's tool_result then text, an
    adapter as model, sampling and stop sequences: one chat request, field by field."""
    body = {
        "model": "sql", "max_tokens": 7, "temperature": 0.5, "top_p": 0.75, "top_k": 3,
        "stop_sequences": ["END"], "system": [{"type": "text", "text": "S1"},
                                              {"type": "text", "text": "S2"}],
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "t"},
                {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "r"}]},
                {"type": "text", "text": "more"}]},
        ],
    }  # fmt: skip
    request = parse_messages(body, "fake", None, ADAPTERS).request
    call = json.dumps([{"name": "f", "arguments": json.dumps({"a": 1})}])
    assert _messages(request) == [
        ("system", "S1S2"), ("user", "q"), ("assistant", f"t\n{call}"), ("tool", "r"),
        ("user", "more"),
    ]  # fmt: skip
    assert request.adapter == "sql" and request.stopping.max_tokens == 7
    assert list(request.stopping.stop) == ["END"]
    sampling = request.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0.5, 0.75, 3)


def test_messages_tool_choice_maps_to_chat() -> None:
    """tool_choice tool -> the function's schema as the constraint; any -> a JSON array of
    calls (one with disable_parallel_tool_use); none -> no constraint."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    base = {"model": "fake", "max_tokens": 9, "messages": [{"role": "user", "content": "q"}],
            "tools": [{"name": "f", "input_schema": schema}]}  # fmt: skip
    named = parse_messages({**base, "tool_choice": {"type": "tool", "name": "f"}}, "fake")
    assert json.loads(named.request.json_schema) == schema
    assert named.tool_calls is not None and named.tool_calls.name == "f"
    one = parse_messages(
        {**base, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, "fake"
    )
    assert json.loads(one.request.json_schema)["maxItems"] == 1
    none = parse_messages({**base, "tool_choice": {"type": "none"}}, "fake")
    assert none.tool_calls is None and not none.request.json_schema


def test_responses_items_become_the_chat_request() -> None:
    """instructions, a developer message, an assistant message followed by its
    function_call (merged into one turn), the call's output, max_output_tokens, text.format
    json_object, an adapter as model."""
    body = {
        "model": "sql", "instructions": "I", "max_output_tokens": 5,
        "text": {"format": {"type": "json_object"}},
        "input": [
            {"role": "developer", "content": "D"},
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "t"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "r"},
        ],
    }  # fmt: skip
    parsed = parse_responses(body, "fake", None, ADAPTERS)
    request = parsed.request
    call = json.dumps([{"name": "f", "arguments": "{}"}])
    assert _messages(request) == [
        ("system", "I"), ("system", "D"), ("user", "q"), ("assistant", f"t\n{call}"),
        ("tool", "r"),
    ]  # fmt: skip
    assert request.adapter == "sql" and request.stopping.max_tokens == 5
    assert request.json_object and parsed.request_settings["store"] is False


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": "x", "previous_response_id": "r"}, "previous_response_id is not supported"),
        ({"input": "x", "store": 1}, "store must be false or left out"),
        ({"input": "x", "parallel_tool_calls": "no"}, "parallel_tool_calls must be true or false"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type must be"),
        ({"input": [{"type": "reasoning"}]}, "input[0].type must be message, function_call"),
    ],
)
def test_responses_refusals_name_the_field(body: dict[str, Any], message: str) -> None:
    """Each refusal is a 400 that names the field and what to send."""
    with pytest.raises(InvalidRequestError) as refused:
        parse_responses(body, "fake")
    assert message in str(refused.value)


def test_tokenize_reads_both_forms_and_adapter_names() -> None:
    """A prompt (special tokens on by default) or chat messages (off by default, generation
    prompt as given); an adapter's name is a model; an unknown model is a 404."""
    text = parse_tokenize({"model": "sql", "prompt": "hi"}, "fake", ADAPTERS)
    assert (text.text, text.add_special_tokens) == ("hi", True)
    chat = parse_tokenize(
        {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}, "fake"
    )
    assert chat.chat is not None and not chat.chat.add_generation_prompt
    assert chat.add_special_tokens is False
    assert parse_detokenize({"model": "sql", "tokens": [1, 2]}, "fake", 10, ADAPTERS) == [1, 2]
    with pytest.raises(HttpError, match="does not exist"):
        parse_detokenize({"model": "nope", "tokens": [1]}, "fake", 10)
