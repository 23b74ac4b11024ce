"""OpenAI's Responses API (/v1/responses) driven by the openai SDK against a live server over
the fake runner: plain and streamed text, a function tool round trip, a json_schema
text.format, and the stateless refusals (previous_response_id, store: true)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from server.fake_tokenizer import ByteTokenizer
from tests.server.helpers import serve
from tests.server.test_messages_api import (
    WEATHER,
    RecordingTokenizer,
    prompt_len,
    rid,
    runner_saying,
)

TOOLS: list[Any] = [{"type": "function", "name": "weather", "parameters": WEATHER}]


def sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_responses_create_text_and_usage() -> None:
    """input as a string with instructions: one message item with the text, status
    completed and the usage counted; input as message items (developer is system);
    max_output_tokens cuts the answer: status incomplete, reason max_output_tokens."""
    runner = runner_saying(r1=b"Hello", r2=b"Hi", r3=b"Hello world...")
    tokenizer = RecordingTokenizer()
    async with serve_with(runner, tokenizer) as h:
        client = sdk(h.http_url)
        done = await client.responses.create(
            model="fake", input="hi", instructions="Be brief", temperature=0.5, top_p=0.9,
            extra_headers=rid("r1"),
        )  # fmt: skip
        items = await client.responses.create(
            model="fake",
            input=[
                {"role": "developer", "content": "Rules"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "hi"}],
                },
            ],
            extra_headers=rid("r2"),
        )
        cut = await client.responses.create(
            model="fake", input="hi", max_output_tokens=4, extra_headers=rid("r3")
        )
        await client.close()
    assert done.output_text == "Hello" and done.status == "completed"
    (item,) = done.output
    assert item.type == "message" and item.role == "assistant"
    system = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "hi"}]
    assert tokenizer.rendered[0] == system
    assert done.usage is not None
    assert (done.usage.input_tokens, done.usage.output_tokens) == (prompt_len(system), 6)
    assert done.id.startswith("resp") and done.instructions == "Be brief"
    assert tokenizer.rendered[1] == [
        {"role": "system", "content": "Rules"},
        {"role": "user", "content": "hi"},
    ]
    assert items.output_text == "Hi"
    assert cut.output_text == "Hell" and cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"


async def test_responses_streamed_events() -> None:
    """stream=True: response.created, in_progress, output_item.added, content_part.added,
    output_text.delta..., output_text.done, content_part.done, output_item.done,
    response.completed, numbered from 0; the deltas make the text of the final response."""
    runner = runner_saying(st=b"Hello there")
    async with serve_with(runner) as h:
        client = sdk(h.http_url)
        stream = await client.responses.create(
            model="fake", input="hi", stream=True, extra_headers=rid("st")
        )
        events = [event async for event in stream]
        await client.close()
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert text == final.output_text == "Hello there"


async def test_responses_function_tool_round_trip() -> None:
    """A forced function tool: a function_call item whose arguments fit the schema, whole
    and streamed; sent back as function_call + function_call_output items, the conversation
    is rendered as chat messages (the call as JSON, the output as a tool message) and
    answered in text."""
    runner = runner_saying(f3=b"Sunny")
    tokenizer = RecordingTokenizer()
    forced: Any = {"type": "function", "name": "weather"}
    async with serve_with(runner, tokenizer) as h:
        client = sdk(h.http_url)
        done = await client.responses.create(
            model="fake", input="weather?", tools=TOOLS, tool_choice=forced, temperature=1.0,
            max_output_tokens=200, extra_headers=rid("f1"),
        )  # fmt: skip
        (call,) = done.output
        assert call.type == "function_call" and call.name == "weather"
        assert call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        stream = await client.responses.create(
            model="fake", input="weather?", tools=TOOLS, tool_choice="required", stream=True,
            parallel_tool_calls=False, temperature=1.0, max_output_tokens=200,
        )  # fmt: skip
        events = [event async for event in stream]
        back = await client.responses.create(
            model="fake", tools=TOOLS, tool_choice="none", extra_headers=rid("f3"),
            input=[
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": call.call_id, "name": "weather",
                 "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id, "output": "22C"},
            ],
        )  # fmt: skip
        await client.close()
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    (streamed,) = events[-1].response.output  # type: ignore[union-attr]
    assert streamed.type == "function_call"
    jsonschema.validate(json.loads(streamed.arguments), WEATHER)
    fn = json.dumps([{"name": "weather", "arguments": call.arguments}])
    assert tokenizer.rendered[-1] == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": fn},
        {"role": "tool", "content": "22C"},
    ]
    assert back.output_text == "Sunny"


async def test_responses_json_schema_text_format() -> None:
    """text.format json_schema goes through the structured-output constraint: the text
    parses and fits the schema."""
    fmt: Any = {"format": {"type": "json_schema", "name": "w", "schema": WEATHER}}
    async with serve_with(runner_saying()) as h:
        client = sdk(h.http_url)
        done = await client.responses.create(
            model="fake", input="json", text=fmt, temperature=1.0, max_output_tokens=200
        )
        await client.close()
    jsonschema.validate(json.loads(done.output_text), WEATHER)


async def test_responses_refuses_state_and_unknown_fields() -> None:
    """previous_response_id and store: true are 400s that say no responses are stored;
    an unsupported tool type and an unknown field are 400s naming them."""
    async with serve_with(runner_saying()) as h:
        client = sdk(h.http_url)
        with pytest.raises(openai.BadRequestError, match="stores no responses"):
            await client.responses.create(model="fake", input="x", previous_response_id="r")
        with pytest.raises(
            openai.BadRequestError,
            match="store must be false or left out: this server stores no responses, got true",
        ):
            await client.responses.create(model="fake", input="x", store=True)
        with pytest.raises(openai.BadRequestError, match="only function tools"):
            await client.responses.create(model="fake", input="x", tools=[{"type": "web_search"}])
        with pytest.raises(openai.BadRequestError, match=r"unsupported field.*background"):
            await client.responses.create(model="fake", input="x", background=True)
        await client.close()
        async with httpx.AsyncClient(base_url=h.http_url) as http:
            ok = await http.post(
                "/v1/responses", json={"input": "x", "store": False, "max_output_tokens": 2}
            )
    assert ok.status_code == 200 and ok.json()["store"] is False


def serve_with(runner: Any, tokenizer: Any = None) -> Any:
    return serve(runner, tokenizer or ByteTokenizer(), http=True)


@pytest.mark.slow
async def test_same_greedy_text_through_chat_responses_and_messages() -> None:
    """The embedded SmolLM2 at temperature 0: chat completions, the Responses API (openai
    SDK) and the Messages API (anthropic SDK) give the same text for the same question."""
    import asyncio

    import anthropic

    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    built = await asyncio.to_thread(build_engine, build_config({"threads": 2}, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    await server.start("127.0.0.1", 0, http_port=0)
    question = "What is the capital of France?"
    name = built.model.name
    try:
        url = f"http://127.0.0.1:{server.http_port}"
        client = sdk(url)
        chat = await client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": question}], max_tokens=24,
            temperature=0,
        )  # fmt: skip
        response = await client.responses.create(
            model=name, input=question, max_output_tokens=24, temperature=0
        )
        await client.close()
        claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
        message = await claude.messages.create(
            model=name, max_tokens=24, messages=[{"role": "user", "content": question}],
            extra_body={"temperature": 0},
        )  # fmt: skip
        await claude.close()
    finally:
        await server.shutdown(grace_s=1)
    text = chat.choices[0].message.content
    assert text and "Paris" in text
    assert response.output_text == text
    assert [b.text for b in message.content if b.type == "text"] == [text]
