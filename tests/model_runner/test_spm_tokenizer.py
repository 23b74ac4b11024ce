"""SentencePiece-style GGUF vocabularies (``tokenizer.ggml.model = "llama"``).

A tiny BPE model is trained with sentencepiece in the test (byte fallback, a user-defined and a
control symbol), written as a GGUF vocabulary the way llama.cpp's converter writes one (tokens,
scores, token types), and kvserve's tokenizer built from that file is compared with
sentencepiece itself and with the tokenizer transformers builds from the same GGUF.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import sentencepiece as spm
from hypothesis import given, settings
from hypothesis import strategies as st

from model_runner.gguf_loader import read_metadata
from model_runner.gguf_vocab import score_merges
from model_runner.loader import load_model
from model_runner.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.model_runner.test_gguf_loader import write_tiny_gguf

VOCAB = 480
CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog.",
    "kvserve serves language models with a paged cache.",
    "Tokenizers merge pairs by score, and fall back to bytes.",
    "  indented line\nnew line and\ttab\n\n",
    "numbers 123 456 and more words here",
    "café naïve über",
]
# Plain text: sentencepiece, transformers and kvserve all agree on these.
TEXTS = [
    "Hello world",
    "Hello  world",
    "  hi\nthere",
    " leading space",
    "trailing space ",
    "\n\nnew lines\n",
    "tab\tand spaces   ",
    "café über naïve",
    "emoji 😀 and 👩‍👩‍👧 family",
    "中文 日本語 한국어",
    "numbers 12345 and 3.14",
    "x",
    "",
]
# With added tokens: transformers and kvserve match them whole and put the prefix space after
# each (as llama.cpp); sentencepiece does not match control symbols in text.
SPECIAL_TEXTS = [
    "a<|user|>b",
    "<|user|>\nHello<|end|>\n",
    "<s>Hi</s> there",
    "say <unk> here",
]


@pytest.fixture(scope="module")
def trained() -> Any:
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20),
        model_writer=model,
        model_type="bpe",
        vocab_size=VOCAB,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=["<|user|>"],
        control_symbols=["<|end|>"],
        minloglevel=2,
        num_threads=1,
    )
    return model.getvalue()


def vocab_writer(model_proto: bytes, **keys: Any) -> Callable[[gguf.GGUFWriter], None]:
    """Writes the vocabulary as llama.cpp's converter writes a sentencepiece model's."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_proto)

    def write(writer: gguf.GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list([p.piece for p in proto.pieces])
        writer.add_token_scores([p.score for p in proto.pieces])
        writer.add_token_types([int(p.type) for p in proto.pieces])  # llama.cpp's numbering
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(keys.get("add_bos", True))
        writer.add_add_space_prefix(keys.get("add_space_prefix", True))

    return write


def write_vocab_gguf(path: Path, model_proto: bytes, arch: str = "llama", **keys: Any) -> Path:
    """A GGUF holding only the vocabulary (and an embedding of its size)."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    vocab_writer(model_proto, **keys)(writer)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_path(trained: bytes, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab_gguf(tmp_path_factory.mktemp("spm") / "vocab.gguf", trained, arch="phi3")


@pytest.fixture(scope="module")
def tok(gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_metadata(gguf_path), name="spm")


@pytest.fixture(scope="module")
def sp(trained: bytes) -> Any:
    return spm.SentencePieceProcessor(model_proto=trained)


@pytest.fixture(scope="module")
def hf(gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_sentencepiece(tok: Tokenizer, sp: Any, text: str) -> None:
    """Plain text encodes to sentencepiece's own ids (BOS first) and decodes back to it."""
    ids = tok.encode(text)
    assert ids == [1, *sp.encode(text)]
    assert tok.decode(ids, skip_special_tokens=True) == sp.decode(sp.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS + SPECIAL_TEXTS)
def test_ids_and_text_match_transformers(tok: Tokenizer, hf: Any, text: str) -> None:
    """Ids and decoded text = transformers' tokenizer built from the same GGUF file."""
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    for skip in (False, True):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_byte_fallback_and_special_tokens(tok: Tokenizer) -> None:
    """An emoji no token spells is its four byte tokens; <|end|> is special, <|user|> is not."""
    ids = tok.encode("😀", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    end, user = tok.token_to_id("<|end|>"), tok.token_to_id("<|user|>")
    assert end in tok.special_token_ids and user not in tok.special_token_ids
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.decode(tok.encode("x<|end|>y"), skip_special_tokens=True) == "x y"


def test_no_space_prefix_and_no_bos(trained: bytes, tmp_path: Path) -> None:
    """add_space_prefix false: no ▁ in front (Gemma's files); add_bos_token false: no BOS."""
    path = write_vocab_gguf(tmp_path / "v.gguf", trained, add_bos=False, add_space_prefix=False)
    tok = Tokenizer.from_gguf_metadata(read_metadata(path))
    ids = tok.encode("Hello world")
    assert tok.id_to_token(ids[0]) != "▁Hello" and ids[0] != 1
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(tok.encode(" Hello")) == " Hello"


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_splits_a_character(tok: Tokenizer, text: str) -> None:
    """One id at a time, the deltas join to the full decode and none holds a broken char."""
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=[1])
    deltas = [detok.push([i]).text_delta for i in ids]
    deltas.append(detok.flush().text_delta)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_streaming_after_a_prompt_keeps_the_space(tok: Tokenizer) -> None:
    """Tokens that follow prompt text keep their ▁ as a space (vLLM's window decode)."""
    prompt = tok.encode("Hello")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    out = tok.encode("Hello world", add_special_tokens=False)[len(prompt) - 1 :]
    text = "".join(detok.push([i]).text_delta for i in out) + detok.flush().text_delta
    assert text == " world"


def test_token_bytes(tok: Tokenizer) -> None:
    """token_bytes: ▁ is a space, <0xNN> its byte, an added token its text; the bytes of an
    encoding are the text with its prefix space."""
    assert tok.token_bytes(tok.token_to_id("<0x0A>") or 0) == b"\n"
    assert tok.token_bytes(tok.token_to_id("<|user|>") or 0) == b"<|user|>"
    text = "emoji 😀 über\n  x"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == b" " + text.encode()


def test_merges_follow_scores() -> None:
    """score_merges ranks every two-part split of a token by the merged token's score."""
    tokens = ["a", "b", "c", "ab", "bc", "abc", "<0x41>"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0, 0.0]
    types = [1, 1, 1, 1, 1, 1, 6]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert score_merges(tokens, scores, types, vocab) == [
        ("b", "c"),
        ("a", "b"),
        ("ab", "c"),
        ("a", "bc"),
    ]


def test_unsupported_gguf_tokenizer_model() -> None:
    """A vocabulary kind other than gpt2 / llama is refused, naming both."""
    meta = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match=r"'t5' is not supported.*'gpt2'.*'llama'"):
        Tokenizer.from_gguf_metadata(meta)


