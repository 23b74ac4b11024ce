"""Fuzz targets: the pure parts that read what a client or a file sends, each a function of
one ``bytes`` input that returns on any expected refusal and raises on anything else.

``python -m fuzz.run TARGET`` drives one under atheris (coverage-guided: ``make fuzz``);
``tests/fuzz/test_targets.py`` runs each over its corpus (``fuzz/corpus/<target>/``) and its
regression inputs without atheris, so the harness is checked by ``make test``.

Contracts checked, beyond "no unexpected exception":
- openai_parser: a refusal is a 4xx with a bounded message, whatever the body, on every
  route (completions, chat, Responses, Messages, count_tokens, tokenize, detokenize).
- request_validation: a decoded ``GenerateRequest`` is valid or an ``InvalidRequestError``.
- detokenizer: byte-level streams are exact (the emitted text is the full decode cut right
  before the first stop string, which is never emitted), whatever the push sizes.
- gguf_header: any file is a model config or a ``CheckpointError`` naming the file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from google.protobuf.message import DecodeError

from model_runner.errors import CheckpointError
from model_runner.gguf_loader import read_header
from model_runner.tokenizer import IncrementalDetokenizer, Tokenizer, byte_to_unicode
from server.openai.anthropic import parse_messages
from server.openai.fields import HttpError, http_error
from server.openai.parse import load_body, parse_body
from server.openai.responses import parse_responses
from server.openai.tokenize import parse_detokenize, parse_tokenize
from server.rpc import generation_pb2 as pb
from server.validation import (
    InvalidRequestError,
    Limits,
    cache_salt_digest,
    check_request_fields,
    sampling_params,
)

MODEL = "fake"
LIMITS = Limits(vocab_size=258, max_model_len=128, max_n=8)
# A refusal's message goes back to the client: it must stay short whatever the body held.
MAX_MESSAGE_CHARS = 2000
BOS, EOS = 0, 1


def _check_refusal(exc: Exception) -> None:
    error = http_error(exc)
    assert 400 <= error.status < 500, f"{error.status} for {exc!r}"
    assert len(error.message) <= MAX_MESSAGE_CHARS, f"a {len(error.message)}-char message"


# The routes a first byte >= 0x80 picks (byte >> 1, modulo their count); below it, the byte's
# low bit picks chat (odd) or completions.
ROUTES = ("responses", "messages", "count_tokens", "tokenize", "detokenize")


def openai_parser(data: bytes) -> None:
    """The first byte picks the endpoint (below 0x80 odd: chat, even: completions; from
    0x80 one of ``ROUTES``); the rest is the HTTP body, parsed and validated as the server
    does before tokenizing."""
    if not data:
        return
    try:
        body = load_body(data[1:])
        if data[0] >= 0x80:
            route = ROUTES[(data[0] >> 1) % len(ROUTES)]
            if route == "tokenize":
                parse_tokenize(body, MODEL)
                return
            if route == "detokenize":
                parse_detokenize(body, MODEL, LIMITS.vocab_size)
                return
            if route == "responses":
                parsed = parse_responses(body, MODEL)
            else:
                parsed = parse_messages(body, MODEL, count_only=route == "count_tokens")
        else:
            parsed = parse_body(body, bool(data[0] & 1), MODEL)
        check_request_fields(parsed.request, LIMITS)
        sampling_params(parsed.request, 1 + data[0] % 8, LIMITS)
    except (InvalidRequestError, HttpError) as exc:
        _check_refusal(exc)


def request_validation(data: bytes) -> None:
    """A serialized ``GenerateRequest`` (what gRPC hands the servicer), validated."""
    try:
        request = pb.GenerateRequest.FromString(data)
    except DecodeError:
        return
    try:
        check_request_fields(request, LIMITS)
        cache_salt_digest(request.cache_salt)
        num_prompt_tokens = len(request.token_ids.ids) or len(request.text) or 1
        sampling_params(request, num_prompt_tokens, LIMITS)
    except InvalidRequestError as exc:
        _check_refusal(exc)


def byte_tokenizer() -> Tokenizer:
    """Byte-level: tokens <s>, </s>, then one token per byte (id = 2 + byte), no merges."""
    spelled = byte_to_unicode()
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["<s>", "</s>", *(spelled[b] for b in range(256))],
        "tokenizer.ggml.token_type": [3, 3] + [1] * 256,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": BOS,
        "tokenizer.ggml.eos_token_id": EOS,
    }
    return Tokenizer.from_gguf_metadata(meta)


def window_tokenizer() -> Tokenizer:
    """Not byte-level: sentencepiece-style BPE with byte fallback (<0xNN> tokens), so the
    detokenizer must use its re-decoding window."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ("▁", "h", "e", "l", "o", "w", "r", "d", "▁hello", "▁world", "S", "T", "O", "P"):
        vocab[piece] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, eos_token_ids=(2,), bos_token_id=1)


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(kind: str) -> Tokenizer:
    if kind not in _TOKENIZERS:
        _TOKENIZERS[kind] = byte_tokenizer() if kind == "bytes" else window_tokenizer()
    return _TOKENIZERS[kind]


