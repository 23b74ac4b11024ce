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

**Bounded numbers.** A JSON grammar allows a number any count of digits, and a sampled model
at temperature 1 can keep drawing them until ``max_tokens`` (``{"t": 9.48871712233874292...``).
So every JSON constraint (``json_schema``, ``json_object``: response formats, tools'
arguments, gRPC alike) runs beside a second llguidance matcher, the **number guard**: one
regular expression over the whole output that tracks strings and bounds each number outside
them to ``MAX_NUMBER_DIGITS`` significant digits (a double's 17; up to
``MAX_LEADING_ZEROS`` zeros after ``0.`` do not count) and ``MAX_EXPONENT_DIGITS`` exponent
digits. A row's mask is the schema's AND the guard's. Where the schema itself needs a longer
number (a ``const`` or ``enum`` of one, a bound of 10**18 or more) the AND is empty: the row
keeps the schema's mask and the guard is dropped for that request, so the guard never fails a
request that the schema allows.

**Closed objects.** Likewise a schema's object that lists ``properties`` and says nothing of
others takes no others (``closed_objects``: OpenAI's strict mode and xgrammar's, vLLM's
default, read it so), or a model adds a property of its own with a string that never ends.

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


# The number guard's bounds (see the module docstring; docs/api.md).
MAX_NUMBER_DIGITS = 17
MAX_LEADING_ZEROS = 16
MAX_EXPONENT_DIGITS = 3
GUARDED_KINDS = frozenset({"json_object", "json_schema"})


def number_guard_regex(
    max_digits: int = MAX_NUMBER_DIGITS,
    max_leading_zeros: int = MAX_LEADING_ZEROS,
    max_exponent_digits: int = MAX_EXPONENT_DIGITS,
) -> str:
    """The number guard: any text whose JSON strings are skipped and whose numbers outside
    them have at most ``max_digits`` significant digits and ``max_exponent_digits`` exponent
    digits. A number must be followed by what JSON allows after one (``,``, ``]``, ``}``,
    whitespace) or end the text, so two runs of digits never count as two numbers.

    ::

        -?  0 | 0.000 (<= Z zeros) | 0.00 (<= Z) 1234 (<= D)     e|E +|- 123 (<= X)
            123.45 | 12345 (<= D digits, first one 1-9)
    """
    d, z = max_digits, max_leading_zeros
    mantissa = [
        rf"0(?:\.(?:0{{1,{z}}}|0{{0,{z}}}[1-9][0-9]{{0,{d - 1}}}))?",
        rf"[1-9][0-9]{{0,{d - 1}}}",
        *(rf"[1-9][0-9]{{{i}}}\.[0-9]{{1,{d - 1 - i}}}" for i in range(d - 1)),
    ]
    number = rf"-?(?:{'|'.join(mantissa)})(?:[eE][+-]?[0-9]{{1,{max_exponent_digits}}})?"
    string = r'"(?:[^"\\]|\\(?s:.))*"'
    return rf'(?:{string}|{number}[,\]}}\s]|[^"0-9\-])*(?:{number})?'


# Keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE_SCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: object, in_all_of: bool = False) -> object:
    """``schema`` with every object that lists ``properties`` and says nothing of other
    ones closed (``additionalProperties: false``), as OpenAI's strict structured outputs
    and xgrammar's strict mode (vLLM's default) read a schema. Otherwise a sampled model
    may add a property of its own with a string that never ends. Members of an ``allOf``
    stay open (each would forbid the others' properties); their subschemas do not."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE_SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, in_all_of=True) for sub in out["allOf"]]
    if (
        not in_all_of
        and isinstance(out.get("properties"), dict)
        and not any(key in out for key in _OPEN_KEYS)
        and set(out.get("required") or ()) <= set(out["properties"])  # or it is unsatisfiable
    ):
        out["additionalProperties"] = False
    return out


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of ``constraint`` (not yet checked: ``compile`` checks)."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind in ("json_object", "json_schema"):
            schema = spec if kind == "json_schema" else '{"type": "object"}'
            if kind == "json_schema":
                schema = json.dumps(closed_objects(json.loads(spec)))
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
        self._guard: llg.LLMatcher | None = None  # the number guard, compiled on first use

    def compile(self, constraint: Constraint) -> None:
        """Check and cache ``constraint``; raises ``ConstraintError`` with the reason."""
        self._template(constraint)

    def new_matcher(self, constraint: Constraint) -> llg.LLMatcher:
        """A fresh matcher for one request (a copy of the cached compilation; not counted
        as a cache hit: ``compile`` counted the request)."""
        return self._template(constraint, count_hit=False).deep_copy()

    def new_guard(self, constraint: Constraint) -> llg.LLMatcher | None:
        """A fresh number guard for one request of a JSON kind; None for the other kinds
        (a regex or grammar says itself how long its numbers are)."""
        if constraint.kind not in GUARDED_KINDS:
            return None
        with self._lock:
            if self._guard is None:
                guard = llg.LLMatcher(
                    self.ll_tokenizer, llg.grammar_from("regex", number_guard_regex()), log_level=0
                )
                if guard.is_error():  # a bug: the expression is ours
                    raise RuntimeError(f"the number guard does not compile: {guard.get_error()}")
                self._guard = guard
            return self._guard.deep_copy()

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
        guard = self.new_guard(constraint)
        if guard is not None and not _consume(guard, token_ids):
            guard = None  # the schema needed a longer number: the guard is off
        masks = self.empty_masks(2)
        matcher.unsafe_compute_mask_ptr(masks[0].ctypes.data, masks[0].nbytes)
        if guard is not None:
            guard.unsafe_compute_mask_ptr(masks[1].ctypes.data, masks[1].nbytes)
        row: np.ndarray = masks[0]
        both = masks[0] & masks[1]
        return both if both.any() else row


@dataclass(slots=True)
class _State:
    matcher: llg.LLMatcher
    guard: llg.LLMatcher | None  # the number guard (JSON kinds); None: none, or dropped
    token_ids: list[int] = field(default_factory=list)  # output tokens both have consumed

    def consume_guard(self, token_ids: Sequence[int]) -> None:
        """Advance the guard; a token it refuses was one the schema needed (the row fell
        back to the schema's mask), so the guard is dropped for the request."""
        if self.guard is not None and not _consume(self.guard, token_ids):
            self.guard = None


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
        jobs: list[tuple[_State, int, list[int]]] = []  # (state, first row, drafts)
        job_ids: list[str] = []
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
                    drafts = list(seq.token_ids[1:]) if seq.num_draft_tokens else []
                    jobs.append((self._states[seq.request_id], row, drafts))
                    job_ids.append(seq.request_id)
            row += 1 + seq.num_draft_tokens
        if not jobs:
            return Masks(None, failed)
        # Rows [0, num_rows) the schemas' masks, [num_rows, 2 num_rows) the guards' (all
        # allowed where a row has none): both filled in one parallel call per kind.
        masks = self.compiler.empty_masks(2 * num_rows)
        plain: list[tuple[llg.LLMatcher, int]] = []
        with_drafts: list[tuple[llg.LLMatcher, int, list[int]]] = []
        for state, first, drafts in jobs:
            for matcher, mask_row in _matchers(state, first, num_rows):
                if drafts:
                    with_drafts.append((matcher, mask_row, drafts))
                else:
                    plain.append((matcher, mask_row))
        ptr, row_bytes = masks.ctypes.data, self.compiler.num_mask_words * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, ptr, row_bytes, 2 * num_rows)
        if with_drafts:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                with_drafts, ptr, row_bytes, 2 * num_rows
            )
        bitmask, guards = masks[:num_rows], masks[num_rows:]
        both = bitmask & guards
        keep = both.any(axis=1)  # an empty AND: the schema needs what the guard bounds
        bitmask[keep] = both[keep]
        for (state, first, drafts), request_id in zip(jobs, job_ids, strict=True):
            if not bitmask[first].any():
                failed[request_id] = (
                    f"the constraint allows no next token ({state.matcher.get_error()})"
                )
            if not drafts:
                continue
            # Rows after a draft the grammar (or the guard) rejects: their tokens are never
            # accepted (the row of the rejected draft samples a token that differs from it),
            # so allow anything. So do rows after a draft that ends the grammar (an EOS
            # copied from the prompt): a stopped matcher allows nothing, and an empty row
            # would fail the request.
            num_valid = min(m.validate_tokens(drafts) for m, _ in _matchers(state, first, 0))
            bitmask[first + num_valid + 1 : first + len(drafts) + 1] = -1
            rows = bitmask[first + 1 : first + len(drafts) + 1]
            rows[~rows.any(axis=1)] = -1
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
        state.consume_guard(token_ids)
        state.token_ids.extend(token_ids)
        return None

    def _sync(self, seq: ScheduledSeq, constraint: Constraint) -> str | None:
        """Bring the matcher level with the seq's output tokens: create it, consume what it
        has not seen, or roll back / replay where it disagrees (preemption, a lost step)."""
        output = seq.all_token_ids[seq.num_prompt_tokens :]
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = _State(
                self.compiler.new_matcher(constraint), self.compiler.new_guard(constraint)
            )
        seen = state.token_ids
        if len(seen) == len(output) and (not seen or seen[-1] == output[-1]):
            return None  # the usual case: the last step's token was accepted here
        common = 0
        for a, b in zip(seen, output, strict=False):
            if a != b:
                break
            common += 1
        matcher, guard = state.matcher, state.guard
        back = len(seen) - common
        if back and not (
            matcher.rollback(back) and (guard is None or guard.rollback(back))
        ):  # fmt: skip
            matcher.reset()
            state.guard = self.compiler.new_guard(constraint)
            common = 0
        del seen[common:]
        rest = list(output[common:])
        if rest and not _consume(matcher, rest):
            error = matcher.get_error()
            del self._states[seq.request_id]
            return f"output tokens leave the constraint: {error}"
        state.consume_guard(rest)
        seen.extend(rest)
        return None


def _matchers(state: _State, row: int, guard_offset: int) -> list[tuple[llg.LLMatcher, int]]:
    """``state``'s matchers with the mask row each fills: the schema's at ``row``, the
    guard's (if any) ``guard_offset`` rows further."""
    pairs = [(state.matcher, row)]
    if state.guard is not None:
        pairs.append((state.guard, row + guard_offset))
    return pairs


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
