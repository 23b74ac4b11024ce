"""Structured outputs: the one module that talks to the grammar library (llguidance).

llguidance (used by llama.cpp, vLLM and SGLang) does the grammar work: it compiles a JSON
schema, regex, choice list or Lark / GBNF grammar against our vocabulary and computes the
set of allowed next tokens as a bitmask (bit ``t % 32`` of word ``t // 32`` set = token ``t``
allowed), releasing the GIL while it does. ``benchmarks/bench_constraints.py`` measured it
against xgrammar on our tokenizer (README, "Structured outputs").

Three pieces, each with one job:

- ``ConstraintCompiler``: our tokenizer as llguidance sees it, and a cache of compiled
  constraints (one compilation per distinct ``Constraint``; a request takes a copy of the
  compiled matcher). ``compile`` raises ``ConstraintError`` with the library's reason: the
  front ends call it before a request is queued.
- ``ConstraintTracker``: the runner's per-request matcher state. Every step it brings each
  constrained row's matcher level with the row's output tokens (``_sync``: normally nothing to
  do; after a preemption, a lost state or any disagreement it rolls back or replays), fills
  the batch's masks in one parallel call (draft rows included: row i of a decode with drafts
  is the mask after the first i drafts), and after sampling consumes the accepted tokens.
  So a matcher always equals a fresh replay of its request's output tokens.
- ``allowed_token_ids`` / ``is_allowed``: reading a mask row (tests, the fake runner).

No torch here: the fake runner uses the tracker too. ``model_runner.sampler.apply_token_bitmask``
applies a mask to logits.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import llguidance as llg
import numpy as np

from scheduler.output import ScheduledSeq
from scheduler.request import Constraint

DEFAULT_CACHE_SIZE = 256


class ConstraintError(ValueError):
    """A constraint the grammar library cannot compile; the message is the library's."""


class TokenizerLike(Protocol):
    """What the compiler needs from ``model_runner.tokenizer.Tokenizer`` or ``ByteTokenizer``."""

    vocab_size: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    special_token_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...


