"""The OpenAPI document of the HTTP front, served at ``GET /openapi.json``.

Request bodies are written from ``fields``' tables, the ones its parser reads
(a field, its type and its integer range have one home); responses follow the builders there
(``Answer``, ``error_body``). ``tests/server/test_openapi.py`` checks the parser against it, and
schemathesis checks a live server against it.
"""

from __future__ import annotations

from typing import Any

from server.openai.anthropic import (
    COUNT_FIELDS,
    COUNT_REQUIRED,
    MESSAGES_FIELDS,
    MESSAGES_REQUIRED,
)
from server.openai.fields import CHAT_FIELDS, COMPLETION_FIELDS, REQUIRED_FIELDS
from server.openai.responses import RESPONSES_FIELDS, RESPONSES_REQUIRED
from server.openai.tokenize import DETOKENIZE_FIELDS, TOKENIZE_FIELDS

_NULL = {"type": "null"}
_INT = {"type": "integer"}
_STR = {"type": "string"}


# One server-sent event (OpenAPI 3.1: a text/event-stream schema describes each event): its
# data is a JSON chunk of the answer, or [DONE] at the end.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": _STR, "event": _STR, "id": _STR, "retry": {"type": "integer"}},
    "required": ["data"],
}


def _obj(properties: dict[str, Any], *, optional: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": [k for k in properties if k not in optional],
    }


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, _NULL]}


def request_schema(chat: bool) -> dict[str, Any]:
    """A completions (or chat) body: the parser's fields; any other field must be blank
    (null, false, {} or []: what SDKs send for a field they leave unset), else a 400."""
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    return body_schema(fields, REQUIRED_FIELDS[chat], others={"enum": [None, False, {}, []]})


def body_schema(
    fields: dict[str, Any], required: tuple[str, ...], others: dict[str, Any] = _NULL
) -> dict[str, Any]:
    """A body of ``fields`` (null for one left out); any other field must match ``others``
    (a Responses / Messages / tokenize body: null), else a 400."""
    return {
        "type": "object",
        "properties": {
            name: schema if name in required else _nullable(schema)
            for name, schema in fields.items()
        },
        "required": list(required),
        "additionalProperties": others,
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


_USAGE = _obj(
    {
        "prompt_tokens": _INT,
        "completion_tokens": _INT,
        "total_tokens": _INT,
        "prompt_tokens_details": _obj({"cached_tokens": _INT}),
    }
)
_FINISH = _nullable({"enum": ["stop", "length", "abort", "error", "tool_calls"]})
_LOGPROBS = _nullable({"type": "object"})
_TOOL_CALL = _obj(
    {
        "id": _STR,
        "type": {"enum": ["function"]},
        "function": _obj({"name": _STR, "arguments": _STR}),
    }
)


def _completion(chat: bool) -> dict[str, Any]:
    content = (
        {
            "message": _obj(
                {
                    "role": {"enum": ["assistant"]},
                    "content": _nullable(_STR),  # null when the answer is tool calls
                    "tool_calls": {"type": "array", "items": _TOOL_CALL},
                },
                optional=("tool_calls",),
            )
        }
        if chat
        else {"text": _STR}
    )
    choice = _obj({"index": _INT, **content, "logprobs": _LOGPROBS, "finish_reason": _FINISH})
    return _obj(
        {
            "id": _STR,
            "object": {"enum": ["chat.completion" if chat else "text_completion"]},
            "created": _INT,
            "model": _STR,
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        }
    )


_ERROR = _obj(
    {"error": _obj({"message": _STR, "type": _STR, "param": _nullable(_STR), "code": _NULL})}
)
_MODELS = _obj(
    {
        "object": {"enum": ["list"]},
        "data": {
            "type": "array",
            "items": _obj(
                {
                    "id": _STR,
                    "object": {"enum": ["model"]},
                    "created": _INT,
                    "owned_by": _STR,
                    "max_model_len": _INT,
                    "meta": _obj({"n_vocab": _INT, "n_ctx": _INT}),
                }
            ),
        },
    }
)

# Failures a generation can meet, by HTTP status (``fields``' module docstring).
_GENERATION_ERRORS = {
    "400": "invalid request: the message names the field and what to change",
    "401": "no API key, or a wrong one",
    "404": "the model is not the one served",
    "409": "a request with this X-Request-Id is running, or the stream stalled",
    "413": "the body is over --max-request-bytes",
    "429": "the waiting queue is full: retry later",
    "503": "the server is shutting down",
    "504": "the request's deadline passed",
}


def _errors(codes: dict[str, str]) -> dict[str, Any]:
    return {
        code: {
            "description": what,
            "content": {"application/json": {"schema": _ref("Error")}},
        }
        for code, what in codes.items()
    }


def _generation(chat: bool) -> dict[str, Any]:
    name = "ChatCompletion" if chat else "Completion"
    return {
        "post": {
            "operationId": "createChatCompletion" if chat else "createCompletion",
            "summary": "chat completion" if chat else "text completion",
            "parameters": [
                {
                    "name": "X-Request-Id",
                    "in": "header",
                    "required": False,
                    "description": "the request's id (<= 256 characters; default: generated)",
                    "schema": {"type": "string", "maxLength": 256},
                }
            ],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(f"{name}Request")}},
            },
            "responses": {
                "200": {
                    "description": "the answer, whole or (stream: true) as server-sent events",
                    "content": {
                        "application/json": {"schema": _ref(name)},
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                },
                **_errors(_GENERATION_ERRORS),
            },
        }
    }


