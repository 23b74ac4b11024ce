"""Chat templates compiled and rendered as transformers' ``apply_chat_template`` does.

The environment is transformers' (``utils/chat_template_utils.py``): an immutable jinja2
sandbox with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and the
``{% generation %}`` tag (rendered as its body: kvserve tracks no assistant mask),
``raise_exception``, ``strftime_now``, a ``tojson`` that keeps non-ASCII text and takes
``indent`` / ``separators`` / ``sort_keys``, and ``dict`` / ``namespace`` globals that refuse
underscore-prefixed names. ``tools`` and ``documents`` are always defined (None when not
given), so a template's ``tools is not none`` reads as it does under transformers.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.nodes
import jinja2.utils
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 reads the class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        text: str = caller()
        return text


class _Namespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` that refuses ``_``-prefixed attributes (as transformers')."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes ({name!r})"
        )


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, nothing else of the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    seps = (str(separators[0]), str(separators[1])) if separators is not None else None
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=seps, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """The compiled template; ValueError (with jinja2's reason) if it does not compile."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template does not compile: {e}") from e


def render(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    special_tokens: Mapping[str, str | None],
    extra: Mapping[str, Any],
) -> str:
    """The template's text for ``messages`` (transformers' variables: ``tools`` and
    ``documents`` default to None; the special tokens; then ``extra``, which wins over a
    special token's name). ValueError for anything the template raises."""
    names: dict[str, Any] = {k: v for k, v in special_tokens.items() if v is not None}
    names.update(extra)
    names.update(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        tools=extra.get("tools"),
        documents=extra.get("documents"),
    )
    try:
        text: str = template.render(**names)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
    except (TypeError, KeyError, IndexError, AttributeError, ValueError) as e:
        # A message the template cannot handle ('a' + None, a missing key): the request's fault.
        raise ValueError(f"chat template error: {type(e).__name__}: {e}") from e
    return text
