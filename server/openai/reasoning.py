"""Reasoning output: a ``<think>…</think>`` model's thought apart from its answer (pure).

Qwen3, QwQ and the DeepSeek-R1 distills write their thought between ``<think>`` and
``</think>``, then the answer. ``ThinkSplitter`` cuts the generated text into (reasoning,
content) deltas as it streams, never letting a tag out as content, even split across
tokens (a tail that may begin a tag is held back until the next delta decides it)::

    "<thi" "nk>\\nLet me" " see</th" "ink>\\n\\nHi"
     ----   reasoning "Let me" " see" ----   content "Hi"

Some templates open the thought themselves (the generation prompt ends with ``<think>``,
DeepSeek-R1's and QwQ's): the output then starts inside it (``inside=True``). A thought
never closed is all reasoning (the answer was cut off); an output that does not start with
``<think>`` (after blanks) is all content. The blanks right after either tag are dropped.

When the parser is on (``--reasoning-parser``): ``think`` always, ``none`` never, ``auto``
(the default) when the chat template mentions ``<think>`` (``reasoning_enabled``).
"""

from __future__ import annotations

import dataclasses

from server.outputs import GenerationOutput

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("auto", "none", "think")
# reasoning_effort -> the thought's budget in tokens (OpenAI's levels; the numbers are ours).
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384}


def reasoning_enabled(parser: str, chat_template: str | None) -> bool:
    """Whether answers are split (see the module docstring)."""
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}")
    if parser == "auto":
        return bool(chat_template) and OPEN in str(chat_template)
    return parser == "think"


def opens_thought(prompt_tail: str) -> bool:
    """Whether a prompt (its decoded tail) leaves the model inside a thought: it ends with
    ``<think>``, blanks aside."""
    return prompt_tail.rstrip().endswith(OPEN)


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may begin ``tag`` (held back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ThinkSplitter:
    """One sample's text -> (reasoning, content) deltas; see the module docstring."""

    def __init__(self, inside: bool = False) -> None:
        self.state = "thought" if inside else "start"  # start -> thought -> answer
        self._buffer = ""
        self._strip = inside  # drop the blanks that open the next part

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that ``text`` (the next delta) makes safe to send."""
        self._buffer += text
        reasoning, content = [], []
        while True:
            buffer = self._buffer
            if self.state == "start":
                stripped = buffer.lstrip()
                if stripped.startswith(OPEN):
                    self._buffer = stripped[len(OPEN) :]
                    self.state, self._strip = "thought", True
                    continue
                if OPEN.startswith(stripped):  # blanks, or the tag's beginning: wait
                    break
                self.state = "answer"
                continue
            if self.state == "thought":
                if self._strip:
                    buffer = self._buffer = buffer.lstrip()
                    if not buffer:
                        break
                    self._strip = False
                end = buffer.find(CLOSE)
                if end >= 0:
                    reasoning.append(buffer[:end])
                    self._buffer = buffer[end + len(CLOSE) :]
                    self.state, self._strip = "answer", True
                    continue
                keep = _held(buffer, CLOSE)
                reasoning.append(buffer[: len(buffer) - keep])
                self._buffer = buffer[len(buffer) - keep :]
                break
            if self._strip:
                buffer = buffer.lstrip()
                self._strip = not buffer
            content.append(buffer)
            self._buffer = ""
            break
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        """What is held back, at the end of the sample."""
        buffer, self._buffer = self._buffer, ""
        if self.state == "thought":
            return buffer, ""
        return "", buffer if self.state == "answer" or buffer.strip() else ""


def split_text(text: str, inside: bool = False) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    splitter = ThinkSplitter(inside)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.flush()
    return reasoning + more_reasoning, content + more_content


class Reasoning:
    """The splitters of one request's samples: each output's reasoning delta, and the output
    with its text cut down to the content."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self._splitters: dict[int, ThinkSplitter] = {}

    def split(self, out: GenerationOutput) -> tuple[GenerationOutput, str]:
        """(``out`` with its text the content delta, the reasoning delta)."""
        splitter = self._splitters.setdefault(out.index, ThinkSplitter(self.inside))
        reasoning, content = splitter.feed(out.text)
        if out.finished:
            more_reasoning, more_content = splitter.flush()
            reasoning, content = reasoning + more_reasoning, content + more_content
        return dataclasses.replace(out, text=content), reasoning
