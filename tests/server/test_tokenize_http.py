"""POST /tokenize and /detokenize in vLLM's shapes; hostile bodies on every route the
Responses, Messages and tokenize APIs added (4xx with a message, never 5xx, and the server
keeps serving); and their streams' error events."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from server.fake_tokenizer import BOS_TOKEN_ID, ByteTokenizer
from tests.server.helpers import (
    MAX_MODEL_LEN,
    assert_idle_and_sound,
    make_fake_runner,
    serve,
    serve_in_thread,
)

CHAT = [{"role": "user", "content": "hi"}]


async def test_tokenize_detokenize_round_trip() -> None:
    """A prompt's ids (BOS by default, not with add_special_tokens false), its count and the
    context length; the chat form is the template's rendering (generation prompt by default);
    detokenize gives the text back; an adapter-less unknown model is a 404."""
    tok = ByteTokenizer()
    async with serve(http=True) as h, httpx.AsyncClient(base_url=h.http_url) as http:
        plain = (await http.post("/tokenize", json={"model": "fake", "prompt": "héllo"})).json()
        bare = await http.post(
            "/tokenize",
            json={"prompt": "hi", "add_special_tokens": False, "return_token_strs": True},
        )
        chat = (await http.post("/tokenize", json={"messages": CHAT})).json()
        no_gen = await http.post(
            "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
        )
        back = await http.post("/detokenize", json={"model": "fake", "tokens": plain["tokens"]})
        unknown = await http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    ids = [BOS_TOKEN_ID, *"héllo".encode()]
    assert plain == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids}
    assert bare.json() == {
        "count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": [104, 105], "token_strs": ["h", "i"]
    }  # fmt: skip
    assert chat["tokens"] == list(tok.apply_chat_template(CHAT).encode())
    assert no_gen.json()["tokens"] == list(tok.apply_chat_template(CHAT, False).encode())
    assert back.json() == {"prompt": "<s>héllo"}
    assert unknown.status_code == 404 and "does not exist" in unknown.json()["error"]["message"]


MESSAGE = {"model": "fake", "max_tokens": 4, "messages": CHAT}
HOSTILE: list[tuple[str, Any]] = [
    ("/tokenize", {}),
    ("/tokenize", {"prompt": 5}),
    ("/tokenize", {"prompt": "x", "messages": CHAT}),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}),
    ("/tokenize", [1, 2]),
    ("/detokenize", {"tokens": [1, -1]}),
    ("/detokenize", {"tokens": [10**30]}),
    ("/detokenize", {"tokens": "abc"}),
    ("/detokenize", {"tokens": [True]}),
    ("/detokenize", {"tokens": [300]}),
    ("/v1/responses", {}),
    ("/v1/responses", {"input": 3}),
    ("/v1/responses", {"input": []}),
    ("/v1/responses", {"input": [{"type": "reasoning"}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
    ("/v1/responses", {"input": [None]}),
    ("/v1/responses", {"input": "x", "max_output_tokens": "many"}),
    ("/v1/responses", {"input": "x", "max_output_tokens": 10**6}),
    ("/v1/responses", {"input": "x", "temperature": -1}),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema"}}}),
    ("/v1/responses", {"input": "x", "text": "json"}),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function"}]}),
    ("/v1/responses", {"input": "x", "tools": "all"}),
    ("/v1/responses", {"input": "x", "tool_choice": {"type": "function"}}),
    ("/v1/responses", {"input": "x", "metadata": [1]}),
    ("/v1/responses", {"input": [{"type": "function_call", "name": 3}]}),
    ("/v1/responses", {"input": ["x"] * 50_000}),
    ("/v1/messages", {}),
    ("/v1/messages", {**MESSAGE, "max_tokens": None}),
    ("/v1/messages", {**MESSAGE, "max_tokens": "4"}),
    ("/v1/messages", {**MESSAGE, "messages": []}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "system", "content": "x"}]}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": 7}]}),
    ("/v1/messages", {**MESSAGE, "system": 7}),
    ("/v1/messages", {**MESSAGE, "system": [{"type": "text"}]}),
    ("/v1/messages", {**MESSAGE, "stop_sequences": "x"}),
    ("/v1/messages", {**MESSAGE, "top_k": -3}),
    ("/v1/messages", {**MESSAGE, "tools": [{"input_schema": {}}]}),
    ("/v1/messages", {**MESSAGE, "tools": [{"name": "f", "input_schema": []}]}),
    ("/v1/messages", {**MESSAGE, "tool_choice": {"type": "any"}}),
    ("/v1/messages", {**MESSAGE, "tools": [{"name": "f", "input_schema": {}}]}),
    ("/v1/messages", {**MESSAGE, "tools": [{"name": "f"}], "tool_choice": {"type": "tool"}}),
    ("/v1/messages", {**MESSAGE, "tools": [{"name": "f"}], "tool_choice": "any"}),
    ("/v1/messages", {**MESSAGE, "thinking": {"type": "enabled", "budget_tokens": 0}}),
    ("/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": "x"}] * 100_000}),
    ("/v1/messages/count_tokens", {"model": "fake"}),
    ("/v1/messages/count_tokens", {"model": "fake", "messages": CHAT, "max_tokens": 3}),
    ("/v1/messages/count_tokens", {"model": 1, "messages": CHAT}),
]


@pytest.fixture(scope="module")
def server() -> Any:
    with serve_in_thread(http=True) as h:
        yield h


@pytest.mark.parametrize(
    ("path", "body"), HOSTILE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(HOSTILE)]
)
def test_hostile_bodies_are_4xx_and_the_server_keeps_serving(
    server: Any, path: str, body: Any
) -> None:
    """A missing field, a wrong type, an unsupported part or a huge array: a 4xx whose body
    carries a message, then the next request on the same route is served."""
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        bad = http.post(path, json=body)
        assert 400 <= bad.status_code < 500, (bad.status_code, bad.text)
        shape = bad.json()
        message = shape["error"]["message"]
        assert message and (shape.get("type") == "error") == path.startswith("/v1/messages")
        good = {
            "/tokenize": {"prompt": "x"},
            "/detokenize": {"tokens": [104]},
            "/v1/responses": {"input": "x", "max_output_tokens": 2},
            "/v1/messages": MESSAGE,
            "/v1/messages/count_tokens": {"model": "fake", "messages": CHAT},
        }[path]
        assert http.post(path, json=good).status_code == 200
    assert_idle_and_sound(server)


@pytest.mark.parametrize(
    ("path", "body", "event", "error"),
    [
        ("/v1/responses", {"input": "x", "max_output_tokens": 500}, "error",
         {"code": "service_unavailable"}),
        ("/v1/messages", {"model": "fake", "max_tokens": 500, "messages": CHAT}, "error",
         {"type": "error", "error": {"type": "overloaded_error"}}),
    ],
)  # fmt: skip
async def test_a_stream_cut_off_at_shutdown_ends_with_its_apis_error_event(
    path: str, body: dict[str, Any], event: str, error: dict[str, Any]
) -> None:
    """A Responses or Messages stream still running when the grace period ends ends with
    its API's error event (no completed / message_stop event), naming the cut-off."""
    runner = make_fake_runner(max_model_len=1024, sleep_s=0.01)
    async with serve(runner, http=True) as h, httpx.AsyncClient(base_url=h.http_url) as http:
        lines: list[str] = []
        async with http.stream("POST", path, json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                lines.append(line)
                if len(lines) == 1:
                    shutdown = asyncio.create_task(h.server.shutdown(grace_s=0.1))
        await shutdown
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names[-1] == event and names.count(event) == 1
    assert not {"response.completed", "message_stop"} & set(names)
    last = json.loads([line for line in lines if line.startswith("data: ")][-1][6:])
    for key, value in error.items():
        got = last[key]
        assert got == value if not isinstance(value, dict) else value.items() <= got.items()
    message = last["message"] if "message" in last else last["error"]["message"]
    assert "was cut off: the server shut down" in message
