"""ByteTokenizer: a byte-level tokenizer for ``kvserve serve --runner fake`` and the tests.

Token ids 0..255 are the bytes of the UTF-8 text; 256 is BOS ``<s>`` and 257 is EOS
``</s>``. It offers the same methods the server uses from ``model_runner.tokenizer.Tokenizer``
(encode, decode, apply_chat_template, id_to_token, token_bytes, vocab_size, eos/bos ids,
special_token_ids), so the whole server, IncrementalDetokenizer included, runs without a
model. A byte sequence that is not valid UTF-8 decodes with U+FFFD.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
SPECIAL_TOKENS = {BOS_TOKEN_ID: "<s>", EOS_TOKEN_ID: "</s>"}


class ByteTokenizer:
    """Bytes as tokens; see the module docstring."""

    vocab_size = 258
    bos_token_id: int | None = BOS_TOKEN_ID
    eos_token_id = EOS_TOKEN_ID
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,)
    name = "byte-tokenizer"
    special_token_ids: frozenset[int] = frozenset(SPECIAL_TOKENS)
    is_byte_level = True  # IncrementalDetokenizer streams token_bytes() through a UTF-8 decoder
    chat_template: str | None = None  # the chat rendering below is built in
    tool_use_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_TOKEN_ID, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        buf = bytearray()
        for token in token_ids:
            if token in SPECIAL_TOKENS:
                if not skip_special_tokens:
                    parts.append(buf.decode("utf-8", errors="replace"))
                    buf.clear()
                    parts.append(SPECIAL_TOKENS[token])
                continue
            if not 0 <= token < 256:
                raise ValueError(f"token id {token} is outside the vocabulary [0, 257]")
            buf.append(token)
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (special tokens: their text)."""
        if token_id in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token_id].encode()
        if not 0 <= token_id < 256:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, 257]")
        return bytes([token_id])

    def id_to_token(self, token_id: int) -> str:
        if token_id in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token_id]
        if not 0 <= token_id < 256:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, 257]")
        char = chr(token_id)
        return char if token_id < 128 and char.isprintable() else f"<0x{token_id:02X}>"

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return [self.id_to_token(t) for t in token_ids]

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: object,
    ) -> str:
        """ChatML, like SmolLM2's template (which renders no tools: ``extra`` is ignored)."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")
