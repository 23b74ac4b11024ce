"""The number guard of JSON constraints (model_runner/constraints.py): a JSON number has at
most 17 significant digits and 3 exponent digits, digits inside strings are free, a schema
that needs a longer number still gets it, and a model that keeps drawing digits ends anyway
(with and without speculative drafts). And objects that list their properties are closed."""

from __future__ import annotations

import json
import re

import pytest

from model_runner.constraints import (
    MAX_EXPONENT_DIGITS,
    MAX_LEADING_ZEROS,
    MAX_NUMBER_DIGITS,
    ConstraintTracker,
    allowed_token_ids,
    closed_objects,
    number_guard_regex,
)
from scheduler.request import Constraint, FinishReason
from tests.model_runner.test_constraints import byte_compiler, fake_runner, request, run, text

NUMBER = Constraint("json_schema", '{"type": "number"}')
TEMP = Constraint(
    "json_schema",
    '{"type": "object", "properties": {"temp_c": {"type": "number", "minimum": -50, '
    '"maximum": 60}}, "required": ["temp_c"], "additionalProperties": false}',
)
DIGITS = set(b"0123456789")


def allowed_after(constraint: Constraint, prefix: str) -> set[int]:
    """The byte ids a fresh replay of ``prefix`` allows next."""
    row = byte_compiler().replay_mask(constraint, list(prefix.encode()))
    return set(allowed_token_ids(row, 258))


def test_bounds_are_a_doubles() -> None:
    """The documented bounds: 17 significant digits, 16 free leading zeros, 3 exponent
    digits."""
    assert (MAX_NUMBER_DIGITS, MAX_LEADING_ZEROS, MAX_EXPONENT_DIGITS) == (17, 16, 3)


@pytest.mark.parametrize(
    ("prefix", "digit_allowed"),
    [
        ("1234567890123456", True),  # 16 digits: a 17th may come
        ("12345678901234567", False),  # 17: an 18th is masked
        ("-12345678901234567", False),
        ("1.234567890123456", True),
        ("1.2345678901234567", False),  # 17 across the integer and fraction parts
        ("12345678.901234567", False),
        ("0.12345678901234567", False),  # "0." does not count
        ("0.1234567890123456", True),
        ("0." + "0" * 16, True),  # 16 leading zeros, then a significant digit...
        ("0." + "0" * 16 + "12345678901234567", False),
        ("1e12", True),  # 2 exponent digits: a 3rd may come
        ("1e123", False),  # a 4th is masked
        ("1.5E-99", True),
        ("1.5E-999", False),
        ("2e+100", False),
    ],
)
def test_digits_of_a_number_are_bounded(prefix: str, digit_allowed: bool) -> None:
    """After ``prefix`` of a number, a further digit is allowed or masked."""
    allowed = allowed_after(NUMBER, prefix)
    assert bool(allowed & DIGITS) is digit_allowed, sorted(allowed)
    assert allowed, "the number can always end or go on"


def test_leading_zeros_run_out_at_sixteen() -> None:
    """After ``0.`` and 16 zeros a 17th zero is masked, a digit 1-9 is not."""
    allowed = allowed_after(NUMBER, "0." + "0" * 16) & DIGITS
    assert allowed == set(b"123456789")


def test_digits_inside_strings_are_free() -> None:
    """A string of 40 digits goes on: the guard bounds numbers, not text."""
    schema = Constraint(
        "json_schema",
        '{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}',
    )
    assert allowed_after(schema, '{"s": "' + "7" * 40) & DIGITS == DIGITS
    assert allowed_after(schema, '{"s": "\\"' + "7" * 40) & DIGITS == DIGITS  # an escape


def test_numbers_in_objects_and_arrays_and_json_object() -> None:
    """Every number of a document is bounded, wherever it stands, under a schema and under
    ``json_object``; the bound starts again at each number."""
    array = Constraint("json_schema", '{"type": "array", "items": {"type": "number"}}')
    assert not allowed_after(array, "[1, " + "9" * 17) & DIGITS
    assert allowed_after(array, "[" + "9" * 17 + ", " + "9" * 16) & DIGITS == DIGITS
    any_object = Constraint("json_object")
    assert not allowed_after(any_object, '{"a": [' + "5" * 17) & DIGITS
    assert not allowed_after(TEMP, '{"temp_c": 9.' + "4" * 16) & DIGITS
    assert allowed_after(TEMP, '{"temp_c": 9.' + "4" * 15) & DIGITS == DIGITS


def test_integers_within_their_bounds_are_unchanged() -> None:
    """An integer schema with bounds keeps the schema's own range regex."""
    schema = Constraint("json_schema", '{"type": "integer", "minimum": 0, "maximum": 99}')
    assert allowed_after(schema, "9") & DIGITS == DIGITS
    assert not allowed_after(schema, "99") & DIGITS


