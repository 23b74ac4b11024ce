"""Tokenizer: GGUF and HF-dir construction, round trips, special tokens, chat template."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from model_runner.gguf_loader import default_model_path, read_metadata
from model_runner.tokenizer import ALLOWED_ROLES, Tokenizer, byte_to_unicode

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "  leading   spaces\n\n\ttabs  and trailing   ",
    "emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "numbers 12345 and 3.14159, x² ⅔ ٣",
    "don't you're I'll we've",
    "ünïcödé café naïve e\u0301 (combining)",
    "a" * 100,
    "\u00a0nbsp\u2003em\u200bzero-width",
    "def f(x):\n    return x**2  # comment\r\n",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def smol_metadata() -> dict[str, Any]:
    return read_metadata(default_model_path())


@pytest.fixture(scope="module")
def smol(smol_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(smol_metadata, name="smol")


def test_smollm2_tokenizer_shape(smol: Tokenizer) -> None:
    """Vocabulary, special ids and EOS/BOS come from the GGUF metadata."""
    assert smol.vocab_size == 49152
    assert smol.eos_token_ids == (2,)
    assert smol.bos_token_id == 1
    assert smol.special_token_ids == frozenset(range(17))
    assert smol.id_to_token(2) == "<|im_end|>"
    assert smol.id_to_token(49152) is None
    assert smol.is_byte_level


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smol: Tokenizer, text: str) -> None:
    """decode(encode(text)) == text for ASCII, emoji, CJK, whitespace runs, combining marks."""
    assert smol.decode(smol.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60))
def test_round_trip_any_unicode(smol: Tokenizer, text: str) -> None:
    """Byte-level BPE is lossless on any text whose bytes are all in the vocabulary."""
    spelled = byte_to_unicode()
    assume(all(smol.token_to_id(spelled[b]) is not None for b in text.encode()))
    assert smol.decode(smol.encode(text, add_special_tokens=False)) == text


def test_bytes_missing_from_the_vocabulary_are_dropped(smol: Tokenizer) -> None:
    """SmolLM2 has no token for 21 bytes (e.g. 0xF1, which starts U+40000): like Hugging Face's
    tokenizer, such characters cannot be encoded and are lost."""
    assert smol.token_to_id(byte_to_unicode()[0xF1]) is None
    # U+40000 is F1 80 80 80: without F1 the three continuation bytes decode as U+FFFD each.
    ids = smol.encode("a\U00040000b", add_special_tokens=False)
    assert smol.decode(ids) == "a" + "\ufffd" * 3 + "b"


def test_digits_are_split_individually(smol: Tokenizer) -> None:
    """tokenizer.ggml.pre "smollm": every \\p{N} character is its own pre-token (llama.cpp's
    regex list starts with \\p{N}), so a space before a number stays a separate token."""
    ids = smol.encode("in 2024", add_special_tokens=False)
    assert [smol.id_to_token(i) for i in ids] == ["in", "Ġ", "2", "0", "2", "4"]
    ids = smol.encode("x ⅔", add_special_tokens=False)  # ⅔ is \\p{N} (No), 3 bytes
    assert [smol.id_to_token(i) for i in ids] == ["x", "Ġ", "â", "ħ", "Ķ"]


def test_special_tokens_are_matched_whole(smol: Tokenizer) -> None:
    """<|im_start|> / <|im_end|> in text encode to their single ids; decode can skip them."""
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>\n", add_special_tokens=False)
    assert ids[0] == 1 and 2 in ids
    assert smol.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n"
    assert smol.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_no_bos_added_for_smollm2(smol: Tokenizer) -> None:
    """tokenizer.ggml.add_bos_token is false: add_special_tokens adds nothing."""
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi", add_special_tokens=False)


def test_token_bytes(smol: Tokenizer) -> None:
    """token_bytes maps the byte-level spelling back to raw bytes; specials to their text."""
    the = smol.token_to_id("Ġthe")
    assert the is not None
    assert smol.token_bytes(the) == b" the"
    assert smol.token_bytes(2) == b"<|im_end|>"
    ids = smol.encode("😀", add_special_tokens=False)
    assert b"".join(smol.token_bytes(i) for i in ids) == "😀".encode()
    with pytest.raises(ValueError, match="negative"):
        smol.token_bytes(-1)


def test_ids_past_the_tokenizer_are_empty_text(smol: Tokenizer) -> None:
    """A padded embedding's ids (past the tokenizer's entries) stream and decode as ''."""
    padded = smol.vocab_size
    assert smol.token_bytes(padded) == b"" and smol.token_bytes(padded + 300) == b""
    hi = smol.encode("hi", add_special_tokens=False)
    assert smol.decode([*hi, padded, *hi]) == smol.decode(hi + hi)


@pytest.mark.slow
def test_matches_transformers_gguf_tokenizer(smol: Tokenizer) -> None:
    """Same ids as transformers' own GGUF tokenizer conversion on fixed and random texts."""
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    hf = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    rng = random.Random(0)
    alphabet = "abcXYZ .,!?'\n\té中😀ß\u0301-_"
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(40)) for _ in range(200)]
    for text in texts:
        if any(unicodedata.category(c).startswith("N") for c in text):
            # transformers' GGUF conversion ignores tokenizer.ggml.pre == "smollm", which
            # (llama.cpp, SmolLM2's tokenizer.json) isolates every \p{N} character first.
            continue
        assert smol.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False
        ), text
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    for msgs in (messages, messages[1:2]):
        for gen in (True, False):
            assert smol.apply_chat_template(msgs, add_generation_prompt=gen) == (
                hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            )


