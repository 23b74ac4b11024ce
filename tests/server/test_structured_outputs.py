"""Structured outputs through both front ends on the fake runner: OpenAI's response_format,
vLLM's structured_outputs and guided_* fields, the gRPC constraint oneof, the openai SDK's
``parse`` with a Pydantic model, and bad constraints refused before they are queued."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Literal

import grpc
import httpx
import jsonschema
import openai
import pydantic

from model_runner.constraints import ConstraintCompiler, ConstraintTracker
from server.fake_tokenizer import ByteTokenizer
from tests.server.helpers import collect, make_fake_runner, serve

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["ok", "size", "count"],
    "additionalProperties": False,
}


def constrained_runner() -> Any:
    tracker = ConstraintTracker(ConstraintCompiler(ByteTokenizer()))
    return make_fake_runner(max_model_len=2048, constraints=tracker)


_ids = itertools.count()


def next_id() -> dict[str, str]:
    """A fixed request id per call (the fake runner's tokens depend on it): runs repeat."""
    return {"X-Request-Id": f"so-{next(_ids)}"}


async def post(url: str, body: dict[str, Any], chat: bool = True) -> httpx.Response:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(url + path, json={"model": "fake", **body}, headers=next_id())


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "go"}], "max_tokens": 80, **fields}


class Order(pydantic.BaseModel):
    ok: bool
    size: Literal["S", "M", "L"]


async def test_http_fields_constrain_the_output() -> None:
    """response_format json_schema / json_object, structured_outputs regex / choice and the
    guided_* aliases: each answer matches its constraint and ends with stop."""
    cases: list[tuple[dict[str, Any], Any]] = [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA),
        ),
        ({"structured_outputs": {"regex": "[0-9]{3}-x"}}, lambda t: re.fullmatch("[0-9]{3}-x", t)),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"guided_regex": "(ab)+c"}, lambda t: re.fullmatch("(ab)+c", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_grammar": 'start: "x" ("y" | "z")+ "."'}, lambda t: re.fullmatch("x[yz]+\\.", t)),
    ]  # fmt: skip
    async with serve(constrained_runner(), http=True) as h:
        for fields, check in cases:
            resp = await post(h.http_url, chat_body(temperature=1.0, **fields))
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["finish_reason"] == "stop", (fields, choice)
            text = choice["message"]["content"]
            assert check(text) is not False, (fields, text)
        # The completions endpoint takes them too.
        resp = await post(
            h.http_url, {"prompt": "x", "max_tokens": 20, "guided_choice": ["a1", "b2"]}, False
        )
        assert resp.json()["choices"][0]["text"] in ("a1", "b2")


def test_parse_body_maps_every_field_to_the_oneof() -> None:
    """Each HTTP field lands in the GenerateRequest's constraint oneof as documented."""
    from server.openai.parse import parse_body

    cases = [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
         "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"json": SCHEMA}}, "json_schema", json.dumps(SCHEMA)),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
        ({"structured_outputs": {"grammar": "start: /a+/"}}, "grammar", "start: /a+/"),
        ({"guided_json": '{"type": "string"}'}, "json_schema", '{"type": "string"}'),
        ({"guided_regex": "a+"}, "regex", "a+"),
    ]  # fmt: skip
    for fields, kind, value in cases:
        request = parse_body(chat_body(**fields), True, "fake").request
        assert request.WhichOneof("constraint") == kind, fields
        if kind is not None:
            assert getattr(request, kind) == value
    request = parse_body(chat_body(guided_choice=["a", "b"]), True, "fake").request
    assert list(request.choice.choices) == ["a", "b"]


async def test_openai_sdk_parse_with_a_pydantic_model() -> None:
    """``client.beta.chat.completions.parse(response_format=Order)`` returns a parsed Order."""
    async with serve(constrained_runner(), http=True) as h:
        client = openai.AsyncOpenAI(base_url=f"{h.http_url}/v1", api_key="x", max_retries=0)
        done = await client.beta.chat.completions.parse(
            model="fake", messages=[{"role": "user", "content": "order"}], response_format=Order,
            max_tokens=80, extra_headers=next_id(),
        )  # fmt: skip
        await client.close()
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Order)
    assert Order.model_validate_json(done.choices[0].message.content or "") == parsed


