"""IncrementalDetokenizer: whole UTF-8 characters only, exact stop-string cuts, specials."""

from __future__ import annotations

import random

import pytest

from fuzz.targets import EOS, byte_tokenizer, window_tokenizer
from model_runner.gguf_loader import default_model_path, read_metadata
from model_runner.tokenizer import DetokResult, IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def bytes_tok() -> Tokenizer:
    """Byte-level: tokens <s>, </s>, then one token per byte (id = 2 + byte), no merges."""
    return byte_tokenizer()


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_metadata(default_model_path()))


@pytest.fixture(scope="module")
def spm_tok() -> Tokenizer:
    """Not byte-level: sentencepiece-style BPE with byte fallback (<0xNN> tokens), so the
    detokenizer must use its re-decoding window."""
    return window_tokenizer()


def ids_of(text: str) -> list[int]:
    """Byte tokens of ``text`` for ``bytes_tok``."""
    return [2 + b for b in text.encode("utf-8")]


def is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def stream(det: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[DetokResult]:
    results = [det.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    results.append(det.flush())
    return results


def joined(results: list[DetokResult]) -> str:
    return "".join(r.text_delta for r in results)


def test_multibyte_characters_are_never_split(bytes_tok: Tokenizer) -> None:
    """Fed one byte per push, every delta is whole characters: no U+FFFD, prefix of the text."""
    text = "aé中😀b👩‍👩‍👧ü"
    det = IncrementalDetokenizer(bytes_tok)
    deltas = []
    for token in ids_of(text):
        r = det.push([token])
        assert "\ufffd" not in r.text_delta
        deltas.append(r.text_delta)
        assert text.startswith("".join(deltas))
    # "😀" is 4 bytes: its first 3 pushes emit nothing, the 4th emits the character.
    start = len("aé中".encode())
    assert deltas[start : start + 4] == ["", "", "", "😀"]
    assert det.flush().text_delta == ""
    assert det.text == text


def test_real_vocabulary_streaming_matches_decode(smol: Tokenizer) -> None:
    """SmolLM2 tokens pushed one by one concatenate to decode(all), without U+FFFD pieces."""
    text = "Voilà: 中文 😀🎉 emoji, ñ and naïve café — “quotes” 👩‍👩‍👧!"
    ids = smol.encode(text, add_special_tokens=False)
    assert any(not is_utf8(smol.token_bytes(i)) for i in ids)  # some tokens split a char
    det = IncrementalDetokenizer(smol, prompt_ids=[1, 2])
    results = stream(det, ids)
    assert all("\ufffd" not in r.text_delta for r in results)
    assert joined(results) == smol.decode(ids) == text


def test_dangling_bytes_become_replacement_on_flush(bytes_tok: Tokenizer) -> None:
    """An unfinished character is held; flush (request ended) emits U+FFFD like decode does."""
    det = IncrementalDetokenizer(bytes_tok)
    ids = ids_of("ok😀")[:-2]
    assert joined([det.push(ids)]) == "ok"
    assert det.flush().text_delta == bytes_tok.decode(ids)[2:] == "\ufffd"


@pytest.mark.parametrize("step", [1, 2, 3, 100])
def test_stop_string_across_tokens_is_cut_exactly(bytes_tok: Tokenizer, step: int) -> None:
    """The output ends right before the stop string, however the tokens split it."""
    det = IncrementalDetokenizer(bytes_tok, stop=["STOP"])
    results = stream(det, ids_of("abc ST STOtoSTOP and more"), step)
    assert joined(results) == "abc ST STOto"
    stopped = [r for r in results if r.stopped]
    assert stopped and stopped[0].stop_string == "STOP"
    assert all(r.text_delta == "" for r in stopped[1:])
    assert det.push(ids_of("x")) == DetokResult("", True, "STOP")


def test_stop_prefix_is_held_then_released(bytes_tok: Tokenizer) -> None:
    """Text that could start a stop string waits; it is released once it cannot."""
    det = IncrementalDetokenizer(bytes_tok, stop=["ab\nc"])
    assert det.push(ids_of("xa")).text_delta == "x"
    assert det.push(ids_of("b")).text_delta == ""
    assert det.push(ids_of("\n")).text_delta == ""
    assert det.push(ids_of("d")).text_delta == "ab\nd"
    assert det.push(ids_of("a")).text_delta == ""
    assert det.flush() == DetokResult("a")  # ended without the stop string: release it
    assert det.text == "xab\nda"


def test_stop_string_in_multibyte_text(bytes_tok: Tokenizer) -> None:
    """A stop string of non-ASCII characters is found across byte tokens."""
    det = IncrementalDetokenizer(bytes_tok, stop=["😀!"])
    results = stream(det, ids_of("中😀😀!tail"))
    assert joined(results) == "中😀"
    assert any(r.stop_string == "😀!" for r in results)


def test_first_stop_string_to_complete_wins(bytes_tok: Tokenizer) -> None:
    """With several stop strings, the one that appears complete first ends the output."""
    det = IncrementalDetokenizer(bytes_tok, stop=["xyz", "yz!", "q"])
    results = stream(det, ids_of("00xyz!q"))
    assert joined(results) == "00"
    assert next(r.stop_string for r in results if r.stopped) == "xyz"


def test_special_tokens_skipped_or_kept(bytes_tok: Tokenizer) -> None:
    """skip_special_tokens drops </s> from the text; without it the token's text streams."""
    ids = [*ids_of("hi"), EOS, *ids_of("!")]
    assert joined(stream(IncrementalDetokenizer(bytes_tok), ids)) == "hi!"
    kept = IncrementalDetokenizer(bytes_tok, skip_special_tokens=False)
    assert joined(stream(kept, ids)) == "hi</s>!"


@pytest.mark.parametrize("seed", range(40))
def test_random_streams_match_reference(smol: Tokenizer, seed: int) -> None:
    """Random text with a random stop string, random push sizes: the streamed text equals the
    full decode cut before the stop string's first occurrence; held text stays bounded."""
    rng = random.Random(seed)
    alphabet = ["a", "b", " ", "\n", "é", "中", "😀", "ab", "STOP", "😀!", "ßb"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(5, 40)))
    stop = rng.choice(["STOP", "b a", "😀!", "中\n", "ab😀", "é"])
    ids = smol.encode(text, add_special_tokens=False)
    full = smol.decode(ids)
    det = IncrementalDetokenizer(smol, stop=[stop])
    out: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        r = det.push(ids[i : i + n])
        out.append(r.text_delta)
        assert "\ufffd" not in r.text_delta
        assert len(det._held) < len(stop)  # never more than a proper stop-string prefix
        i += n
    out.append(det.flush().text_delta)
    cut = full.find(stop)
    assert "".join(out) == (full if cut < 0 else full[:cut])
    assert det.stopped == (cut >= 0)


def test_window_mode_for_non_byte_level_tokenizer(spm_tok: Tokenizer) -> None:
    """A sentencepiece-style tokenizer streams through the re-decoding window: leading-space
    handling matches decode(all), byte-fallback characters come out whole."""
    assert not spm_tok.is_byte_level
    text = "hello world 😀 hello"
    ids = spm_tok.encode(text, add_special_tokens=False)
    assert spm_tok.decode(ids) == text
    det = IncrementalDetokenizer(spm_tok, prompt_ids=spm_tok.encode("hello"))
    results = stream(det, ids)
    assert all("\ufffd" not in r.text_delta for r in results)
    # In context after the prompt, the first piece "▁hello" keeps its space.
    assert joined(results) == " " + text


def test_window_mode_stop_string(spm_tok: Tokenizer) -> None:
    """Stop strings work the same on the window path."""
    ids = spm_tok.encode("hello STOP world", add_special_tokens=False)
    det = IncrementalDetokenizer(spm_tok, stop=["STOP"])
    results = stream(det, ids)
    assert joined(results) == "hello "
    assert any(r.stop_string == "STOP" for r in results)


def test_empty_stop_string_rejected(bytes_tok: Tokenizer) -> None:
    """An empty stop string would match everywhere: refused."""
    with pytest.raises(ValueError, match="must not be empty"):
        IncrementalDetokenizer(bytes_tok, stop=[""])