class _TokenBytes:
    """Our tokenizer in the shape ``llguidance.TokenizerWrapper`` reads: every token's bytes,
    the special ids, EOS/BOS, and an encoder."""

    def __init__(self, tokenizer: TokenizerLike, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        # Ids past the tokenizer (padding rows of the LM head) are empty and never allowed.
        self.tokens = [
            tokenizer.token_bytes(i) if i < tokenizer.vocab_size else b"" for i in range(vocab_size)
        ]

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


# JSON as models write it, with no free whitespace: ``{"a": 1, "b": [2, 3]}``. Flexible
# whitespace would let a sampled model pad forever between tokens. A schema's own
# ``x-guidance`` options override these.
JSON_OPTIONS: dict[str, object] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (not yet checked: ``compile`` checks)."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind in ("json_object", "json_schema"):
            schema = spec if kind == "json_schema" else '{"type": "object"}'
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "choice":
            choices = json.loads(spec)
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise ConstraintError("choice must be a non-empty list of non-empty strings")
            return llg.grammar_from("choice", spec)
        if kind == "regex":
            return llg.grammar_from("regex", spec)
        return llg.grammar_from("grammar", spec)
    except ConstraintError:
        raise
    except ValueError as exc:  # json.JSONDecodeError included
        raise ConstraintError(f"invalid {kind}: {exc}") from exc


class ConstraintCompiler:
    """Compiles constraints against one vocabulary, with a cache; thread-safe.

    ``vocab_size`` is the model's (its LM head may have more rows than the tokenizer has
    tokens; those are never allowed).
    """

    def __init__(
        self,
        tokenizer: TokenizerLike,
        vocab_size: int | None = None,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if not tokenizer.eos_token_ids:
            raise ValueError("structured outputs need a tokenizer with an EOS token")
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.ll_tokenizer = llg.LLTokenizer(
            llg.TokenizerWrapper(_TokenBytes(tokenizer, self.vocab_size)),
            n_vocab=self.vocab_size,
            eos_token=list(tokenizer.eos_token_ids),
        )
        self.num_mask_words = (self.vocab_size + 31) // 32
        self.cache_size = cache_size
        self._cache: OrderedDict[Constraint, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        # Cumulative, read by metrics: compilations, cache hits, and time spent compiling.
        self.num_compiled_total = 0
        self.num_cache_hits_total = 0
        self.compile_time_s_total = 0.0

    def compile(self, constraint: Constraint) -> None:
        """Check and cache ``constraint``; raises ``ConstraintError`` with the reason."""
        self._template(constraint)

    def new_matcher(self, constraint: Constraint) -> llg.LLMatcher:
        """A fresh matcher for one request (a copy of the cached compilation; not counted
        as a cache hit: ``compile`` counted the request)."""
        return self._template(constraint, count_hit=False).deep_copy()

    def _template(self, constraint: Constraint, count_hit: bool = True) -> llg.LLMatcher:
        with self._lock:
            template = self._cache.get(constraint)
            if template is not None:
                self._cache.move_to_end(constraint)
                self.num_cache_hits_total += count_hit
                return template
        t0 = time.perf_counter()
        grammar = grammar_of(constraint)
        template = llg.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise ConstraintError(f"invalid {constraint.kind}: {template.get_error()}")
        with self._lock:
            self.compile_time_s_total += time.perf_counter() - t0
            self.num_compiled_total += 1
            self._cache[constraint] = template
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return template

    def empty_masks(self, num_rows: int) -> np.ndarray:
        """``num_rows`` masks allowing every token."""
        return np.full((num_rows, self.num_mask_words), -1, dtype=np.int32)

    def replay_mask(self, constraint: Constraint, token_ids: Sequence[int]) -> np.ndarray:
        """The mask after ``token_ids`` from a fresh matcher (what a tracked state must
        equal). Raises ``ConstraintError`` when the tokens leave the constraint."""
        matcher = self.new_matcher(constraint)
        if not _consume(matcher, token_ids):
            raise ConstraintError(f"tokens leave the constraint: {matcher.get_error()}")
        mask = self.empty_masks(1)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        row: np.ndarray = mask[0]
        return row


@dataclass(slots=True)
class _State:
    matcher: llg.LLMatcher
    token_ids: list[int] = field(default_factory=list)  # output tokens it has consumed


@dataclass(slots=True)
class Masks:
    """One step's masks: row i belongs to the i-th sampling row (a seq with k drafts takes
    k + 1 rows); None when no row is constrained. ``failed``: request id -> why its
    constraint cannot go on (the runner fails those requests)."""

    bitmask: np.ndarray | None
    failed: dict[str, str] = field(default_factory=dict)
    compute_time_s: float = 0.0


class ConstraintTracker:
    """Per-request matchers of one runner; only the runner's thread (and the mask thread it
    waits for) touches them."""

    def __init__(self, compiler: ConstraintCompiler, num_threads: int | None = None) -> None:
        self.compiler = compiler
        self._states: dict[str, _State] = {}
        self._executor = llg.LLExecutor(num_threads)

    def __len__(self) -> int:
        return len(self._states)

    def token_ids(self, request_id: str) -> list[int] | None:
        """The output tokens the request's matcher has consumed (None: no state)."""
        state = self._states.get(request_id)
        return None if state is None else list(state.token_ids)

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def compute_masks(self, seqs: Sequence[ScheduledSeq]) -> Masks:
        """The masks of every sampling row of ``seqs`` (see ``Masks``); syncs each
        constrained row's matcher with its output tokens first."""
        t0 = time.perf_counter()
        num_rows = sum(1 + s.num_draft_tokens for s in seqs)
        jobs: list[tuple[llg.LLMatcher, int, list[int]]] = []
        job_ids: list[str] = []
        drafts_valid: list[tuple[int, int, int]] = []  # (first row, valid drafts, drafts)
        failed: dict[str, str] = {}
        row = 0
        for seq in seqs:
            constraint = seq.sampling.constraint
            if constraint is not None:
                try:
                    error = self._sync(seq, constraint)
                except ConstraintError as exc:  # not checked by a front end: fail it alone
                    error = str(exc)
                if error is not None:
                    failed[seq.request_id] = error
                else:
                    matcher = self._states[seq.request_id].matcher
                    drafts = list(seq.token_ids[1:]) if seq.num_draft_tokens else []
                    jobs.append((matcher, row, drafts))
                    job_ids.append(seq.request_id)
                    if drafts:
                        drafts_valid.append((row, matcher.validate_tokens(drafts), len(drafts)))
            row += 1 + seq.num_draft_tokens
        if not jobs:
            return Masks(None, failed)
        bitmask = self.compiler.empty_masks(num_rows)
        words = self.compiler.num_mask_words
        plain = [(m, r) for m, r, drafts in jobs if not drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.ctypes.data, words * 4, num_rows)
        with_drafts = [job for job in jobs if job[2]]
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                with_drafts, bitmask.ctypes.data, words * 4, num_rows
            )
        # Rows after a draft the grammar rejects: their tokens are never accepted (the row
        # of the rejected draft samples a token that differs from it), so allow anything.
        # So do rows after a draft that ends the grammar (an EOS copied from the prompt):
        # a stopped matcher allows nothing, and an empty row would fail the request.
        for first, num_valid, num_drafts in drafts_valid:
            bitmask[first + num_valid + 1 : first + num_drafts + 1] = -1
            rows = bitmask[first + 1 : first + num_drafts + 1]
            rows[~rows.any(axis=1)] = -1
        for (matcher, first, _), request_id in zip(jobs, job_ids, strict=True):
            if not bitmask[first].any():
                failed[request_id] = f"the constraint allows no next token ({matcher.get_error()})"
        return Masks(bitmask, failed, time.perf_counter() - t0)

    def accept(self, seq: ScheduledSeq, token_ids: Sequence[int]) -> str | None:
        """Advance ``seq``'s matcher by the tokens this step produced (accepted drafts, then
        the sampled token); returns an error when they leave the constraint."""
        if seq.sampling.constraint is None:
            return None
        state = self._states.get(seq.request_id)
        if state is None:
            return None  # the next step's sync replays
        if not _consume(state.matcher, token_ids):
            error = state.matcher.get_error()
            del self._states[seq.request_id]
            return f"sampled token leaves the constraint: {error}"
        state.token_ids.extend(token_ids)
        return None

    def _sync(self, seq: ScheduledSeq, constraint: Constraint) -> str | None:
        """Bring the matcher level with the seq's output tokens: create it, consume what it
        has not seen, or roll back / replay where it disagrees (preemption, a lost step)."""
        output = seq.all_token_ids[seq.num_prompt_tokens :]
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = _State(self.compiler.new_matcher(constraint))
        seen = state.token_ids
        if len(seen) == len(output) and (not seen or seen[-1] == output[-1]):
            return None  # the usual case: the last step's token was accepted here
        common = 0
        for a, b in zip(seen, output, strict=False):
            if a != b:
                break
            common += 1
        matcher = state.matcher
        if common < len(seen) and not matcher.rollback(len(seen) - common):
            matcher.reset()
            common = 0
        del seen[common:]
        rest = list(output[common:])
        if rest and not _consume(matcher, rest):
            error = matcher.get_error()
            del self._states[seq.request_id]
            return f"output tokens leave the constraint: {error}"
        seen.extend(rest)
        return None


def _consume(matcher: llg.LLMatcher, token_ids: Iterable[int]) -> bool:
    """Feed tokens one at a time: ``consume_tokens([eos])`` on a matcher that has just
    stopped refuses the EOS that ``consume_token(eos)`` takes (llguidance 1.9)."""
    return all(matcher.consume_token(t) for t in token_ids)


def allowed_token_ids(mask_row: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids one mask row allows, ascending."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab_size]
    ids: list[int] = np.flatnonzero(bits).tolist()
    return ids


def is_allowed(mask_row: np.ndarray, token_id: int) -> bool:
    return bool((int(mask_row[token_id // 32]) >> (token_id % 32)) & 1)
