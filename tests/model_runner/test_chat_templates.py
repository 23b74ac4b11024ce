"""Each family's real chat template renders in kvserve exactly as transformers renders it.

The templates are copies in tests/data/chat_templates/ (see its README). Each is rendered by
kvserve's ``Tokenizer.apply_chat_template`` and by transformers'
``PreTrainedTokenizerFast(chat_template=...).apply_chat_template(tokenize=False)`` for the same
conversations, and the strings must be equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from model_runner.tokenizer import Tokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"

# family file -> (bos, eos)
SPECIALS = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": (None, "<|im_end|>"),
    "qwen3": (None, "<|im_end|>"),
    "mistral": ("<s>", "</s>"),
    "phi3": ("<s>", "<|endoftext|>"),
    "phi4": (None, "<|im_end|>"),
    "phi4_mini": (None, "<|endoftext|>"),
    "gemma3": ("<bos>", "<eos>"),
}
USES_TOOLS = ("llama3", "qwen2_5", "qwen3", "mistral")

SYSTEM = {"role": "system", "content": "You are terse.  "}
USER = {"role": "user", "content": " What is 2+2? Ünïcode 😀\n"}
ASSISTANT = {"role": "assistant", "content": "4."}
USER2 = {"role": "user", "content": "And 3+3?"}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user": [USER],
    "system_user": [SYSTEM, USER],
    "multi_turn": [SYSTEM, USER, ASSISTANT, USER2],
    "no_system_multi_turn": [USER, ASSISTANT, USER2],
    "ends_with_assistant": [USER, ASSISTANT],
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, in °C.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "Zürich, say"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_TURNS: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call12345",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Zürich"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call12345", "content": '{"temp": 21}'},
]


def backend(bos: str | None, eos: str) -> HFTokenizer:
    vocab = {"<unk>": 0, eos: 1, **({bos: 2} if bos else {})}
    return HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))


def pair(family: str) -> tuple[Tokenizer, Any]:
    """kvserve's tokenizer and transformers' with the same template and special tokens."""
    from transformers import PreTrainedTokenizerFast

    template = (TEMPLATES / f"{family}.jinja").read_text(encoding="utf-8")
    bos, eos = SPECIALS[family]
    ours = Tokenizer(
        backend(bos, eos),
        chat_template=template,
        special_tokens={"bos_token": bos, "eos_token": eos},
        name=family,
    )
    named = {"eos_token": eos, **({"bos_token": bos} if bos else {})}
    theirs = PreTrainedTokenizerFast(
        tokenizer_object=backend(bos, eos), chat_template=template, **named
    )
    return ours, theirs


def both(family: str, messages: list[dict[str, Any]], gen: bool, **extra: Any) -> tuple[str, str]:
    ours, theirs = pair(family)
    mine = ours.apply_chat_template(messages, add_generation_prompt=gen, **extra)
    ref = theirs.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False, **extra)
    return mine, ref


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("family", sorted(SPECIALS))
def test_renders_as_transformers(family: str, conversation: str, gen: bool) -> None:
    """System, multi-turn, with and without the generation prompt: the same string."""
    messages = CONVERSATIONS[conversation]
    mine, ref = both(family, messages, gen)
    assert mine == ref
    assert USER["content"].strip() in mine


@pytest.mark.parametrize("family", USES_TOOLS)
def test_tools_render_as_transformers(family: str) -> None:
    """Tools, a tool call and its result: the same string, with the tool's schema in it."""
    mine, ref = both(family, TOOL_TURNS, True, tools=TOOLS)
    assert mine == ref
    assert "get_weather" in mine and "Zürich" in mine


@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_qwen3_enable_thinking(enable_thinking: bool | None) -> None:
    """Qwen3's switch: false closes an empty think block after the generation prompt."""
    extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    history = [
        USER,
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4."},
        USER2,
    ]
    mine, ref = both("qwen3", history, True, **extra)
    assert mine == ref
    assert mine.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)
    assert "<think>\nadd" not in mine  # reasoning of past turns is dropped


def test_template_errors_are_value_errors() -> None:
    """A template's raise_exception (Mistral's role alternation) is a ValueError naming it."""
    ours, _ = pair("mistral")
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template([USER, USER2])


def test_transformers_environment() -> None:
    """tojson's options, dict(), namespace, strftime_now, {% generation %}, tools is none."""
    from transformers import PreTrainedTokenizerFast

    template = (
        "{{ messages[0] | tojson(indent=2, sort_keys=true, separators=[',', ': ']) }}"
        "{% set d = dict(a=1) %}{{ d | tojson }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
        "{% generation %}{{ strftime_now('%Y') }}{% endgeneration %}"
        "{{ tools is none }}{{ documents is none }}{{ 'é' | tojson }}"
    )
    messages = [{"role": "user", "content": "hé"}]
    ours = Tokenizer(backend(None, "</s>"), chat_template=template)
    theirs = PreTrainedTokenizerFast(tokenizer_object=backend(None, "</s>"), chat_template=template)
    mine = ours.apply_chat_template(messages)
    assert mine == theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert '"content": "hé",\n' in mine and "TrueTrue" in mine


def test_namespace_refuses_underscore_names() -> None:
    """The sandbox's namespace refuses _-prefixed attributes (as transformers')."""
    ours = Tokenizer(
        backend(None, "</s>"), chat_template="{% set ns = namespace(_x=1) %}{{ ns._x }}"
    )
    with pytest.raises(ValueError, match="underscore"):
        ours.apply_chat_template([USER])


def test_named_tool_use_template_is_picked_with_tools(tmp_path: Path) -> None:
    """A list of named templates: "default" without tools, "tool_use" with them, as
    transformers picks; the same from a GGUF's tokenizer.chat_template.tool_use."""
    from transformers import PreTrainedTokenizerFast

    named = [
        {"name": "default", "template": "plain:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ messages[0].content }}"},
    ]
    theirs = PreTrainedTokenizerFast(
        tokenizer_object=backend(None, "</s>"),
        chat_template={t["name"]: t["template"] for t in named},
    )
    theirs.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = named  # the list form tokenizer_config.json files carry
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    from_dir = Tokenizer.from_hf_dir(tmp_path)
    from_gguf = Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": ["</s>", "a"],
            "tokenizer.chat_template": named[0]["template"],
            "tokenizer.chat_template.tool_use": named[1]["template"],
        }
    )
    for ours in (from_dir, from_gguf):
        for tools in (None, TOOLS):
            extra = {} if tools is None else {"tools": tools}
            mine = ours.apply_chat_template([USER2], **extra)
            assert mine == theirs.apply_chat_template([USER2], tokenize=False, **extra)
            assert mine.startswith("tools:1:" if tools else "plain:")
