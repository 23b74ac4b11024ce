"""A ``tokenizers.Tokenizer`` built from a GGUF's ``tokenizer.ggml.*`` vocabulary.

Two kinds, as llama.cpp reads them (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE from the token list and the merges. The pre-tokenizer follows
  ``tokenizer.ggml.pre``: ``smollm`` splits every digit on its own before the GPT-2 regex (as
  SmolLM2's ``tokenizer.json``: ``Digits(individual_digits) + ByteLevel``); ``llama3``-style and
  ``qwen2`` use their split regexes.
- ``llama``: SentencePiece-style BPE (Llama 1/2, Mistral v0.1, Phi-3). llama.cpp's SPM
  tokenizer replaces spaces by ``▁``, puts one before every raw-text fragment when
  ``add_space_prefix`` (default true), then merges the adjacent pair whose merged token has the
  highest score, again and again; a character no token spells falls back to its UTF-8 bytes
  (``<0x0A>`` tokens). The same here: merges ranked by the merged token's score (as
  transformers derives them from a sentencepiece model), ``byte_fallback``, a ``Prepend("▁")``
  normalizer (per fragment, so also after a special token, as llama.cpp and the ``legacy``
  tokenizer.json those models ship), and the decoder that turns ``▁`` back into spaces, byte
  tokens into bytes and drops the one leading space the prefix added.

Control tokens (type 3; and the unknown token, type 2, in ``llama`` vocabularies) become special
added tokens and user-defined tokens (type 4) plain added tokens, so both are matched whole.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6

SPACE = "\u2581"  # ▁, SentencePiece's spelling of a space
# GGUF's tokenizer models (``tokenizer.ggml.model``): vocabulary kinds, not architectures
# (a qwen2 file says "gpt2", a Phi-3 or Mistral v0.1 file "llama").
BYTE_LEVEL_BPE = "gpt2"
SENTENCEPIECE = "llama"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> regex applied before the byte-level step (None: the GPT-2 regex).
_SPLITS: dict[str, str] = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# llama.cpp splits every \p{N} character on its own first for these (llama-vocab.cpp).
_INDIVIDUAL_DIGITS = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def backend_from_gguf(metadata: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer a GGUF's vocabulary describes; ValueError for a kind kvserve lacks."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = list(metadata.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("the GGUF file has no tokenizer.ggml.tokens: it carries no vocabulary")
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == BYTE_LEVEL_BPE:
        backend = _byte_level_bpe(metadata, tokens)
        add_bos_default = False
        special_types = {TOKEN_TYPE_CONTROL}
    elif kind == SENTENCEPIECE:
        backend = _sentencepiece_bpe(metadata, tokens, types)
        add_bos_default = True  # llama.cpp's default for SPM vocabularies
        special_types = {TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN}
    else:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (kvserve builds 'gpt2' byte-level "
            f"BPE and 'llama' SentencePiece tokenizers from GGUF); use a Hugging Face directory "
            f"with tokenizer.json"
        )
    pairs = list(zip(tokens, types, strict=False))
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in pairs if k in special_types and t
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in pairs
        if k == TOKEN_TYPE_USER_DEFINED and t
    ]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)
    if add_bos and bos is not None and int(bos) < len(tokens):
        text = tokens[int(bos)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{text} $A", pair=f"{text} $A {text} $B", special_tokens=[(text, int(bos))]
        )
    return backend


def _byte_level_bpe(metadata: Mapping[str, Any], tokens: Sequence[str]) -> HFTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges") or []]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    )
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    split = _SPLITS.get(pre)
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in _INDIVIDUAL_DIGITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(
    metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]
) -> HFTokenizer:
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # a repeated spelling keeps its first id
    raw_scores = metadata.get("tokenizer.ggml.scores")
    scores = (
        [float(s) for s in raw_scores] if raw_scores else [-float(i) for i in range(len(tokens))]
    )
    merges = score_merges(tokens, scores, types, vocab)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_text = tokens[int(unk)] if unk is not None and int(unk) < len(tokens) else None
    backend = HFTokenizer(
        models.BPE(
            vocab=vocab, merges=merges, unk_token=unk_text, fuse_unk=True, byte_fallback=True
        )
    )
    space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[Any] = [normalizers.Prepend(SPACE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    backend.pre_tokenizer = None
    out: list[Any] = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        out.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(out)
    return backend


def score_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """BPE merges equivalent to merging by score: every split of a token into two vocabulary
    entries, best merged-token score first (ties: the longer left part, then the token's id).

    Byte tokens (``<0x0A>``) are never built by merging."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for i, (tok, score) in enumerate(zip(tokens, scores, strict=False)):
        if len(tok) < 2 or types[i] == TOKEN_TYPE_BYTE or vocab.get(tok) != i:
            continue
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, -len(left), -len(right), i, left, right))
    ranked.sort(key=lambda r: r[:4])
    return [(left, right) for *_, left, right in ranked]


def spm_piece_bytes(token: str) -> bytes:
    """The bytes one SentencePiece token stands for: ``<0xNN>`` is that byte, ``▁`` a space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace(SPACE, " ").encode("utf-8")