_RESPONSE = _obj(
    {
        "id": _STR,
        "object": {"enum": ["response"]},
        "status": {"enum": ["completed", "incomplete"]},
        "output": {"type": "array", "items": {"type": "object"}},
        "usage": _obj({"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT}),
    }
)
_MESSAGE = _obj(
    {
        "id": _STR,
        "type": {"enum": ["message"]},
        "role": {"enum": ["assistant"]},
        "content": {"type": "array", "items": {"type": "object"}},
        "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
        "usage": _obj({"input_tokens": _INT, "output_tokens": _INT}),
    }
)
_ANTHROPIC_ERROR = _obj(
    {"type": {"enum": ["error"]}, "error": _obj({"type": _STR, "message": _STR})}
)
_TOKENIZED = _obj(
    {"count": _INT, "max_model_len": _INT, "tokens": {"type": "array", "items": _INT}}
)
# Failures of a request that only reads the tokenizer.
_TOKENIZER_ERRORS = {
    "400": "invalid request: the message names the field and what to change",
    "401": "no API key, or a wrong one",
    "404": "the model is not the one served",
    "413": "the body is over --max-request-bytes",
}


def _post(
    operation: str, what: str, request: str, answer: dict[str, Any], errors: dict[str, str],
    error: str = "Error", stream: bool = False,
) -> dict[str, Any]:  # fmt: skip
    content: dict[str, Any] = {"application/json": {"schema": answer}}
    if stream:
        content["text/event-stream"] = {"schema": _SSE_EVENT}
    responses = {
        code: {"description": why, "content": {"application/json": {"schema": _ref(error)}}}
        for code, why in errors.items()
    }
    return {
        "post": {
            "operationId": operation,
            "summary": what,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": {"description": what, "content": content}, **responses},
        }
    }


def _new_paths() -> dict[str, Any]:
    """The Responses, Messages and tokenize routes."""
    errors = _GENERATION_ERRORS
    return {
        "/v1/responses": _post(
            "createResponse", "a response (OpenAI's Responses API)", "ResponseRequest",
            _ref("Response"), errors, stream=True,
        ),
        "/v1/messages": _post(
            "createMessage", "a message (Anthropic's Messages API)", "MessageRequest",
            _ref("Message"), errors, "AnthropicError", stream=True,
        ),
        "/v1/messages/count_tokens": _post(
            "countMessageTokens", "the prompt's token count", "CountTokensRequest",
            _obj({"input_tokens": _INT}), _TOKENIZER_ERRORS, "AnthropicError",
        ),
        "/tokenize": _post(
            "tokenize", "a prompt's or chat's token ids", "TokenizeRequest", _TOKENIZED,
            _TOKENIZER_ERRORS,
        ),
        "/detokenize": _post(
            "detokenize", "token ids' text", "DetokenizeRequest", _obj({"prompt": _STR}),
            _TOKENIZER_ERRORS,
        ),
    }  # fmt: skip


def openapi_document(model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``OpenAIFront`` serving ``model_name``."""
    json_response = {"application/json": {"schema": {"type": "object"}}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kvserve OpenAI-compatible API",
            "version": "1",
            "description": f"Serves the model {model_name!r}. With API keys on, every path "
            "but /health and /openapi.json needs 'Authorization: Bearer KEY' (or "
            "'x-api-key: KEY').",
        },
        "paths": {
            "/health": {
                "get": {
                    "operationId": "health",
                    "responses": {
                        "200": {
                            "description": "serving",
                            "content": {"application/json": {"schema": _obj({"status": _STR})}},
                        },
                        "503": {
                            "description": "shutting down",
                            "content": {"application/json": {"schema": _obj({"status": _STR})}},
                        },
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "responses": {
                        "200": {"description": "this document", "content": json_response}
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "responses": {
                        "200": {
                            "description": "the served model",
                            "content": {"application/json": {"schema": _ref("ModelList")}},
                        },
                        **_errors({"401": "no API key, or a wrong one"}),
                    },
                }
            },
            "/v1/completions": _generation(chat=False),
            "/v1/chat/completions": _generation(chat=True),
            **_new_paths(),
        },
        "components": {
            "schemas": {
                "CompletionRequest": request_schema(chat=False),
                "ChatCompletionRequest": request_schema(chat=True),
                "Completion": _completion(chat=False),
                "ChatCompletion": _completion(chat=True),
                "ModelList": _MODELS,
                "Error": _ERROR,
                "ResponseRequest": body_schema(RESPONSES_FIELDS, RESPONSES_REQUIRED),
                "Response": _RESPONSE,
                "MessageRequest": body_schema(MESSAGES_FIELDS, MESSAGES_REQUIRED),
                "CountTokensRequest": body_schema(COUNT_FIELDS, COUNT_REQUIRED),
                "Message": _MESSAGE,
                "AnthropicError": _ANTHROPIC_ERROR,
                "TokenizeRequest": body_schema(TOKENIZE_FIELDS, ()),
                "DetokenizeRequest": body_schema(DETOKENIZE_FIELDS, ("tokens",)),
            },
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"apiKey": []}, {}],
    }
