"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) driven by the anthropic
SDK against a live server over the fake runner: text, stop reasons, a tool round trip, the
event stream, count_tokens, keys (x-api-key and Bearer alike) and the error shape."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from model_runner.constraints import ConstraintCompiler, ConstraintTracker
from server.auth import Security, key_owner
from server.fake_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from tests.server.helpers import engine_id, make_fake_runner, serve

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [{"name": "weather", "description": "forecast", "input_schema": WEATHER}]


class RecordingTokenizer(ByteTokenizer):
    """The byte tokenizer, keeping each list of messages it renders."""

    def __init__(self) -> None:
        self.rendered: list[list[dict[str, str]]] = []

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        self.rendered.append([dict(m) for m in messages])
        return super().apply_chat_template(messages, add_generation_prompt, **extra)


def runner_saying(**scripts: bytes) -> Any:
    """A fake runner (structured outputs on) whose request ``rid`` says ``scripts[rid]``
    (then EOS, unless the script ends with b"..." )."""
    runner = make_fake_runner(
        max_model_len=1024, constraints=ConstraintTracker(ConstraintCompiler(ByteTokenizer()))
    )
    for rid, said in scripts.items():
        tail = [] if said.endswith(b"...") else [EOS_TOKEN_ID]
        runner.set_script(engine_id(rid), [*said.removesuffix(b"..."), *tail])
    return runner


def sdk(url: str, key: str = "unused") -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0)


def rid(name: str) -> dict[str, str]:
    return {"X-Request-Id": name}


def prompt_len(messages: list[dict[str, str]]) -> int:
    return len(ByteTokenizer().apply_chat_template(messages).encode())


USER = [{"role": "user", "content": "hi"}]


async def test_messages_create_text_stop_reasons_and_usage() -> None:
    """A text answer ends with end_turn and counts its tokens; a stop sequence ends it with
    stop_sequence naming the string; max_tokens ends it with max_tokens; system (blocks)
    becomes the system message."""
    runner = runner_saying(a=b"Hello", b=b"Hello world", c=b"Hello world...")
    tokenizer = RecordingTokenizer()
    async with serve(runner, tokenizer, http=True) as h:
        client = sdk(h.http_url)
        msg = await client.messages.create(
            model="fake", max_tokens=50, messages=USER, system=[{"type": "text", "text": "Be"}],
            extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5}, metadata={"user_id": "u1"},
            extra_headers=rid("a"),
        )  # fmt: skip
        stopped = await client.messages.create(
            model="fake", max_tokens=50, messages=USER, stop_sequences=["wor"],
            extra_headers=rid("b"),
        )  # fmt: skip
        cut = await client.messages.create(
            model="fake", max_tokens=3, messages=USER, extra_headers=rid("c")
        )
        await client.close()
    assert [b.text for b in msg.content if b.type == "text"] == ["Hello"]
    assert (msg.role, msg.stop_reason, msg.stop_sequence) == ("assistant", "end_turn", None)
    system = [{"role": "system", "content": "Be"}, *USER]
    assert tokenizer.rendered[0] == system
    assert (msg.usage.input_tokens, msg.usage.output_tokens) == (prompt_len(system), 6)
    assert msg.id.startswith("msg") and msg.model == "fake"
    assert [b.text for b in stopped.content if b.type == "text"] == ["Hello "]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "wor")
    assert [b.text for b in cut.content if b.type == "text"] == ["Hel"]
    assert cut.stop_reason == "max_tokens"


async def test_messages_tool_round_trip() -> None:
    """tool_choice naming the tool: one tool_use block whose input fits its schema, stop
    tool_use; sent back with its tool_result, the conversation is rendered as chat messages
    (the call as JSON after the assistant's text, the result as a tool message) and answered
    in text; count_tokens counts the prompt the request would have."""
    runner = runner_saying(t2=b"Sunny")
    tokenizer = RecordingTokenizer()
    async with serve(runner, tokenizer, http=True) as h:
        client = sdk(h.http_url)
        asked = await client.messages.create(
            model="fake", max_tokens=200, messages=USER, tools=TOOLS,
            extra_body={"temperature": 1.0},
            tool_choice={"type": "tool", "name": "weather"}, extra_headers=rid("t1"),
        )  # fmt: skip
        (use,) = asked.content
        assert use.type == "tool_use" and use.name == "weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, WEATHER)
        assert asked.stop_reason == "tool_use"
        follow: Any = [
            *USER,
            {"role": "assistant", "content": [{"type": "text", "text": "Let me see."},
                                              use.model_dump()]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "22C"}]},
        ]  # fmt: skip
        answer = await client.messages.create(
            model="fake", max_tokens=50, messages=follow, tools=TOOLS,
            tool_choice={"type": "none"}, extra_headers=rid("t2"),
        )  # fmt: skip
        counted = await client.messages.count_tokens(
            model="fake", messages=follow, tools=TOOLS, tool_choice={"type": "none"}
        )
        await client.close()
    call = json.dumps([{"name": "weather", "arguments": json.dumps(use.input)}])
    assert tokenizer.rendered[1] == [
        *USER,
        {"role": "assistant", "content": f"Let me see.\n{call}"},
        {"role": "tool", "content": "22C"},
    ]
    assert [b.text for b in answer.content if b.type == "text"] == ["Sunny"]
    assert answer.stop_reason == "end_turn"
    assert counted.input_tokens == answer.usage.input_tokens == prompt_len(tokenizer.rendered[1])


