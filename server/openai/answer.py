"""Engine outputs -> OpenAI's JSON answers and server-sent events (pure: no server).

``Answer`` builds one request's response: whole (``whole`` over ``Choices``) or as stream
chunks (``chunks`` per engine output, ``usage_chunk`` last). A tool-call answer's text
becomes ``tool_calls`` here (``split_tool_calls``), as the request's ``ToolCalls`` says.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

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


class Choices:
    """Per-sample text, logprobs and finish reason of a non-streamed answer, and the usage."""

    def __init__(self) -> None:
        self.texts: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[Any]] = {}
        self.finish: dict[int, str | None] = {}
        self.stop_reason: dict[int, int | str | None] = {}  # the stop string / token id
        self.usage = Usage()

    def add(self, out: GenerationOutput) -> None:
        self.texts.setdefault(out.index, []).append(out.text)
        self.logprobs.setdefault(out.index, []).extend(out.logprobs)
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
    ) -> None:
        self.id = request_id
        self.chat = chat
        self.parsed = parsed
        self.created = int(time.time())
        self.model = model_name
        self.started: set[int] = set()
        self.usage = Usage(num_prompt_tokens=num_prompt_tokens)
        self._token = token
        self._tool_text: dict[int, list[str]] = {}  # streamed tool-call text per choice

    def _logprobs(self, lps: Iterable[Any]) -> dict[str, Any] | None:
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
        return {
            "tokens": [self._token(lp.token_id) for lp in lps],
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self._token(t): p for t, p in lp.top} for lp in lps],
        }

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
                content, calls = (
                    split_tool_calls(tools, text)
                    if tools is not None and finish == "stop"
                    else (text, None)
                )
                if tools is not None and calls is not None:
                    item["message"] = {"role": "assistant", "content": content, "tool_calls": calls}
                    finish = tools.finish_reason
            else:
                item["text"] = text
            item["logprobs"] = self._logprobs(choices.logprobs[index])
            item["finish_reason"] = finish
            items.append(item)
        body["choices"] = items
        body["usage"] = choices.usage.body()
        return body

    def chunks(self, out: GenerationOutput) -> list[str]:
        """The SSE events for one engine output (chat opens each choice with its role)."""
        events = []
        if self.chat and out.index not in self.started:
            self.started.add(out.index)
            events.append(self._chunk(out.index, {"role": "assistant", "content": ""}))
        reason = finish_reason(out)
        if out.finished:
            self.usage.add(out)
        if self.chat and self.parsed.tool_calls is not None:
            return events + self._tool_chunks(out, self.parsed.tool_calls, reason)
        if out.text or out.logprobs or reason is not None:
            delta = {"content": out.text} if out.text else {}
            events.append(
                self._chunk(out.index, delta if self.chat else out.text, out.logprobs, reason)
            )
        return events

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
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish_reason
        body["choices"] = [choice]
        if self.parsed.include_usage:
            body["usage"] = None
        return sse(body)

    def usage_chunk(self) -> dict[str, Any]:
        body = self._base(chunk=True)
        body["choices"] = []
        body["usage"] = self.usage.body()
        return body


class Writer(Protocol):
    """How one API writes one request's answer: whole from ``Choices``, or as the stream's
    server-sent events (``events`` per engine output, ``end`` after the last one, ``failed``
    for an error after the first event). Chat completions' is ``ChatWriter``; the Responses
    and Messages APIs have theirs (``server.openai.responses``, ``server.openai.anthropic``)."""

    def whole(self, choices: Choices) -> dict[str, Any]: ...

    def events(self, out: GenerationOutput) -> list[str]: ...

    def end(self) -> list[str]: ...

    def failed(self, error: HttpError) -> list[str]: ...


class ChatWriter:
    """``Writer`` of /v1/completions and /v1/chat/completions over ``Answer``."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer

    def whole(self, choices: Choices) -> dict[str, Any]:
        return self.answer.whole(choices)

    def events(self, out: GenerationOutput) -> list[str]:
        return self.answer.chunks(out)

    def end(self) -> list[str]:
        usage = [sse(self.answer.usage_chunk())] if self.answer.parsed.include_usage else []
        return [*usage, "data: [DONE]\n\n"]

    def failed(self, error: HttpError) -> list[str]:
        return [sse(error_body(error.message, error.kind, error.param)), "data: [DONE]\n\n"]