async def test_bad_constraints_get_400_with_the_reason_before_queueing() -> None:
    """An uncompilable regex, an invalid schema, two constraints, a bad response_format
    and ignore_eos with a constraint: 400 in OpenAI's error shape; nothing reaches the
    engine."""
    bad = [
        ({"guided_regex": "a[b"}, "unclosed character class"),
        ({"guided_json": {"type": "nope"}}, "Invalid type: nope"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "at most one constraint"),
        ({"response_format": {"type": "xml"}}, "response_format.type must be"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "schema is required"),
        ({"structured_outputs": {"regexp": "a"}}, "unsupported key(s) regexp"),
        ({"guided_regex": "a+", "ignore_eos": True}, "ignore_eos cannot be combined"),
    ]  # fmt: skip
    async with serve(constrained_runner(), http=True) as h:
        for fields, needle in bad:
            resp = await post(h.http_url, chat_body(**fields))
            assert resp.status_code == 400, (fields, resp.text)
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert needle in error["message"], (needle, error)
        assert h.scheduler.make_stats().num_prompt_tokens_total == 0  # none was admitted


async def test_grpc_constraint_oneof() -> None:
    """GenerateRequest's constraint oneof: regex and choice outputs match; an uncompilable
    regex and an empty choice list are INVALID_ARGUMENT with the reason."""
    async with serve(constrained_runner()) as h:
        text, last = await h.client.generate_text(
            "go", regex="[a-c]{4}!", max_tokens=20, temperature=1.0
        )
        assert re.fullmatch("[a-c]{4}!", text) and last.finish_reason == 1
        text, _ = await h.client.generate_text(
            "go", request_id="g2", choice=["alpha", "beta"], max_tokens=20
        )
        assert text in ("alpha", "beta")
        text, _ = await h.client.generate_text(
            "go", request_id="g3", json_schema=json.dumps(SCHEMA), max_tokens=80
        )
        jsonschema.validate(json.loads(text), SCHEMA)
        for options, needle in (
            ({"regex": "(a"}, "regex: invalid regex"),
            ({"choice": [""]}, "choice.choices"),
        ):
            try:
                await collect(h.client.generate("go", **options))
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert needle in (exc.details() or ""), exc.details()
            else:
                raise AssertionError(f"{options} was accepted")


async def test_server_without_constraints_refuses_them() -> None:
    """A runner without a tracker: a constrained request is a 400 that says so."""
    async with serve(make_fake_runner(max_model_len=512), http=True) as h:
        resp = await post(h.http_url, chat_body(guided_regex="a+"))
    assert resp.status_code == 400
    assert "does not run structured outputs" in resp.json()["error"]["message"]


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "parameters": TIME}},
]
SCHEMA_OF = {"weather": WEATHER, "time": TIME}


def check_calls(calls: Any, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


async def stream_calls(client: openai.AsyncOpenAI, **kwargs: Any) -> tuple[list[Any], str]:
    """The tool calls of a streamed answer, assembled as OpenAI documents (by index: the
    first delta carries id, type and name, later ones append arguments)."""
    calls: dict[int, dict[str, Any]] = {}
    reason = ""
    stream = await client.chat.completions.create(stream=True, **kwargs)
    async for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = delta.id or call["id"]
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        reason = choice.finish_reason or reason
    return [calls[i] for i in sorted(calls)], reason


async def test_tool_calls_named_and_required_whole_and_streamed() -> None:
    """tool_choice naming a function: one call to it, arguments valid, finish stop;
    "required": one or more calls among the tools, finish tool_calls; streamed answers
    assemble into the same shape."""
    async with serve(constrained_runner(), http=True, num_blocks=1024) as h:
        client = openai.AsyncOpenAI(base_url=f"{h.http_url}/v1", api_key="x", max_retries=0)
        common: dict[str, Any] = {
            "model": "fake", "messages": [{"role": "user", "content": "weather?"}],
            "tools": TOOLS, "max_tokens": 600, "temperature": 1.0, "extra_headers": next_id(),
        }  # fmt: skip
        named = {"type": "function", "function": {"name": "weather"}}
        done = await client.chat.completions.create(tool_choice=named, **common)
        message = done.choices[0].message
        assert message.content is None and done.choices[0].finish_reason == "stop"
        check_calls(message.tool_calls, {"weather"})
        assert len(message.tool_calls or []) == 1
        done = await client.chat.completions.create(tool_choice="required", **common)
        assert done.choices[0].finish_reason == "tool_calls"
        check_calls(done.choices[0].message.tool_calls, {"weather", "time"})
        one = await client.chat.completions.create(
            tool_choice="required", parallel_tool_calls=False, **common
        )
        assert len(one.choices[0].message.tool_calls or []) == 1
        for choice, names, want in (
            (named, {"weather"}, "stop"),
            ("required", set(SCHEMA_OF), "tool_calls"),
        ):
            calls, reason = await stream_calls(client, tool_choice=choice, **common)
            assert reason == want and calls
            for call in calls:
                assert call["id"].startswith("call_") and call["name"] in names
                jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])
        await client.close()


