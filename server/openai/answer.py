"""Engine outputs -> OpenAI's JSON answers and server-sent events (pure: no server).

``Answer`` builds one request's response: whole (``whole`` over ``Choices``) or as stream
chunks (``chunks`` per engine output, ``usage_chunk`` last). A tool-call answer's text
becomes ``tool_calls`` here (``split_tool_calls``), as the request's ``ToolCalls`` says.

Completions' ``echo`` puts the prompt (``Echo``) before the text and, with ``logprobs``, its
tokens before the generated ones in the legacy logprobs object, the first without a logprob::

    tokens          | p0   | p1  | ... | p(P-1) | g0 | g1 ...
    token_logprobs  | null | lp  | ... | lp     | lp | lp
    top_logprobs    | null | {top n and the token itself}  | {top n} ...

``score_only`` (echo with max_tokens 0) answers the prompt alone, finish_reason "length".
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from scheduler.output import TokenLogprobs
from scheduler.request import FinishReason
from server.openai.fields import HttpError, error_body
from server.openai.parse import Parsed
from server.openai.tools import ToolCalls
from server.outputs import GenerationOutput

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def finish_reason(out: GenerationOutput) -> str | None:
    """OpenAI's ``finish_reason`` of an output: None until the sample ends."""
    if not out.finished:
        return None
    return (out.finish_reason or FinishReason.ERROR).value


@dataclass(slots=True)
class Usage:
    """Token counts of one answer (the samples' outputs summed, the prompt's once)."""

    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    def add(self, out: GenerationOutput) -> None:
        """Count a finished sample's last output."""
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        self.num_output_tokens += out.num_output_tokens

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


@dataclass(frozen=True, slots=True)
class Echo:
    """The prompt an echo answer starts with: its text and its token ids."""

    text: str
    token_ids: Sequence[int]


