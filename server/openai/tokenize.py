"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (pure: no server).

``/tokenize`` takes a ``prompt`` (``add_special_tokens`` default true) or chat ``messages``
(rendered with the model's template as chat completions renders them;
``add_generation_prompt`` default true, ``add_special_tokens`` default false) and answers
``{"count", "max_model_len", "tokens"}`` (``return_token_strs``: and ``token_strs``).
``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``. ``model`` may name the served
model or an adapter (adapters share the tokenizer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.frontend import ServerTokenizer, encode_chat
from server.openai.fields import TOKEN_ID
from server.openai.parse import known_fields, parse_body, shown
from server.rpc import generation_pb2 as pb
from server.validation import InvalidRequestError, check_token_ids

_BOOL = {"type": "boolean"}
TOKENIZE_FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string"},
    "prompt": {"type": "string"},
    "messages": {"type": "array", "items": {"type": "object"}, "minItems": 1},
    "add_generation_prompt": _BOOL,
    "add_special_tokens": _BOOL,
    "return_token_strs": _BOOL,
}
DETOKENIZE_FIELDS: dict[str, dict[str, Any]] = {
    "model": {"type": "string"},
    "tokens": {"type": "array", "items": TOKEN_ID},
}


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    """A /tokenize body read: a text prompt or chat messages, and how to tokenize it."""

    text: str | None
    chat: pb.ChatMessages | None
    add_special_tokens: bool
    return_token_strs: bool


def _check(body: Any, fields: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    body = known_fields(body, fields, path)
    for key, schema in fields.items():
        value = body.get(key)
        if schema.get("type") == "boolean" and value is not None and not isinstance(value, bool):
            raise InvalidRequestError(f"{key} must be true or false, got {shown(value)}")
    return body


def parse_tokenize(body: Any, model_name: str, adapters: Sequence[str] = ()) -> TokenizeRequest:
    body = _check(body, TOKENIZE_FIELDS, "/tokenize")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("send one of prompt (a string) or messages (chat messages)")
    strs = body.get("return_token_strs") is True
    if prompt is not None:
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be a string, got {shown(prompt)}")
        _model(body, model_name, adapters)
        return TokenizeRequest(prompt, None, body.get("add_special_tokens") is not False, strs)
    # The chat form is read as chat completions reads messages (model names checked there).
    chat = {"model": body.get("model"), "messages": messages}
    request = parse_body(chat, True, model_name, None, adapters).request
    if body.get("add_generation_prompt") is not None:
        request.chat.add_generation_prompt = body["add_generation_prompt"]
    return TokenizeRequest(None, request.chat, body.get("add_special_tokens") is True, strs)


def _model(body: Mapping[str, Any], model_name: str, adapters: Sequence[str]) -> None:
    parse_body({"model": body.get("model"), "prompt": "x"}, False, model_name, None, adapters)


def tokenize(request: TokenizeRequest, tokenizer: ServerTokenizer) -> list[int]:
    """The request's token ids; blocking (the caller runs it in a thread)."""
    if request.chat is not None:
        return encode_chat(tokenizer, request.chat, request.add_special_tokens)
    return list(tokenizer.encode(request.text or "", request.add_special_tokens))


def tokenize_answer(
    ids: list[int], max_model_len: int, request: TokenizeRequest, tokenizer: ServerTokenizer
) -> dict[str, Any]:
    answer: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
    if request.return_token_strs:
        answer["token_strs"] = [tokenizer.id_to_token(t) or "" for t in ids]
    return answer


def parse_detokenize(
    body: Any, model_name: str, vocab_size: int, adapters: Sequence[str] = ()
) -> list[int]:
    body = _check(body, DETOKENIZE_FIELDS, "/detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens
    ):
        raise InvalidRequestError(f"tokens must be a list of token ids, got {shown(tokens)}")
    _model(body, model_name, adapters)
    return check_token_ids(tokens, vocab_size, "tokens")