def detokenizer(data: bytes) -> None:
    """Header byte: bit 0 the tokenizer (byte-level or window), bits 1-2 the number of stop
    strings, bits 3-5 the push size - 1. Each stop string: a length byte (1 + n % 6) and its
    bytes (as UTF-8, bad bytes replaced). The rest: tokens, one byte each (byte-level: 0xFF
    escapes the next byte, odd = EOS, even = the byte 0xFF) or two (window: id modulo the
    vocabulary)."""
    if not data:
        return
    head, rest = data[0], data[1:]
    stops = []
    for _ in range((head >> 1) & 3):
        if not rest:
            return
        n = 1 + rest[0] % 6
        stops.append(rest[1 : 1 + n].decode("utf-8", "replace") or "?")
        rest = rest[1 + n :]
    step = 1 + ((head >> 3) & 7)
    if head & 1:
        _window_stream(rest, stops, step)
    else:
        _byte_stream(rest, stops, step)


def _pushed(det: IncrementalDetokenizer, ids: list[int], step: int) -> str:
    deltas = [det.push(ids[i : i + step]).text_delta for i in range(0, len(ids), step)]
    deltas.append(det.flush().text_delta)
    return "".join(deltas)


def _byte_stream(data: bytes, stops: list[str], step: int) -> None:
    ids: list[int] = []
    escaped = False
    for b in data:
        if escaped:
            ids.append(EOS if b & 1 else 2 + 0xFF)
            escaped = False
        elif b == 0xFF:
            escaped = True
        else:
            ids.append(2 + b)
    det = IncrementalDetokenizer(_tokenizer("bytes"), stop=stops)
    emitted = _pushed(det, ids, step)
    full = bytes(t - 2 for t in ids if t >= 2).decode("utf-8", "replace")
    assert full.startswith(emitted), (full, emitted)
    if det.stopped:
        assert det.stop_string is not None and full[len(emitted) :].startswith(det.stop_string)
    else:
        assert emitted == full, (full, emitted)
    assert not any(s in emitted for s in stops), (stops, emitted)


def _window_stream(data: bytes, stops: list[str], step: int) -> None:
    tok = _tokenizer("window")
    ids = [
        int.from_bytes(data[i : i + 2], "little") % tok.vocab_size for i in range(0, len(data), 2)
    ]
    det = IncrementalDetokenizer(tok, stop=stops)
    emitted = _pushed(det, ids, step)
    assert not any(s in emitted for s in stops), (stops, emitted)
    assert not det.stopped or det.stop_string in stops


_GGUF_PATH = os.path.join(tempfile.gettempdir(), f"kvserve-fuzz-{os.getpid()}.gguf")


def gguf_header(data: bytes) -> None:
    """The bytes as a GGUF file: its header, metadata and tensor infos read as the loader
    reads them, down to the model config."""
    with open(_GGUF_PATH, "wb") as f:
        f.write(data)
    try:
        read_header(_GGUF_PATH)
    except CheckpointError as exc:
        assert _GGUF_PATH in str(exc), exc


TARGETS: dict[str, Callable[[bytes], None]] = {
    "openai_parser": openai_parser,
    "request_validation": request_validation,
    "detokenizer": detokenizer,
    "gguf_header": gguf_header,
}