async def test_sdk_parse_with_a_pydantic_function_tool() -> None:
    """``parse`` with ``openai.pydantic_function_tool(Weather)`` forced by name: the call's
    ``parsed_arguments`` is a Weather."""

    class Weather(pydantic.BaseModel):
        city: Literal["Paris", "Rome"]
        days: int = pydantic.Field(ge=1, le=7)

    async with serve(constrained_runner(), http=True) as h:
        client = openai.AsyncOpenAI(base_url=f"{h.http_url}/v1", api_key="x", max_retries=0)
        done = await client.beta.chat.completions.parse(
            model="fake", messages=[{"role": "user", "content": "weather?"}], max_tokens=100,
            tools=[openai.pydantic_function_tool(Weather)],
            tool_choice={"type": "function", "function": {"name": "Weather"}},
            extra_headers=next_id(),
        )  # fmt: skip
        await client.close()
    (call,) = done.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, Weather)


async def test_tool_requests_refused_with_the_reason() -> None:
    """tool_choice auto (and tools without tool_choice), a tool_choice without tools, an
    unknown function, tools next to another constraint: 400 naming the problem."""
    named = {"type": "function", "function": {"name": "nope"}}
    bad = [
        ({"tools": TOOLS}, 'tool_choice "auto"'),
        ({"tools": TOOLS, "tool_choice": "auto"}, 'tool_choice "auto"'),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": named}, "not in tools (weather, time)"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "at most one"),
        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0] must be"),
    ]
    async with serve(constrained_runner(), http=True) as h:
        for fields, needle in bad:
            resp = await post(h.http_url, chat_body(**fields))
            assert resp.status_code == 400, (fields, resp.text)
            assert needle in resp.json()["error"]["message"], (needle, resp.text)
        # tool_choice none: the tools are ignored, a plain answer.
        resp = await post(h.http_url, chat_body(tools=TOOLS, tool_choice="none", max_tokens=3))
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]


async def test_prometheus_counts_constrained_requests_compiles_and_mask_time() -> None:
    """Two requests with one schema and one with a regex, then one unconstrained: 3
    constrained requests, 2 compiles, 1 cache hit, and mask time observed on the steps that
    had constrained rows."""
    from prometheus_client import CollectorRegistry

    from metrics.prometheus import PrometheusSink
    from tests.metrics.helpers import value

    registry = CollectorRegistry()
    async with serve(constrained_runner()) as h:
        h.engine.sink = h.server.servicer.sink = PrometheusSink(registry)
        schema = json.dumps(SCHEMA)
        for rid, options in (
            ("m1", {"json_schema": schema}), ("m2", {"json_schema": schema}),
            ("m3", {"regex": "[a-c]{4}"}), ("m4", {}),
        ):  # fmt: skip
            await h.client.generate_text("go", request_id=rid, max_tokens=60, **options)
        await h.client.generate_text("go", request_id="m5", max_tokens=2)  # a step after m4
    assert value(registry, "kvserve_constrained_requests_total") == 3
    assert value(registry, "kvserve_constraint_compiles_total") == 2
    assert value(registry, "kvserve_constraint_cache_hits_total") == 1
    assert value(registry, "kvserve_step_constraint_mask_seconds_count") > 0
    assert value(registry, "kvserve_step_constraint_mask_seconds_sum") > 0


