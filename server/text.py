"""The engine's text streams: ``model_runner.tokenizer.IncrementalDetokenizer`` per request.

It turns sampled ids into text deltas that never split a UTF-8 character and cuts the output
before a stop string (found across token boundaries; text that may still become one is held
back). The engine calls ``push`` once per step and ``flush`` when a request ends otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from model_runner.tokenizer import IncrementalDetokenizer
from scheduler.request import Request


def make_text_stream_factory(
    tokenizer: Any,
) -> Callable[[Request], IncrementalDetokenizer]:
    """The engine's ``TextStreamFactory`` for ``tokenizer`` (a ``Tokenizer`` or compatible:
    ``special_token_ids``, ``is_byte_level`` + ``token_bytes``, or ``decode``)."""

    def factory(request: Request) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(tokenizer, request.prompt_token_ids, request.sampling.stop)

    return factory