class Choices:
    """Per-sample text, logprobs and finish reason of a non-streamed answer, and the usage."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.prompt_logprobs: dict[int, list[TokenLogprobs]] = {}
        self.finish: dict[int, str | None] = {}
        self.stop_reason: dict[int, int | str | None] = {}  # the stop string / token id
        self.reasoning: dict[int, list[str]] = {}  # a reasoning model's thought, apart
        self.usage = Usage()

    def add(self, out: GenerationOutput, reasoning: str = "") -> None:
        """Add one output (its text the answer's content) and the thought's ``reasoning``."""
        self.texts.setdefault(out.index, []).append(out.text)
        self.reasoning.setdefault(out.index, []).append(reasoning)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[out.index] = out.prompt_logprobs
        if out.finished:
            self.finish[out.index] = finish_reason(out)
            self.stop_reason[out.index] = out.stop_reason
            self.usage.add(out)


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One entry of OpenAI's ``tool_calls``, with a fresh call id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def split_tool_calls(calls: ToolCalls, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, tool_calls) of a finished answer's ``text``: no calls -> (text, None)."""
    try:
        if calls.auto:
            found = [json.loads(m) for m in _HERMES_CALL.findall(text)]
            if not found:
                return text, None
            content = _HERMES_CALL.sub("", text).strip() or None
            return content, [tool_call(c["name"], json.dumps(c["arguments"])) for c in found]
        if calls.name is not None:
            json.loads(text)
            return None, [tool_call(calls.name, text)]
        return None, [tool_call(c["name"], json.dumps(c["arguments"])) for c in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return text, None


def _scored(reason: str | None) -> str | None:
    """A scored prompt's finish reason: "length" (max_tokens 0) once its token is out,
    unless it failed or was aborted."""
    return "length" if reason in ("stop", "length") else reason


def sse(obj: Mapping[str, Any]) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class Answer:
    """Builds one request's response objects (whole, or as stream chunks)."""

    def __init__(
        self,
        parsed: Parsed,
        chat: bool,
        request_id: str,
        model_name: str,
        num_prompt_tokens: int,
        token: Callable[[int], str],
        echo: Echo | None = None,
        piece: Callable[[int], str] | None = None,
    ) -> None:
        """``token``: a token id's string in ``tokens``; ``piece``: its decoded text, whose
        length advances ``text_offset`` (default ``token``); ``echo``: the prompt, when the
        request echoes it."""
        self.id = request_id
        self.chat = chat
        self.parsed = parsed
        self.created = int(time.time())
        self.model = model_name
        self.started: set[int] = set()
        self.usage = Usage(num_prompt_tokens=num_prompt_tokens)
        self._token = token
        self._tool_text: dict[int, list[str]] = {}  # streamed tool-call text per choice
        self.echo = echo if parsed.echo else None
        self._piece = piece or token
        self._offsets: dict[int, int] = {}  # completions: text_offset reached, per choice
        self._echoed: set[int] = set()  # streamed choices whose prompt went out

    def _logprobs(
        self,
        lps: Iterable[Any],
        index: int = 0,
        prompt: Sequence[TokenLogprobs] | None = None,
    ) -> dict[str, Any] | None:
        """The logprobs object of ``lps``; completions' has ``prompt``'s scores first (an
        echo, see the module docstring)."""
        lps = list(lps)
        if not self.parsed.logprobs:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self._token(lp.token_id).encode()),
                        "top_logprobs": [
                            {
                                "token": self._token(t),
                                "logprob": p,
                                "bytes": list(self._token(t).encode()),
                            }
                            for t, p in lp.top
                        ],
                    }
                    for lp in lps
                ]
            }
        body: dict[str, list[Any]] = {
            "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []
        }  # fmt: skip
        if prompt is not None and self.echo is not None:
            self._add_prompt(body, index, prompt, self.echo)
        tok = self._token
        offset = self._offsets.get(index, 0)
        for lp in lps:
            body["tokens"].append(tok(lp.token_id))
            body["token_logprobs"].append(lp.logprob)
            body["top_logprobs"].append({tok(t): p for t, p in lp.top})
            body["text_offset"].append(offset)
            offset += len(self._piece(lp.token_id))
        self._offsets[index] = offset
        return body

    def _add_prompt(
        self, body: dict[str, list[Any]], index: int, prompt: Sequence[TokenLogprobs], echo: Echo
    ) -> None:
        """The echoed prompt's tokens: the first has no logprob; each other's top ones
        include the token itself (as vLLM's). The generated tokens' offsets follow the
        prompt's text."""
        tok = self._token
        offset = 0
        if echo.token_ids:
            body["tokens"].append(tok(echo.token_ids[0]))
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            body["text_offset"].append(0)
            offset += len(self._piece(echo.token_ids[0]))
        for lp in prompt:
            top = {tok(t): p for t, p in lp.top}
            top.setdefault(tok(lp.token_id), lp.logprob)
            body["tokens"].append(tok(lp.token_id))
            body["token_logprobs"].append(lp.logprob)
            body["top_logprobs"].append(top)
            body["text_offset"].append(offset)
            offset += len(self._piece(lp.token_id))
        self._offsets[index] = len(echo.text)

    def _vllm_prompt_logprobs(self, prompt: Sequence[TokenLogprobs]) -> list[Any]:
        """vLLM's ``prompt_logprobs``: null for the first token, then per token
        ``{token_id: {logprob, rank, decoded_token}}`` for it and its position's top ones."""
        scored: list[Any] = [None]
        for lp in prompt:
            entry = {
                str(t): {"logprob": p, "rank": rank, "decoded_token": self._token(t)}
                for rank, (t, p) in enumerate(lp.top, start=1)
            }
            entry.setdefault(
                str(lp.token_id),
                {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self._token(lp.token_id)},
            )
            scored.append(entry)
        return scored

    def _base(self, chunk: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, choices: Choices) -> dict[str, Any]:
        body = self._base(chunk=False)
        items = []
        tools = self.parsed.tool_calls
        for index in sorted(choices.texts):
            text = "".join(choices.texts[index])
            item: dict[str, Any] = {"index": index}
            finish = choices.finish.get(index)
            if self.chat:
                item["message"] = {"role": "assistant", "content": text}
                if self.parsed.reasoning:
                    thought = "".join(choices.reasoning.get(index, [])) or None
                    item["message"]["reasoning_content"] = thought
                content, calls = (
                    split_tool_calls(tools, text)
                    if tools is not None and finish == "stop"
                    else (text, None)
                )
                if tools is not None and calls is not None:
                    item["message"].update(content=content, tool_calls=calls)
                    finish = tools.finish_reason
                item["logprobs"] = self._logprobs(choices.logprobs[index])
            else:
                prompt = choices.prompt_logprobs.get(index, [])
                generated = choices.logprobs[index]
                if self.parsed.score_only:
                    text, generated, finish = "", [], _scored(finish)
                if self.echo is not None:
                    text = self.echo.text + text
                item["text"] = text
                item["logprobs"] = self._logprobs(generated, index, prompt)
                if self.parsed.prompt_logprobs:
                    item["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt)
            item["finish_reason"] = finish
            items.append(item)
        body["choices"] = items
        body["usage"] = self._usage_body(choices.usage)
        return body

    def _usage_body(self, usage: Usage) -> dict[str, Any]:
        """The usage; a prompt scored only generated nothing the client sees."""
        if self.parsed.score_only:
            usage = Usage(usage.num_prompt_tokens, usage.num_cached_tokens, 0)
        return usage.body()

    def chunks(self, out: GenerationOutput, reasoning: str = "") -> list[str]:
        """The SSE events for one engine output (chat opens each choice with its role; a
        thought's ``reasoning`` goes in ``reasoning_content`` deltas)."""
        events = []
        if self.chat and out.index not in self.started:
            self.started.add(out.index)
            events.append(self._chunk(out.index, {"role": "assistant", "content": ""}))
        if self.chat and reasoning:
            events.append(self._chunk(out.index, {"reasoning_content": reasoning}))
        reason = finish_reason(out)
        if out.finished:
            self.usage.add(out)
        if self.chat and self.parsed.tool_calls is not None:
            return events + self._tool_chunks(out, self.parsed.tool_calls, reason)
        if not self.chat and (self.echo is not None or self.parsed.prompt_logprobs):
            return events + self._echo_chunks(out, reason)
        if out.text or out.logprobs or reason is not None:
            delta = {"content": out.text} if out.text else {}
            events.append(
                self._chunk(out.index, delta if self.chat else out.text, out.logprobs, reason)
            )
        return events

    def _echo_chunks(self, out: GenerationOutput, reason: str | None) -> list[str]:
        """A streamed completion that echoes or scores its prompt: the prompt (text, scores)
        goes first, in the choice's first chunk."""
        text, lps = out.text, out.logprobs
        if self.parsed.score_only:
            text, lps, reason = "", [], _scored(reason)
        prompt: list[TokenLogprobs] | None = None
        if out.index not in self._echoed:
            self._echoed.add(out.index)
            prompt = out.prompt_logprobs or []
            if self.echo is not None:
                text = self.echo.text + text
        if not (text or lps or prompt is not None or reason is not None):
            return []
        body = self._base(chunk=True)
        choice: dict[str, Any] = {"index": out.index, "text": text}
        choice["logprobs"] = self._logprobs(lps, out.index, prompt)
        if prompt is not None and self.parsed.prompt_logprobs:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt)
        choice["finish_reason"] = reason
        body["choices"] = [choice]
        if self.parsed.include_usage:
            body["usage"] = None
        return [sse(body)]

    def _tool_chunks(
        self, out: GenerationOutput, tools: ToolCalls, reason: str | None
    ) -> list[str]:
        """A streamed tool-call answer. A named function's arguments stream as they come
        (the first delta opens the call with its id and name); "required" calls come whole
        when the sample ends (their names are only known then)."""
        buffered = self._tool_text.setdefault(out.index, [])
        buffered.append(out.text)
        events = []
        if tools.name is not None and out.text:
            fn: dict[str, Any] = {"arguments": out.text}
            call: dict[str, Any] = {"index": 0, "function": fn}
            if len(buffered) == 1 or not "".join(buffered[:-1]):
                call = {"index": 0, **tool_call(tools.name, out.text)}
            events.append(self._chunk(out.index, {"tool_calls": [call]}, out.logprobs))
        if reason is None:
            return events
        delta: dict[str, Any] = {}
        text = "".join(buffered)
        content, calls = split_tool_calls(tools, text) if reason == "stop" else (text, None)
        if tools.name is None and content:
            delta["content"] = content  # auto's text around the calls, or no calls after all
        if calls is not None:
            reason = tools.finish_reason
            if tools.name is None:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        events.append(self._chunk(out.index, delta, (), reason))
        return events

    def _chunk(
        self,
        index: int,
        content: Any,
        logprobs: Iterable[Any] = (),
        finish_reason: str | None = None,
    ) -> str:
        body = self._base(chunk=True)
        choice: dict[str, Any] = {"index": index}
        choice["delta" if self.chat else "text"] = content
        choice["logprobs"] = self._logprobs(logprobs, index)
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        if self.parsed.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self) -> dict[str, Any]:
        body = self._base(chunk=True)
        body["choices"] = []
        body["usage"] = self._usage_body(self.usage)
        return body


