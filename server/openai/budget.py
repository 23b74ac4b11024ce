"""A thought's budget: at ``budget`` output tokens, close the thought and go on to the answer.

The engine is not changed: the request runs with ``max_tokens`` = the budget; when it ends
there (finish "length") with its thought still open, the close tag's tokens are forced by a
continuation, a second engine request whose prompt is the first's prompt, its output and the
close tag, for the rest of ``max_tokens``. The prefix cache holds the first's KV, so the
continuation computes only the close tag before it decodes. The client sees one answer::

    | prompt | thought (budget tokens) | </think>\\n\\n (forced) | answer ... |
             '------- request 1 -------'                         '- request 2 -'

A thought closed within the budget that the cut ends mid-answer continues the same way,
nothing forced. The forced tokens count as output tokens (they carry no logprobs). The
budget counts the output from its first token (``<think>`` itself, when the model opens
the thought). One sample only (n = 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Callable

from scheduler.request import FinishReason, Request
from server.openai.reasoning import CLOSE
from server.outputs import GenerationOutput

CLOSE_TEXT = CLOSE + "\n\n"  # what a forced close says (Qwen3's and R1's own close)
CONTINUATION_SUFFIX = "~answer"  # the continuation's request id: the first's, and this

Stream = Callable[[Request], AsyncGenerator[GenerationOutput, None]]


# What a request asks (not the scheduler's progress on it): a continuation starts afresh.
_ASKED = (
    "request_id", "prompt_token_ids", "sampling", "eos_token_ids", "priority",
    "arrival_time_s", "cache_salt", "lora", "tenant", "ttft_slo_s", "itl_slo_s",
)  # fmt: skip


def _fresh(request: Request, **changes: object) -> Request:
    """A new request asking what ``request`` asks, with ``changes``."""
    asked: dict[str, object] = {name: getattr(request, name) for name in _ASKED}
    asked["prompt_token_ids"] = list(request.prompt_token_ids)
    return Request(**{**asked, **changes})  # type: ignore[arg-type]


def with_budget(request: Request, budget: int) -> Request | None:
    """``request`` cut at ``budget`` output tokens; None when its own limit is not above."""
    sampling = request.sampling
    if sampling.max_tokens <= budget:
        return None
    cut = dataclasses.replace(
        sampling, max_tokens=budget, min_tokens=min(sampling.min_tokens, budget)
    )
    return _fresh(request, sampling=cut)


async def budgeted(
    stream: Stream, request: Request, budget: int, close_ids: list[int]
) -> AsyncGenerator[GenerationOutput, None]:
    """The outputs of ``request`` with its thought cut at ``budget`` tokens (see the module
    docstring); ``close_ids``: the close tag's tokens (``CLOSE_TEXT`` encoded)."""
    first = with_budget(request, budget)
    if first is None:
        async with contextlib.aclosing(stream(request)) as outputs:
            async for out in outputs:
                yield out
        return
    text: list[str] = []
    ids: list[int] = []
    last: GenerationOutput | None = None
    async with contextlib.aclosing(stream(first)) as outputs:
        async for out in outputs:
            text.append(out.text)
            ids.extend(out.token_ids)
            if out.finished and out.finish_reason is FinishReason.LENGTH:
                last = out
                break
            yield out
    if last is None:
        return
    forced = [] if CLOSE in "".join(text) else close_ids
    used = len(ids) + len(forced)
    yield dataclasses.replace(
        last, finished=False, finish_reason=None, stop_reason=None, closes_stream=False
    )
    if forced:
        yield GenerationOutput(last.request_id, 0, list(forced), CLOSE_TEXT)
    remaining = request.sampling.max_tokens - used
    if remaining <= 0:
        yield dataclasses.replace(
            last, token_ids=[], text="", logprobs=[], num_output_tokens=used, closes_stream=True
        )
        return
    sampling = request.sampling
    rest = dataclasses.replace(
        sampling, max_tokens=remaining, min_tokens=max(0, sampling.min_tokens - used)
    )
    answer = _fresh(
        request,
        request_id=request.request_id + CONTINUATION_SUFFIX,
        prompt_token_ids=[*request.prompt_token_ids, *ids, *forced],
        sampling=rest,
    )
    async with contextlib.aclosing(stream(answer)) as outputs:
        async for out in outputs:
            if out.finished:
                out = dataclasses.replace(
                    out,
                    num_prompt_tokens=last.num_prompt_tokens,
                    num_cached_tokens=last.num_cached_tokens,
                    num_output_tokens=used + out.num_output_tokens,
                )
            yield dataclasses.replace(out, request_id=last.request_id)
