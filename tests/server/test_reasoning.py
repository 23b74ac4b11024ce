"""The reasoning parser and the thought budget, pure: ``<think>`` text split into (reasoning,
content) however it is cut into deltas; when the parser is on; the budget's continuation
(the engine stream faked by a function of the request)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator

import pytest

from scheduler.request import FinishReason, Request, SamplingParams
from server.openai.budget import CLOSE_TEXT, CONTINUATION_SUFFIX, budgeted
from server.openai.reasoning import (
    ThinkSplitter,
    opens_thought,
    reasoning_enabled,
    split_text,
)
from server.outputs import GenerationOutput

CASES = [
    # (generated text, the prompt opened the thought, reasoning, content)
    ("<think>\nplan it</think>\n\nHello", False, "plan it", "Hello"),
    ("  <think>a<b</think>c", False, "a<b", "c"),
    ("plan</think>\n\nHi <think> x", True, "plan", "Hi <think> x"),
    ("Hello <think>", False, "", "Hello <think>"),
    ("<think>never closed </thi", False, "never closed </thi", ""),
    ("still thinking", True, "still thinking", ""),
    ("<thin", False, "", "<thin"),
    ("", True, "", ""),
]


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_whole_split(text: str, inside: bool, reasoning: str, content: str) -> None:
    """A whole answer splits into its thought and its answer, the tags and the blanks after
    them dropped; no open tag: all content; an unclosed thought: all reasoning."""
    assert split_text(text, inside) == (reasoning, content)


@pytest.mark.parametrize(("text", "inside", "reasoning", "content"), CASES)
def test_any_cut_into_deltas_splits_the_same(
    text: str, inside: bool, reasoning: str, content: str
) -> None:
    """Cut into three deltas at every pair of places, the deltas join to the whole split,
    and no content delta carries a piece of a tag that the whole split drops."""
    for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2):
        splitter = ThinkSplitter(inside)
        parts = [splitter.feed(d) for d in (text[:i], text[i:j], text[j:])]
        parts.append(splitter.flush())
        assert "".join(r for r, _ in parts) == reasoning, (i, j)
        assert "".join(c for _, c in parts) == content, (i, j)
        if "<" not in content:
            assert not any("<" in c for _, c in parts), (i, j)


def test_when_the_parser_is_on() -> None:
    """auto: on when the chat template mentions <think>; think: always; none: never; the
    prompt opens the thought when it ends with <think> (blanks aside); a bad name is a
    ValueError naming the choices."""
    assert reasoning_enabled("auto", "{{ '<think>\\n' }}")
    assert not reasoning_enabled("auto", "{{ messages }}") and not reasoning_enabled("auto", None)
    assert reasoning_enabled("think", None) and not reasoning_enabled("none", "<think>")
    assert opens_thought("<|im_start|>assistant\n<think>\n")
    assert not opens_thought("<think>x</think>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="auto, none, think"):
        reasoning_enabled("deepseek", None)


def _engine(scripts: dict[str, tuple[list[int], FinishReason]], seen: list[Request]):  # type: ignore[no-untyped-def]
    """A fake engine stream: request id -> its tokens (one byte each) and how it ends,
    cut at the request's max_tokens (finish length)."""

    async def stream(request: Request) -> AsyncGenerator[GenerationOutput, None]:
        seen.append(request)
        tokens, reason = scripts[request.request_id]
        if len(tokens) >= request.sampling.max_tokens:
            tokens, reason = tokens[: request.sampling.max_tokens], FinishReason.LENGTH
        for k, token in enumerate(tokens):
            last = k == len(tokens) - 1
            yield GenerationOutput(
                "client", 0, [token], chr(token), finished=last,
                finish_reason=reason if last else None, num_prompt_tokens=3,
                num_output_tokens=len(tokens) if last else 0, closes_stream=last,
            )  # fmt: skip

    return stream


async def _run(scripts: dict[str, tuple[list[int], FinishReason]], budget: int, max_tokens: int):  # type: ignore[no-untyped-def]
    seen: list[Request] = []
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens))
    close = list(CLOSE_TEXT.encode())
    outs = [o async for o in budgeted(_engine(scripts, seen), request, budget, close)]
    return outs, seen


async def test_budget_forces_the_close_and_continues() -> None:
    """A thought that reaches its budget: the first request runs budget tokens, the close
    tag is forced, and the continuation (prompt + thought + close) answers with the rest of
    max_tokens; one stream, one end, the output tokens summed."""
    thought = list(b"<think>abcdefgh")
    scripts = {
        "r": (thought, FinishReason.STOP),
        "r" + CONTINUATION_SUFFIX: (list(b"Hi"), FinishReason.STOP),
    }
    outs, seen = await _run(scripts, budget=10, max_tokens=50)
    text = "".join(o.text for o in outs)
    assert text == "<think>abc" + CLOSE_TEXT + "Hi"
    assert split_text(text) == ("abc", "Hi")
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].closes_stream and outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].num_output_tokens == 10 + len(CLOSE_TEXT) + 2
    assert outs[-1].num_prompt_tokens == 3
    first, answer = seen
    assert first.sampling.max_tokens == 10
    assert answer.prompt_token_ids == [1, 2, 3, *thought[:10], *CLOSE_TEXT.encode()]
    assert answer.sampling.max_tokens == 50 - 10 - len(CLOSE_TEXT)


async def test_budget_not_reached_or_not_above_max_tokens() -> None:
    """A thought closed within the budget whose answer ends there: one request, nothing
    forced; a cut mid-answer continues without forcing; max_tokens at or under the budget:
    the request runs as it is."""
    done = list(b"<think>a</think>ok")
    outs, seen = await _run({"r": (done, FinishReason.STOP)}, budget=30, max_tokens=50)
    assert "".join(o.text for o in outs) == bytes(done).decode() and len(seen) == 1
    scripts = {
        "r": (done, FinishReason.STOP),
        "r" + CONTINUATION_SUFFIX: (list(b"!"), FinishReason.STOP),
    }
    outs, seen = await _run(scripts, budget=17, max_tokens=50)
    assert "".join(o.text for o in outs) == "<think>a</think>o!"
    assert seen[1].prompt_token_ids == [1, 2, 3, *done[:17]]
    outs, seen = await _run({"r": (list(b"<think>abc"), FinishReason.STOP)}, budget=5, max_tokens=5)
    assert "".join(o.text for o in outs) == "<thin" and len(seen) == 1
    assert outs[-1].finish_reason is FinishReason.LENGTH
