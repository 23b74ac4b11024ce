"""Tokenizer (``tokenizers``), chat template (sandboxed jinja2) and streaming detokenization.

Two sources:
- GGUF metadata: byte-level BPE (``tokenizer.ggml.model == "gpt2"``) or SentencePiece-style
  BPE with scores and byte fallback (``"llama"``), built in ``model_runner.gguf_vocab``.
- A Hugging Face directory: ``tokenizer.json`` plus ``tokenizer_config.json`` (special tokens,
  chat template; or ``chat_template.jinja``) and ``generation_config.json`` (EOS ids).

``IncrementalDetokenizer`` turns sampled ids into text deltas without ever emitting a broken
UTF-8 character and cuts the output before a stop string, even one spread over many tokens.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from model_runner.chat_template import compile_template, render
from model_runner.gguf_vocab import backend_from_gguf, byte_to_unicode, spm_piece_bytes

__all__ = ["ALLOWED_ROLES", "IncrementalDetokenizer", "Tokenizer", "byte_to_unicode"]

ALLOWED_ROLES = ("system", "user", "assistant", "tool")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus what serving needs around it.

    Build with ``from_gguf_metadata`` or ``from_hf_dir``. ``encode`` / ``decode`` are thin
    wrappers; ``token_bytes`` gives the raw bytes of one token for streaming.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        tool_use_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        name: str = "",
    ) -> None:
        self.backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(t) for t in eos_token_ids))
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        # A second template for requests with tools (Hugging Face's named "tool_use" one).
        self.tool_use_template = tool_use_template
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.name = name
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        # SentencePiece spelling (``▁``, ``<0x0A>``): token_bytes reads it too.
        self.is_sentencepiece = _spells_sentencepiece(backend)
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        self._token_bytes: list[bytes | None] = [None] * self.vocab_size
        self._templates: dict[str, Any] = {}

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], name: str = "") -> Tokenizer:
        """From a GGUF's ``tokenizer.ggml.*`` keys (``model`` ``"gpt2"`` or ``"llama"``)."""
        backend = backend_from_gguf(metadata)
        tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        bos_id = int(bos) if bos is not None else None
        eos_ids = [
            int(metadata[k])
            for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if metadata.get(k) is not None
        ]

        def token(key: str) -> str | None:
            value = metadata.get(key)
            return tokens[int(value)] if value is not None and int(value) < len(tokens) else None

        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            chat_template=metadata.get("tokenizer.chat_template"),
            tool_use_template=metadata.get("tokenizer.chat_template.tool_use"),
            special_tokens={
                "bos_token": token("tokenizer.ggml.bos_token_id"),
                "eos_token": token("tokenizer.ggml.eos_token_id"),
                "unk_token": token("tokenizer.ggml.unknown_token_id"),
                "pad_token": token("tokenizer.ggml.padding_token_id"),
            },
            name=name,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path, name: str = "") -> Tokenizer:
        """From ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``,
        ``generation_config.json`` / ``config.json`` for EOS ids) in a local directory."""
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {str(root)!r}: a Hugging Face model directory needs it "
                f"(save one with transformers' tokenizer.save_pretrained)"
            )
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise ValueError(f"cannot read {tokenizer_file}: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        special: dict[str, str | None] = {
            key: _token_content(config.get(key))
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = config.get("chat_template")
        tool_use = None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
            tool_use = named.get("tool_use")
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")

        eos_ids: list[int] = []
        for source in (
            _read_json(root / "generation_config.json"),
            _read_json(root / "config.json"),
        ):
            value = source.get("eos_token_id")
            if value is not None:
                eos_ids += [int(v) for v in value] if isinstance(value, list) else [int(value)]
        eos_text = special.get("eos_token")
        eos_id = backend.token_to_id(eos_text) if eos_text is not None else None
        if eos_id is not None:
            eos_ids.append(int(eos_id))
        bos_text = special.get("bos_token")
        bos_id = backend.token_to_id(bos_text) if bos_text is not None else None
        return cls(
            backend,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            chat_template=template if isinstance(template, str) else None,
            tool_use_template=tool_use if isinstance(tool_use, str) else None,
            special_tokens=special,
            name=name or root.name,
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``) are
        matched whole; ``add_special_tokens`` adds what the tokenizer's post-processor adds
        (e.g. BOS), which chat-formatted prompts must not get twice."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD, as Hugging Face does); ids past the
        tokenizer's entries (a padded embedding's rows) are empty text."""
        kept = [i for i in ids if i < self.vocab_size]
        text: str = self.backend.decode(kept, skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (byte-level spelling, e.g. ``Ġthe``), None if out of range."""
        token: str | None = self.backend.id_to_token(token_id)
        return token

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self.backend.token_to_id(token)
        return token_id

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes one token contributes to the text (byte-level and SentencePiece
        tokenizers: ``▁`` is a space, ``<0x0A>`` its byte, before any leading-space strip).

        An id past the tokenizer's entries is empty text: a padded embedding (Qwen2.5's
        151,936 rows for 151,665 tokens) can sample one, and vLLM streams nothing for it."""
        if not (self.is_byte_level or self.is_sentencepiece):
            raise ValueError("token_bytes needs a byte-level or SentencePiece tokenizer")
        if token_id >= self.vocab_size:
            return b""
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        cached = self._token_bytes[token_id]
        if cached is None:
            token = self.backend.id_to_token(token_id) or ""
            if self.is_sentencepiece:  # an added token is its literal text
                added = token_id in self._added_ids
                cached = token.encode("utf-8") if added else spm_piece_bytes(token)
                self._token_bytes[token_id] = cached
                return cached
            table = _unicode_to_byte()
            out = bytearray()
            for ch in token:
                b = table.get(ch)
                if b is None:  # not in the byte alphabet: an added token's literal text
                    out += ch.encode("utf-8")
                else:
                    out.append(b)
            cached = bytes(out)
            self._token_bytes[token_id] = cached
        return cached

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template (sandboxed jinja2, as
        transformers does: trim_blocks, lstrip_blocks, ``raise_exception``, ``tojson``).

        Raises ValueError for an unknown role (naming the allowed ones), a message without
        string ``role`` / ``content``, a model without a chat template, or an error the
        template itself raises.
        """
        if self.chat_template is None:
            raise ValueError(
                f"model {self.name!r} has no chat template; send a plain prompt instead"
            )
        checked: list[dict[str, Any]] = []
        for i, message in enumerate(messages):
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not isinstance(content, str):
                raise ValueError(f"message {i} needs string 'role' and 'content' fields")
            if role not in ALLOWED_ROLES:
                raise ValueError(
                    f"message {i} has unknown role {role!r}; allowed roles: "
                    f"{', '.join(ALLOWED_ROLES)}"
                )
            checked.append(dict(message))
        source = self.chat_template
        if extra.get("tools") is not None and self.tool_use_template is not None:
            source = self.tool_use_template  # as transformers picks a named "tool_use" one
        template = self._templates.get(source)
        if template is None:
            template = self._templates[source] = compile_template(source)
        return render(template, checked, add_generation_prompt, self.special_tokens, extra)