async def test_stop_string_ends_a_constrained_request_and_drops_its_state() -> None:
    """A stop string inside the constrained text ("zx" in xyzxyzQ) ends the request with
    stop and the text before it; the runner drops the matcher at the next step."""
    runner = constrained_runner()
    async with serve(runner) as h:
        text, last = await h.client.generate_text(
            "go", request_id="st", regex="xyzxyzQ", stop="zx", max_tokens=20
        )
        assert (text, last.finish_reason) == ("xy", 1)
        await h.client.generate_text("go", request_id="after", max_tokens=2)
    assert len(runner.constraints) == 0


async def test_tool_answer_cut_by_a_stop_string_is_text() -> None:
    """A stop string inside forced tool calls leaves no calls to parse: the answer is the
    text before it, finish stop, whole and streamed."""
    body = chat_body(tools=TOOLS, tool_choice="required", stop=['"name"'])
    async with serve(constrained_runner(), http=True) as h:
        resp = await post(h.http_url, body)
        streamed = await post(h.http_url, {**body, "stream": True})
    choice = resp.json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "[{"}
    assert choice["finish_reason"] == "stop"
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:7] == "{"]
    deltas = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "[{"
    assert deltas[-1]["finish_reason"] == "stop"


class HermesTokenizer(ByteTokenizer):
    """The byte tokenizer behind a chat template that renders tools in the Hermes format
    (only its text is read, to detect the format): it puts the tools before the chat."""

    chat_template = "{% if tools %}<tools>{{ tools }}</tools> reply with <tool_call>{% endif %}"

    def __init__(self) -> None:
        self.rendered_tools: list[Any] = []

    def apply_chat_template(
        self, messages: Any, add_generation_prompt: bool = True, **extra: object
    ) -> str:
        tools = extra.get("tools")
        self.rendered_tools.append(tools)
        chat = super().apply_chat_template(messages, add_generation_prompt)
        return (f"<tools>{json.dumps(tools)}</tools>\n" if tools else "") + chat


async def test_tool_choice_auto_on_a_hermes_template() -> None:
    """A template that renders tools gets them; the model's <tool_call> blocks become
    tool_calls (the text around them the content), whole and streamed; an answer without
    a call is plain content with finish stop."""
    from tests.server.helpers import engine_id

    call = {"name": "weather", "arguments": {"city": "Rome", "unit": "C", "days": 2}}
    said = f"Checking.<tool_call>\n{json.dumps(call)}\n</tool_call>"
    runner = constrained_runner()
    for rid in ("auto1", "auto2"):
        runner.set_script(engine_id(rid), [*said.encode(), 257])
    runner.set_script(engine_id("auto3"), [*b"Hello", 257])
    tokenizer = HermesTokenizer()
    body = chat_body(tools=TOOLS, max_tokens=300)  # tool_choice left out: auto
    async with serve(runner, tokenizer, http=True) as h, httpx.AsyncClient(timeout=30) as client:
        url = h.http_url + "/v1/chat/completions"
        whole = await client.post(url, json=body, headers={"X-Request-Id": "auto1"})
        streamed = await client.post(
            url, json={**body, "stream": True}, headers={"X-Request-Id": "auto2"}
        )
        plain = await client.post(url, json=body, headers={"X-Request-Id": "auto3"})
    assert tokenizer.rendered_tools[0] == TOOLS
    choice = whole.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    (got,) = choice["message"]["tool_calls"]
    assert got["function"]["name"] == "weather"
    assert json.loads(got["function"]["arguments"]) == call["arguments"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:7] == "{"]
    last = [e["choices"][0] for e in events if e["choices"]][-1]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] == "Checking."
    assert last["delta"]["tool_calls"][0]["function"]["name"] == "weather"
    assert plain.json()["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert plain.json()["choices"][0]["finish_reason"] == "stop"
