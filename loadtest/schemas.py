"""Constrained workloads: 20 JSON schemas (nested objects, arrays, enums, bounded numbers,
required and optional fields), regexes and choice lists, each with a prompt that asks for it.

The load tester sends them (``--constraint json``), ``benchmarks/bench_constraints.py``
measures the grammar libraries on them, and the acceptance test validates sampled outputs
against them. Strings and arrays are bounded so that a sampled answer always ends.
"""

from __future__ import annotations

import json
from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 20}
_SHORT = {"type": "string", "maxLength": 40}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {
        "type": "object",
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }),
    ("a city and its country", {
        "type": "object",
        "properties": {"city": _NAME, "country": _NAME, "capital": {"type": "boolean"}},
        "required": ["city", "country"], "additionalProperties": False,
    }),
    ("a product with a price", {
        "type": "object",
        "properties": {
            "product": _NAME,
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "currency": {"enum": ["USD", "EUR", "GBP"]},
        },
        "required": ["product", "price", "currency"], "additionalProperties": False,
    }),
    ("the weather", {
        "type": "object",
        "properties": {
            "condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            "temperature_c": {"type": "integer", "minimum": -40, "maximum": 50},
        },
        "required": ["condition", "temperature_c"], "additionalProperties": False,
    }),
    ("a list of three colours", {
        "type": "object",
        "properties": {"colours": {"type": "array", "items": _NAME, "minItems": 3,
                                   "maxItems": 3}},
        "required": ["colours"], "additionalProperties": False,
    }),
    ("a book", {
        "type": "object",
        "properties": {
            "title": _SHORT,
            "author": {"type": "object", "properties": {"first": _NAME, "last": _NAME},
                       "required": ["first", "last"], "additionalProperties": False},
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
        },
        "required": ["title", "author", "year"], "additionalProperties": False,
    }),
    ("a to-do list", {
        "type": "object",
        "properties": {"items": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"task": _SHORT, "done": {"type": "boolean"}},
            "required": ["task", "done"], "additionalProperties": False,
        }}},
        "required": ["items"], "additionalProperties": False,
    }),
    ("a rating", {
        "type": "object",
        "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                       "comment": _SHORT},
        "required": ["stars"], "additionalProperties": False,
    }),
    ("a point in 3D", {
        "type": "object",
        "properties": {k: {"type": "number", "minimum": -100, "maximum": 100}
                       for k in ("x", "y", "z")},
        "required": ["x", "y", "z"], "additionalProperties": False,
    }),
    ("a user profile", {
        "type": "object",
        "properties": {
            "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,11}$"},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["new", "vip", "staff"]},
                     "maxItems": 3},
        },
        "required": ["username", "role", "active"], "additionalProperties": False,
    }),
    ("an order", {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 10}},
                "required": ["sku", "qty"], "additionalProperties": False,
            }},
        },
        "required": ["order_id", "lines"], "additionalProperties": False,
    }),
    ("a yes or no answer with a reason", {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "reason": _SHORT},
        "required": ["answer", "reason"], "additionalProperties": False,
    }),
    ("a date", {
        "type": "object",
        "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "month": {"type": "integer", "minimum": 1, "maximum": 12},
                       "day": {"type": "integer", "minimum": 1, "maximum": 31}},
        "required": ["year", "month", "day"], "additionalProperties": False,
    }),
    ("a recipe", {
        "type": "object",
        "properties": {
            "dish": _NAME,
            "ingredients": {"type": "array", "items": _NAME, "minItems": 1, "maxItems": 5},
            "minutes": {"type": "integer", "minimum": 1, "maximum": 240},
            "vegetarian": {"type": "boolean"},
        },
        "required": ["dish", "ingredients", "minutes"], "additionalProperties": False,
    }),
    ("a temperature reading", {
        "type": "object",
        "properties": {"value": {"type": "number", "exclusiveMinimum": -273.15,
                                 "maximum": 1000},
                       "unit": {"enum": ["C", "F", "K"]}},
        "required": ["value", "unit"], "additionalProperties": False,
    }),
    ("a company", {
        "type": "object",
        "properties": {
            "name": _NAME,
            "employees": {"type": "integer", "minimum": 1, "maximum": 1000000},
            "address": {"type": "object", "properties": {"street": _SHORT, "city": _NAME,
                                                        "zip": {"type": "string",
                                                                "pattern": "^[0-9]{5}$"}},
                        "required": ["city"], "additionalProperties": False},
        },
        "required": ["name", "address"], "additionalProperties": False,
    }),
    ("a list of scores", {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 100},
        "minItems": 2, "maxItems": 6,
    }),
    ("a key-value setting", {
        "type": "object",
        "properties": {"key": {"type": "string", "pattern": "^[a-z_]{1,16}$"},
                       "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                           {"type": "boolean"}, _NAME]}},
        "required": ["key", "value"], "additionalProperties": False,
    }),
    ("a movie", {
        "type": "object",
        "properties": {
            "title": _SHORT,
            "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action",
                                                          "horror", "sci-fi"]},
                       "minItems": 1, "maxItems": 2},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["title", "genres"], "additionalProperties": False,
    }),
    ("an event with optional notes", {
        "type": "object",
        "properties": {
            "event": _NAME,
            "attendees": {"type": "integer", "minimum": 0, "maximum": 500},
            "notes": {"type": ["string", "null"], "maxLength": 30},
            "public": {"type": "boolean"},
        },
        "required": ["event", "attendees"], "additionalProperties": False,
    }),
]  # fmt: skip

REGEXES: list[tuple[str, str]] = [
    ("a phone number like 555-123-4567", r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("an ISO date", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("an email address", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"),
    ("a time of day like 09:30", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("a hex colour", r"#[0-9a-f]{6}"),
]

CHOICES: list[tuple[str, list[str]]] = [
    ("Is the sky blue? Answer yes or no.", ["yes", "no"]),
    ("Pick a sentiment for 'I love it'.", ["positive", "negative", "neutral"]),
    ("Which is a fruit?", ["apple", "carrot", "potato", "onion"]),
]


def schema_prompt(what: str, schema: dict[str, Any]) -> str:
    """A chat prompt asking for ``what`` as JSON that follows ``schema``."""
    return f"Give me {what} as JSON following this schema: {json.dumps(schema)}"