def test_a_llama2_style_gguf_loads_with_its_vocabulary(
    trained: bytes, sp: Any, tmp_path: Path
) -> None:
    """A llama GGUF whose vocabulary is SentencePiece loads; its tokenizer is sentencepiece's."""
    path = tmp_path / "llama2.gguf"
    write_tiny_gguf(path, vocab=VOCAB, write_vocab=vocab_writer(trained))
    loaded = load_model(str(path))
    text = "Hello world, émoji 😀\n"
    assert loaded.tokenizer.encode(text) == [1, *sp.encode(text)]
    assert loaded.tokenizer.bos_token_id == 1 and 2 in loaded.config.eos_token_ids


_ALPHABET = "ab cdeHlo wrld\n\t  éü😀中🇫👩\u200d,.1"


@settings(max_examples=150, deadline=None)
@given(text=st.text(alphabet=_ALPHABET, max_size=30))
def test_any_text_matches_sentencepiece(tok: Tokenizer, sp: Any, text: str) -> None:
    """Random text over spaces, newlines, accents, emoji and CJK: sentencepiece's ids, and back."""
    assert tok.encode(text, add_special_tokens=False) == sp.encode(text)
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


_FIRST_PIECE = 261  # after <unk> <s> </s> <|end|> <|user|> and the 256 byte tokens


def _byte_ids(char: str) -> list[int]:
    return [_FIRST_PIECE - 256 + b for b in char.encode("utf-8")]


@settings(max_examples=150, deadline=None)
@given(
    runs=st.lists(
        st.one_of(
            st.integers(min_value=_FIRST_PIECE, max_value=VOCAB - 1).map(lambda i: [i]),
            st.sampled_from(["\n", "é", "😀", "中", "\x00"]).map(_byte_ids),
        ),
        max_size=12,
    ),
    prompt=st.sampled_from(["", "Hi", "Hi\n"]),
    skip=st.booleans(),
)
def test_any_ids_stream_to_their_decode(
    tok: Tokenizer, runs: list[list[int]], prompt: str, skip: bool
) -> None:
    """Pieces and byte-token runs of whole characters, one id at a time after a prompt: the
    deltas and the flush join to what the ids add to the prompt's decode."""
    ids = [i for run in runs for i in run]
    assert (tok.id_to_token(5), tok.id_to_token(260)) == ("<0x00>", "<0xFF>")  # the layout
    before = tok.encode(prompt)
    detok = IncrementalDetokenizer(tok, prompt_ids=before, skip_special_tokens=skip)
    text = "".join(detok.push([i]).text_delta for i in ids) + detok.flush().text_delta
    context = tok.decode(before, skip_special_tokens=skip)
    assert text == tok.decode(before + ids, skip_special_tokens=skip)[len(context) :]


def test_an_invalid_byte_run_streams_its_valid_bytes(tok: Tokenizer) -> None:
    """<0x00><0x80>: the stream keeps the NUL and replaces the stray byte (Python's UTF-8
    decoding); the whole-text decode replaces the run byte by byte (ByteFallback)."""
    detok = IncrementalDetokenizer(tok, prompt_ids=[1])
    ids = [5, 5 + 0x80]
    text = "".join(detok.push([i]).text_delta for i in ids) + detok.flush().text_delta
    assert text == "\x00\ufffd"
    assert tok.decode(ids) == "\ufffd\ufffd"


def test_the_same_vocabulary_from_a_tokenizer_json(tok: Tokenizer, hf: Any, tmp_path: Path) -> None:
    """transformers' tokenizer saved as a directory (tokenizer.json) reads back with the same
    ids and SentencePiece token bytes."""
    hf.save_pretrained(str(tmp_path))
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    assert from_dir.is_sentencepiece and not from_dir.is_byte_level
    for text in TEXTS + SPECIAL_TEXTS:
        ids = tok.encode(text)
        assert from_dir.encode(text) == ids
        assert [from_dir.token_bytes(i) for i in ids] == [tok.token_bytes(i) for i in ids]