class Writer(Protocol):
    """How one API writes one request's answer: whole from ``Choices``, or as the stream's
    server-sent events (``events`` per engine output, with its thought's text apart when the
    reasoning parser is on, ``end`` after the last one, ``failed`` for an error after the
    first event). Chat completions' is ``ChatWriter``; the Responses
    and Messages APIs have theirs (``server.openai.responses``, ``server.openai.anthropic``)."""

    def whole(self, choices: Choices) -> dict[str, Any]: ...

    def events(self, out: GenerationOutput, reasoning: str = "") -> list[str]: ...

    def end(self) -> list[str]: ...

    def failed(self, error: HttpError) -> list[str]: ...


class ChatWriter:
    """``Writer`` of /v1/completions and /v1/chat/completions over ``Answer``."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    def whole(self, choices: Choices) -> dict[str, Any]:
        return self.answer.whole(choices)

    def events(self, out: GenerationOutput, reasoning: str = "") -> list[str]:
        return self.answer.chunks(out, reasoning)

    def end(self) -> list[str]:
        usage = [sse(self.answer.usage_chunk())] if self.answer.parsed.include_usage else []
        return [*usage, "data: [DONE]\n\n"]

    def failed(self, error: HttpError) -> list[str]:
        return [sse(error_body(error.message, error.kind, error.param)), "data: [DONE]\n\n"]
