"""Reasoning output over HTTP against a live server: a scripted fake model that thinks in
``<think>…</think>`` and then answers, through chat completions (reasoning_content), the
Responses API (a reasoning item) and the Messages API (a thinking block), whole and streamed
(the byte tokenizer: every tag arrives split across tokens); the thought budget cut at its
length; the refusals."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import anthropic
import httpx
import openai
import pytest

from server.fake_tokenizer import EOS_TOKEN_ID, ByteTokenizer
from server.openai.budget import CLOSE_TEXT, CONTINUATION_SUFFIX
from tests.server.helpers import engine_id, make_fake_runner, serve

THOUGHT = b"<think>\nLet me see.</think>\n\nHello there"
USER = [{"role": "user", "content": "hi"}]


class ThinkingTokenizer(ByteTokenizer):
    """The byte tokenizer with a reasoning model's template: it mentions <think> (the
    parser's auto-detection) and, with ``opens``, ends the generation prompt with it."""

    chat_template = "{% if enable_thinking %}<think>\n{% endif %}"

    def __init__(self, opens: bool = False) -> None:
        self.opens = opens

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        text = super().apply_chat_template(messages, add_generation_prompt, **extra)
        return text + ("<think>\n" if self.opens and add_generation_prompt else "")


def runner_saying(scripts: Mapping[str, bytes]) -> Any:
    """A fake runner whose engine request ``rid`` says ``scripts[rid]`` then EOS (a key
    ending in ``CONTINUATION_SUFFIX`` scripts a budget's continuation)."""
    runner = make_fake_runner(max_model_len=1024)
    for rid, said in scripts.items():
        base = rid.removesuffix(CONTINUATION_SUFFIX)
        runner.set_script(engine_id(base) + rid[len(base) :], [*said, EOS_TOKEN_ID])
    return runner