def test_a_schema_that_needs_a_longer_number_still_gets_it() -> None:
    """A ``const`` of 21 digits (1e20, which llguidance writes out): the guard steps aside
    (the row keeps the schema's mask) and the request ends with that number."""
    const = Constraint("json_schema", '{"const": 100000000000000000000}')
    tracker = ConstraintTracker(byte_compiler())
    outputs, finish, _ = run(fake_runner(tracker), tracker, [request("c", const)])
    assert finish["c"] is FinishReason.STOP
    assert text(outputs["c"]) == "1" + "0" * 20


@pytest.mark.parametrize("speculative", [False, True])
def test_a_model_that_keeps_drawing_digits_ends(speculative: bool) -> None:
    """The fake runner scripted to write pi's digits for ever (and, speculating, drafting
    them from a prompt that holds them): the answer stops at 17 digits, ends with EOS and
    parses."""
    pi = b"3.14159265358979323846264338327950288419716939937510582097494459230781640628"
    tracker = ConstraintTracker(byte_compiler())
    script = {"n": list(pi * 2), "t": list(b'{"temp_c": ' + pi)}
    extra: dict[str, object] = {}
    if speculative:
        extra = dict(speculative="ngram", num_speculative_tokens=3, ngram_max=3, ngram_min=1)
    extra["max_model_len"] = 256
    prompt = pi.decode() if speculative else "go:"
    reqs = [
        request("n", NUMBER, prompt=prompt, max_tokens=120),
        request("t", TEMP, prompt=prompt, max_tokens=120),
    ]
    outputs, finish, scheduler = run(fake_runner(tracker, script=script), tracker, reqs, **extra)
    assert finish == {"n": FinishReason.STOP, "t": FinishReason.STOP}
    if speculative:  # drafts of pi's digits accepted, and the ones past the bound refused
        stats = scheduler.make_stats()
        assert 0 < stats.num_spec_accepted_tokens_total < stats.num_spec_draft_tokens_total
    number = text(outputs["n"])
    json.loads(number)  # an exponent may follow (3 digits at most), so it may be inf
    mantissa, _, exponent = number.lower().partition("e")
    assert mantissa == "3.1415926535897932" and len(exponent.lstrip("+-")) <= 3, number
    assert -50 <= json.loads(text(outputs["t"]))["temp_c"] <= 60


def test_the_guard_matches_json_numbers_only() -> None:
    """The guard's expression, read by Python's re: every JSON text with bounded numbers
    matches, an 18-digit number or a 4-digit exponent does not."""
    guard = re.compile(number_guard_regex().replace("(?s:.)", "[\\s\\S]"))
    for good in ['{"a": [1, -2.5, 3e10], "b": "x99999999999999999999"}', "0.5", "[]", "-0"]:
        assert guard.fullmatch(good), good
    for bad in ["123456789012345678", "[1e1234]", '{"a": 1.23456789012345678}']:
        assert not guard.fullmatch(bad), bad


# ---------------------------------------------------------------------- closed objects


def test_objects_that_list_properties_are_closed() -> None:
    """An object with ``properties`` and nothing said of others takes no others, at any
    depth (items, anyOf, $defs, a property's schema); what a schema says stays."""
    leaf = {"type": "object", "properties": {"a": {"type": "number"}}}
    closed = {**leaf, "additionalProperties": False}
    schema = {
        "type": "object",
        "properties": {"properties": leaf, "list": {"type": "array", "items": leaf}},
        "anyOf": [leaf],
        "$defs": {"d": leaf},
    }
    assert closed_objects(schema) == {
        "type": "object",
        "properties": {"properties": closed, "list": {"type": "array", "items": closed}},
        "anyOf": [closed],
        "$defs": {"d": closed},
        "additionalProperties": False,
    }
    for kept in (
        {**leaf, "additionalProperties": True},
        {**leaf, "additionalProperties": {"type": "string", "maxLength": 3}},
        {**leaf, "patternProperties": {"^x": {"type": "number"}}},
        {**leaf, "required": ["a", "b"]},  # "b" must come as an other property
        {"type": "object"},
        {"enum": [{"properties": 1}]},  # data, not a schema
    ):
        assert closed_objects(kept) == kept
    all_of = {"allOf": [leaf, {"properties": {"b": {"type": "number"}}}]}
    assert closed_objects(all_of) == all_of  # each member would forbid the other's


def test_a_closed_object_ends_after_its_properties() -> None:
    """Issue 46's number schema as sent (no additionalProperties): after its one property
    the object can only close."""
    open_schema = Constraint(
        "json_schema",
        '{"type": "object", "properties": {"temp_c": {"type": "number", "minimum": -50, '
        '"maximum": 60}}, "required": ["temp_c"]}',
    )
    assert allowed_after(open_schema, '{"temp_c": 12.5') - DIGITS == {ord("}")}
