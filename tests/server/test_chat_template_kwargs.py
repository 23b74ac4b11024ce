"""chat_template_kwargs (vLLM's field): from the OpenAI body and gRPC's ChatMessages to the
template, e.g. Qwen3's enable_thinking, and refused in one line when malformed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model_runner.gguf_vocab import byte_to_unicode
from model_runner.tokenizer import Tokenizer
from server.frontend import encode_chat
from server.openai.parse import parse_body
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError

QWEN3 = Path(__file__).resolve().parents[1] / "data" / "chat_templates" / "qwen3.jinja"
MESSAGES = [{"role": "user", "content": "Hi"}]
EMPTY_THINK = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3() -> Tokenizer:
    """Qwen3's template over a byte-level vocabulary of the 256 bytes (exact round trips)."""
    tokens = ["<|im_end|>", *byte_to_unicode().values()]
    return Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3] + [1] * 256,
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.chat_template": QWEN3.read_text(encoding="utf-8"),
        }
    )


def rendered(tok: Tokenizer, chat: pb.ChatMessages) -> str:
    return tok.decode(encode_chat(tok, chat, False))


@pytest.mark.parametrize("thinking", [False, True])
def test_openai_body_reaches_the_template(qwen3: Tokenizer, thinking: bool) -> None:
    """chat_template_kwargs.enable_thinking in a chat body switches Qwen3's think block."""
    body = {
        "model": "m",
        "messages": MESSAGES,
        "chat_template_kwargs": {"enable_thinking": thinking},
    }
    parsed = parse_body(body, True, "m")
    assert json.loads(parsed.request.chat.chat_template_kwargs) == {"enable_thinking": thinking}
    text = rendered(qwen3, parsed.request.chat)
    assert text.endswith(EMPTY_THINK) == (not thinking)
    assert text.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_grpc_chat_messages_field(qwen3: Tokenizer) -> None:
    """ChatMessages.chat_template_kwargs (JSON text) does the same on gRPC; empty: none."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    assert not rendered(qwen3, chat).endswith(EMPTY_THINK)
    chat.chat_template_kwargs = '{"enable_thinking": false}'
    assert rendered(qwen3, chat).endswith(EMPTY_THINK)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "must be a JSON object"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"messages": [], "tools": []}', "must not set messages, tools"),
    ],
)
def test_bad_kwargs_are_invalid_argument(qwen3: Tokenizer, value: str, message: str) -> None:
    """Not JSON, not an object, or a name the server sets: InvalidRequestError naming it."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])
    chat.chat_template_kwargs = value
    with pytest.raises(InvalidRequestError, match=message):
        encode_chat(qwen3, chat, False)


def test_openai_body_must_be_an_object() -> None:
    """chat_template_kwargs that is not an object is a 400 naming the field."""
    body: dict[str, Any] = {"model": "m", "messages": MESSAGES, "chat_template_kwargs": "x"}
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs must be an object"):
        parse_body(body, True, "m")


QWEN25 = QWEN3.parent / "qwen2_5.jinja"
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
}
TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def test_tool_call_history_reaches_a_template_that_renders_it(qwen3: Tokenizer) -> None:
    """An OpenAI body's assistant tool_calls (arguments as JSON text) and tool_call_id reach
    Qwen2.5's template as transformers renders them with the arguments as an object."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    template = QWEN25.read_text(encoding="utf-8")
    qwen25 = Tokenizer(qwen3.backend, chat_template=template)  # the same byte vocabulary
    parsed = parse_body({"model": "m", "messages": TOOL_HISTORY}, True, "m")
    mine = rendered(qwen25, parsed.request.chat)
    as_object = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    messages = [TOOL_HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [as_object]}]
    messages.append(TOOL_HISTORY[2])
    theirs = PreTrainedTokenizerFast(
        tokenizer_object=HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        chat_template=template,
    )
    assert mine == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in mine


def test_tool_call_history_without_a_template_for_it(qwen3: Tokenizer) -> None:
    """A template that renders no tool_calls (ChatML) sees the calls' JSON after the content."""
    parsed = parse_body({"model": "m", "messages": TOOL_HISTORY}, True, "m")
    chatml = Tokenizer(
        qwen3.backend,
        chat_template="{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}",
    )
    text = rendered(chatml, parsed.request.chat)
    assert text == (
        '[user]Weather?[assistant][{"name": "get_weather", "arguments": "{\\"city\\": '
        '\\"Z\\u00fcrich\\"}"}][tool]{"temp": 21}'
    )


def test_tool_calls_must_be_a_list_of_calls() -> None:
    """tool_calls that is not a list of objects is a 400 naming the message."""
    body = {"model": "m", "messages": [{"role": "assistant", "content": "", "tool_calls": "x"}]}
    with pytest.raises(InvalidRequestError, match=r"messages\[0\].tool_calls must be a list"):
        parse_body(body, True, "m")