def test_chat_template_smollm2_format(smol: Tokenizer) -> None:
    """SmolLM2's template: default system prompt, ChatML turns, assistant generation prompt."""
    text = smol.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text == (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = smol.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
        ],
        add_generation_prompt=False,
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_chat_template_rejects_unknown_role(smol: Tokenizer) -> None:
    """An unknown role raises ValueError naming the allowed roles."""
    with pytest.raises(ValueError, match="unknown role 'wizard'") as info:
        smol.apply_chat_template([{"role": "wizard", "content": "x"}])
    for role in ALLOWED_ROLES:
        assert role in str(info.value)
    with pytest.raises(ValueError, match="string 'role' and 'content'"):
        smol.apply_chat_template([{"role": "user"}])


def test_chat_template_is_sandboxed(smol_metadata: dict[str, Any]) -> None:
    """A template cannot reach Python internals, and raise_exception becomes ValueError."""
    evil = dict(smol_metadata)
    evil["tokenizer.chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception, match=r"unsafe|not safely|access"):
        Tokenizer.from_gguf_metadata(evil).apply_chat_template([{"role": "user", "content": "x"}])
    raising = dict(smol_metadata)
    raising["tokenizer.chat_template"] = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ValueError, match="only user turns"):
        Tokenizer.from_gguf_metadata(raising).apply_chat_template(
            [{"role": "user", "content": "x"}]
        )


def test_no_chat_template(smol_metadata: dict[str, Any]) -> None:
    """Without a template apply_chat_template raises ValueError."""
    meta = {k: v for k, v in smol_metadata.items() if k != "tokenizer.chat_template"}
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_gguf_metadata(meta, name="x").apply_chat_template(
            [{"role": "user", "content": "x"}]
        )


def tiny_metadata(**overrides: Any) -> dict[str, Any]:
    """A byte-level vocabulary of the 256 single bytes, one merge, and two control tokens."""
    tokens = ["<s>", "</s>", *byte_to_unicode().values(), "ab"]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * 257,
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
    }
    meta.update(overrides)
    return meta


def test_add_bos_token() -> None:
    """tokenizer.ggml.add_bos_token: encode(add_special_tokens=True) prepends BOS once."""
    tok = Tokenizer.from_gguf_metadata(tiny_metadata(**{"tokenizer.ggml.add_bos_token": True}))
    ab = tok.token_to_id("ab")
    a = tok.token_to_id("a")
    assert tok.encode("aba") == [0, ab, a]
    assert tok.encode("aba", add_special_tokens=False) == [ab, a]


def test_user_defined_tokens_are_matched_whole() -> None:
    """Token type 4 (user-defined) is an added, non-special token."""
    meta = tiny_metadata()
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "<think>"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 4]
    tok = Tokenizer.from_gguf_metadata(meta)
    think = len(meta["tokenizer.ggml.tokens"]) - 1
    assert tok.encode("x<think>y", add_special_tokens=False)[1] == think
    assert think not in tok.special_token_ids
    assert tok.decode([think], skip_special_tokens=True) == "<think>"


def test_from_hf_dir(tmp_path: Path, smol: Tokenizer) -> None:
    """tokenizer.json + tokenizer_config.json (+ generation_config.json EOS ids) round trip."""
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|im_start|>", "lstrip": False},
                "eos_token": "<|im_end|>",
                "chat_template": template,
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.eos_token_ids == (2, 0)
    assert tok.bos_token_id == 1
    assert tok.special_token_ids == smol.special_token_ids
    for text in TEXTS:
        assert tok.encode(text) == smol.encode(text)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi"


def test_from_hf_dir_chat_template_file(tmp_path: Path, smol: Tokenizer) -> None:
    """chat_template.jinja is used when tokenizer_config.json has no template."""
    smol.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "yo!"


def test_from_hf_dir_missing_tokenizer(tmp_path: Path) -> None:
    """A directory without tokenizer.json raises FileNotFoundError naming it."""
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)