async def test_messages_stream_event_sequence() -> None:
    """messages.stream: the text arrives as text_delta events and the final message is the
    whole one; the raw stream is message_start, content_block_start/delta.../stop,
    message_delta (stop_reason, usage), message_stop; a forced tool streams a tool_use block
    with its input as input_json_delta."""
    runner = runner_saying(s1=b"Hello there", s2=b"Hi")
    async with serve(runner, http=True) as h:
        client = sdk(h.http_url)
        async with client.messages.stream(
            model="fake", max_tokens=50, messages=USER, extra_headers=rid("s1")
        ) as stream:
            texts = [text async for text in stream.text_stream]
            final = await stream.get_final_message()
        async with client.messages.stream(
            model="fake", max_tokens=200, messages=USER, tools=TOOLS,
            extra_body={"temperature": 1.0},
            tool_choice={"type": "any", "disable_parallel_tool_use": True},
        ) as stream:  # fmt: skip
            tool_final = await stream.get_final_message()
        await client.close()
        async with httpx.AsyncClient(base_url=h.http_url) as http:
            raw = await http.post(
                "/v1/messages", headers=rid("s2"),
                json={"model": "fake", "max_tokens": 9, "messages": USER, "stream": True},
            )  # fmt: skip
    assert "".join(texts) == "Hello there" and len(texts) > 1
    assert [b.text for b in final.content if b.type == "text"] == ["Hello there"]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 12
    (use,) = tool_final.content
    assert use.type == "tool_use" and tool_final.stop_reason == "tool_use"
    jsonschema.validate(use.input, WEATHER)
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    datas = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert datas[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert datas[-2]["usage"] == {"output_tokens": 3}


async def test_keys_by_x_api_key_or_bearer_and_anthropic_errors() -> None:
    """With keys on, the anthropic SDK's x-api-key and the openai SDK's Bearer reach the same
    key; a wrong key is the SDK's AuthenticationError, a bad body its BadRequestError, both in
    Anthropic's error shape."""
    runner = runner_saying()
    for name in ("k1", "k2"):  # the key's owner names its requests
        runner.set_script(engine_id(name, key_owner("k")), [*b"Yes", EOS_TOKEN_ID])
    async with serve(runner, http=True, security=Security(api_keys=frozenset({"k"}))) as h:
        good = sdk(h.http_url, "k")
        msg = await good.messages.create(
            model="fake", max_tokens=9, messages=USER, extra_headers=rid("k1")
        )
        assert [b.text for b in msg.content if b.type == "text"] == ["Yes"]
        with pytest.raises(anthropic.BadRequestError) as bad:
            await good.messages.create(model="fake", max_tokens=0, messages=USER)
        with pytest.raises(anthropic.NotFoundError):
            await good.messages.create(model="nope", max_tokens=9, messages=USER)
        await good.close()
        wrong = sdk(h.http_url, "wrong")
        with pytest.raises(anthropic.AuthenticationError) as denied:
            await wrong.messages.create(model="fake", max_tokens=9, messages=USER)
        with pytest.raises(anthropic.AuthenticationError):
            await wrong.messages.count_tokens(model="fake", messages=USER)
        await wrong.close()
        bearer = openai.AsyncOpenAI(base_url=f"{h.http_url}/v1", api_key="k", max_retries=0)
        chat = await bearer.chat.completions.create(
            model="fake",
            messages=USER,
            max_tokens=9,
            extra_headers=rid("k2"),  # type: ignore[arg-type]
        )
        await bearer.close()
    assert chat.choices[0].message.content == "Yes"
    assert denied.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    assert isinstance(bad.value.body, dict)
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]


async def test_tool_choice_auto_on_a_hermes_template_in_both_new_apis() -> None:
    """On a template that renders tools, tool_choice auto (the default): the template gets
    the tools in chat's shape; the model's <tool_call> block becomes a tool_use block after
    a text block (Messages, whole and streamed) and a function_call item after a message
    item (Responses); an answer without a call is plain text."""
    from tests.server.test_structured_outputs import HermesTokenizer

    call = {"name": "weather", "arguments": {"city": "Rome", "days": 2}}
    said = f"Checking.<tool_call>\n{json.dumps(call)}\n</tool_call>".encode()
    runner = runner_saying(h1=said, h2=said, h3=said, h4=b"Hello")
    tokenizer = HermesTokenizer()
    async with serve(runner, tokenizer, http=True) as h:
        client = sdk(h.http_url)
        common: Any = {"model": "fake", "max_tokens": 300, "messages": USER, "tools": TOOLS}
        whole = await client.messages.create(**common, extra_headers=rid("h1"))
        async with client.messages.stream(**common, extra_headers=rid("h2")) as stream:
            streamed = await stream.get_final_message()
        plain = await client.messages.create(**common, extra_headers=rid("h4"))
        await client.close()
        responses = openai.AsyncOpenAI(base_url=f"{h.http_url}/v1", api_key="x", max_retries=0)
        flat: Any = [{"type": "function", "name": "weather", "parameters": WEATHER}]
        done = await responses.responses.create(
            model="fake", input="hi", tools=flat, extra_headers=rid("h3")
        )
        await responses.close()
    chat_tool = {"type": "function", "function": {"name": "weather", "description": "forecast",
                                                  "parameters": WEATHER}}  # fmt: skip
    assert tokenizer.rendered_tools[0] == [chat_tool]
    for message in (whole, streamed):
        text, use = message.content
        assert text.type == "text" and text.text == "Checking."
        assert use.type == "tool_use" and (use.name, use.input) == ("weather", call["arguments"])
        assert message.stop_reason == "tool_use"
    assert [b.text for b in plain.content if b.type == "text"] == ["Hello"]
    assert plain.stop_reason == "end_turn"
    message_item, function_call = done.output
    assert message_item.type == "message" and done.output_text == "Checking."
    assert function_call.type == "function_call" and function_call.name == "weather"
    assert json.loads(function_call.arguments) == call["arguments"]