@contextlib.asynccontextmanager
async def http_to(runner: Any, tokenizer: Any, **options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client of a live server over ``runner`` (``options``: the server's)."""
    async with (
        serve(runner, tokenizer, http=True, server_options=options) as h,
        httpx.AsyncClient(base_url=h.http_url) as http,
    ):
        yield http


def rid(name: str) -> dict[str, str]:
    return {"X-Request-Id": name}


def chat(**body: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": USER, **body}


async def _chat_stream(http: httpx.AsyncClient, name: str, **body: Any) -> list[dict[str, Any]]:
    """The deltas of a streamed chat completion."""
    deltas = []
    async with http.stream(
        "POST", "/v1/chat/completions", json=chat(stream=True, **body), headers=rid(name)
    ) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                deltas.extend(c["delta"] for c in json.loads(line[6:])["choices"])
    return deltas


@pytest.mark.parametrize("opens", [False, True])
async def test_chat_reasoning_content_whole_and_streamed(opens: bool) -> None:
    """Auto-detected from the template: the thought is reasoning_content and the answer
    content, whole and streamed (no delta carries a piece of a tag); a template that opens
    the thought itself: the output starts inside it."""
    said = THOUGHT.removeprefix(b"<think>\n") if opens else THOUGHT
    runner = runner_saying({"w": said, "s": said})
    async with http_to(runner, ThinkingTokenizer(opens)) as http:
        whole = await http.post("/v1/chat/completions", json=chat(), headers=rid("w"))
        deltas = await _chat_stream(http, "s")
    message = whole.json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Let me see.", "Hello there")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content") or "" for d in deltas) == "Hello there"
    assert sum("reasoning_content" in d for d in deltas) > 1
    assert not any("<" in (d.get("content") or "") + d.get("reasoning_content", "") for d in deltas)


async def test_parser_flag_and_completions() -> None:
    """--reasoning-parser none: the thought stays in content and no reasoning_content key;
    think (on a template without <think>): split; /v1/completions is never split."""
    said = {"n": THOUGHT, "t": THOUGHT, "c": THOUGHT}
    async with http_to(runner_saying(said), ThinkingTokenizer(), reasoning_parser="none") as http:
        off = (await http.post("/v1/chat/completions", json=chat(), headers=rid("n"))).json()
    async with http_to(runner_saying(said), ByteTokenizer(), reasoning_parser="think") as http:
        on = (await http.post("/v1/chat/completions", json=chat(), headers=rid("t"))).json()
        body = {"model": "fake", "prompt": "hi", "max_tokens": 100}
        text = (await http.post("/v1/completions", json=body, headers=rid("c"))).json()
    assert off["choices"][0]["message"] == {"role": "assistant", "content": THOUGHT.decode()}
    assert on["choices"][0]["message"]["reasoning_content"] == "Let me see."
    assert text["choices"][0]["text"] == THOUGHT.decode()


async def test_responses_reasoning_item_whole_and_streamed() -> None:
    """Responses: a reasoning item (reasoning_text content) before the message item, whole;
    streamed, the reasoning item's events at output_index 0 come first and its
    reasoning_text deltas make its text; the message is output_index 1."""
    runner = runner_saying({"w": THOUGHT, "s": THOUGHT})
    async with serve(runner, ThinkingTokenizer(), http=True) as h:
        client = openai.AsyncOpenAI(base_url=f"{h.http_url}/v1", api_key="x", max_retries=0)
        done = await client.responses.create(model="fake", input="hi", extra_headers=rid("w"))
        stream = await client.responses.create(
            model="fake", input="hi", stream=True, extra_headers=rid("s")
        )
        events = [e async for e in stream]
        await client.close()
    reasoning, _ = done.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert [c.text for c in reasoning.content] == ["Let me see."]
    assert done.output_text == "Hello there"
    kinds = [e.type for e in events]
    n = kinds.count("response.reasoning_text.delta")
    assert n > 1 and kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[4 : 4 + n + 3] == [
        *["response.reasoning_text.delta"] * n, "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    assert thought == "Let me see."
    texts = [e for e in events if e.type == "response.output_text.delta"]
    assert {e.output_index for e in texts} == {1}
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == "Hello there" and final.output[0].type == "reasoning"
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_messages_thinking_block_whole_and_streamed() -> None:
    """Messages: a thinking block before the text block, whole; streamed, thinking_delta
    events in block 0 (closed with a signature_delta) and text in block 1; thinking enabled
    with budget_tokens is accepted."""
    runner = runner_saying({"w": THOUGHT, "s": THOUGHT})
    thinking: Any = {"type": "enabled", "budget_tokens": 500}
    async with serve(runner, ThinkingTokenizer(), http=True) as h:
        client = anthropic.AsyncAnthropic(base_url=h.http_url, api_key="x", max_retries=0)
        done = await client.messages.create(
            model="fake", max_tokens=200, messages=USER, thinking=thinking,  # type: ignore[arg-type]
            extra_headers=rid("w"),
        )  # fmt: skip
        async with client.messages.stream(
            model="fake",
            max_tokens=200,
            messages=USER,
            extra_headers=rid("s"),  # type: ignore[arg-type]
        ) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_message()
        await client.close()
    think, text = done.content
    assert think.type == "thinking" and think.thinking == "Let me see."
    assert text.type == "text" and text.text == "Hello there"
    deltas = [e for e in events if e.type == "content_block_delta"]
    thinking_deltas = [e for e in deltas if e.delta.type == "thinking_delta"]
    assert len(thinking_deltas) > 1 and {e.index for e in thinking_deltas} == {0}
    assert "".join(e.delta.thinking for e in thinking_deltas) == "Let me see."  # type: ignore[union-attr]
    assert {e.index for e in deltas if e.delta.type == "text_delta"} == {1}
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == "Hello there"  # type: ignore[union-attr]


async def test_budget_cuts_the_thought_in_all_three_apis() -> None:
    """max_thinking_tokens (chat, whole and streamed), thinking.budget_tokens (Messages) and
    reasoning.effort minimal (Responses, 256 tokens): the thought ends at its budget (the
    open tag counts), the close is forced, and the continuation's answer follows; usage
    counts the thought, the forced close and the answer."""
    long = b"<think>\n" + b"x" * 400 + b"</think>never said"
    names = ["c", "s", "m", "r"]
    scripts = {**{n: long for n in names}, **{n + CONTINUATION_SUFFIX: b"Answer" for n in names}}
    async with http_to(runner_saying(scripts), ThinkingTokenizer()) as http:
        whole = await http.post(
            "/v1/chat/completions", json=chat(max_thinking_tokens=20), headers=rid("c")
        )
        deltas = await _chat_stream(http, "s", max_thinking_tokens=20)
        body = {"model": "fake", "max_tokens": 900, "messages": USER,
                "thinking": {"type": "enabled", "budget_tokens": 30}}  # fmt: skip
        message = await http.post("/v1/messages", json=body, headers=rid("m"))
        body = {"model": "fake", "input": "hi", "reasoning": {"effort": "minimal"}}
        response = await http.post("/v1/responses", json=body, headers=rid("r"))
    answer = whole.json()
    assert answer["choices"][0]["message"]["reasoning_content"] == "x" * 12
    assert answer["choices"][0]["message"]["content"] == "Answer"
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 20 + len(CLOSE_TEXT) + len("Answer") + 1
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "x" * 12
    assert "".join(d.get("content") or "" for d in deltas) == "Answer"
    blocks = message.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text"]
    assert (blocks[0]["thinking"], blocks[1]["text"]) == ("x" * 22, "Answer")
    items = response.json()["output"]
    assert items[0]["content"][0]["text"] == "x" * (256 - 8)
    assert items[1]["content"][0]["text"] == "Answer"


async def test_refusals() -> None:
    """A budget without a reasoning parser is a 400 naming --reasoning-parser; a bad
    reasoning_effort, a budget with n > 1, a bad thinking object and budget_tokens < 1 are
    400s saying what is allowed."""
    async with http_to(runner_saying({}), ByteTokenizer()) as http:
        off = await http.post("/v1/chat/completions", json=chat(max_thinking_tokens=5))
    async with http_to(runner_saying({}), ThinkingTokenizer()) as http:
        effort = await http.post("/v1/chat/completions", json=chat(reasoning_effort="max"))
        n = await http.post("/v1/chat/completions", json=chat(max_thinking_tokens=5, n=2))
        base = {"model": "fake", "max_tokens": 9, "messages": USER}
        kind = await http.post("/v1/messages", json={**base, "thinking": {"type": "on"}})
        zero = await http.post(
            "/v1/messages", json={**base, "thinking": {"type": "enabled", "budget_tokens": 0}}
        )
    assert off.status_code == 400 and "--reasoning-parser think" in off.json()["error"]["message"]
    assert effort.status_code == 400
    assert (
        "reasoning_effort must be one of minimal, low, medium, high, got 'max'"
        in (effort.json()["error"]["message"])
    )
    assert n.status_code == 400 and "n = 1, got n = 2" in n.json()["error"]["message"]
    assert kind.status_code == 400 and "thinking must be" in kind.json()["error"]["message"]
    assert zero.status_code == 400
    assert "budget_tokens must be an integer >= 1" in zero.json()["error"]["message"]