def _spells_sentencepiece(backend: HFTokenizer) -> bool:
    """Whether the decoder turns ``▁`` into a space and byte tokens into bytes (Llama-2 style)."""
    if backend.decoder is None:
        return False
    try:
        decoder = json.loads(backend.decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return False
    parts = decoder.get("decoders", [decoder]) if isinstance(decoder, dict) else []
    kinds = {p.get("type") for p in parts if isinstance(p, dict)}
    return "ByteFallback" in kinds or "Metaspace" in kinds


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------------- streaming


@dataclass(frozen=True, slots=True)
class DetokResult:
    """Text to send for the tokens just pushed, and whether a stop string ended the output."""

    text_delta: str
    stopped: bool = False
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one ``push`` per step.

    Contract:
    - Never emits part of a UTF-8 character: bytes of an unfinished character are held until
      the rest arrives (byte-level tokenizers decode token bytes with an incremental UTF-8
      decoder; other tokenizers re-decode a small window and hold a trailing U+FFFD).
    - Stop strings are found across token boundaries; the output is cut right before the
      first one, which is never emitted. Text that could still become a stop string (a suffix
      that is a prefix of one) is held back until it cannot.
    - After a stop, ``push`` returns empty deltas. ``flush`` (when the request ends for
      another reason) releases the held text; an unfinished character becomes U+FFFD.
    - O(new tokens + longest stop string) per push, whatever the output length.

    ::

        | emitted ............ | held (stop-prefix / partial char) | new text of this push |
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.tokenizer = tokenizer
        self.stop: tuple[str, ...] = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._held = ""
        self._chunks: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Window decoding (non byte-level): ids seen so far, and two offsets into them::
        #   | context (already emitted) | pending (not yet emitted) |
        #   prefix_offset             read_offset
        self._ids: list[int] = [t for t in prompt_ids if t not in self._skip][-6:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_ids: Iterable[int]) -> DetokResult:
        """Add newly generated tokens; return the text that is now safe to send."""
        if self.stopped:
            return DetokResult("", True, self.stop_string)
        ids = [t for t in token_ids if t not in self._skip]
        new_text = self._decode_new(ids) if ids else ""
        return self._emit(new_text, final=False)

    def flush(self) -> DetokResult:
        """The request ended without a stop string: release everything held."""
        if self.stopped:
            return DetokResult("", True, self.stop_string)
        if self.tokenizer.is_byte_level:
            tail = self._utf8.decode(b"", final=True)
        else:
            tail = self._window_text(final=True)
        return self._emit(tail, final=True)

    # ------------------------------------------------------------------ internals

    def _decode_new(self, ids: list[int]) -> str:
        if self.tokenizer.is_byte_level:
            data = b"".join(self.tokenizer.token_bytes(t) for t in ids)
            text: str = self._utf8.decode(data)
            return text
        self._ids.extend(ids)
        return self._window_text(final=False)

    def _window_text(self, final: bool) -> str:
        """vLLM-style: decode ``ids[prefix:]`` and ``ids[prefix:read]``; the difference is
        new text unless it ends in U+FFFD (an unfinished character), which waits."""
        decode = self.tokenizer.decode
        ids = self._ids
        before = decode(ids[self._prefix_offset : self._read_offset])
        after = decode(ids[self._prefix_offset :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        new = after[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > 0:  # keep the list short: drop what no window needs
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return new

    def _emit(self, new_text: str, final: bool) -> DetokResult:
        text = self._held + new_text
        if self.stop and text:
            hit = self._find_stop(text)
            if hit is not None:
                cut, stop = hit
                self.stopped, self.stop_string, self._held = True, stop, ""
                self._chunks.append(text[:cut])
                return DetokResult(text[:cut], True, stop)
            keep = 0 if final else self._stop_prefix_len(text)
        else:
            keep = 0
        out = text[: len(text) - keep]
        self._held = text[len(text) - keep :]
        if out:
            self._chunks.append(out)
        return DetokResult(out)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Earliest stop string in ``text`` (ties: the one listed first)."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(len(text), self._max_stop - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
