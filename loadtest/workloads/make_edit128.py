"""Writes ``prompts/edit128.json``: 64 "rewrite this with a small change" chat prompts.

    .venv/bin/python loadtest/workloads/make_edit128.py      # from the repository root

An input-grounded workload for speculative decoding (``edit128.json`` runs it): each prompt
asks SmolLM2-135M-Instruct to rewrite a piece of code (a rename) or text (one word replaced),
so most of a good answer copies the prompt. Half are Python functions, half README
paragraphs, each prompt 128-512 SmolLM2 tokens (the embedded GGUF's tokenizer, no BOS), in
the chat format of ``chat128.json`` (system prompt, user turn, open assistant turn).

Reproducible: the sources are files of this repository at a fixed commit (``git show``),
every choice is deterministic (sorted candidates, a seeded ``random.Random``), and the file
is written with sorted keys. Running the script again gives the same bytes.
"""

from __future__ import annotations

import ast
import builtins
import json
import keyword
import random
import re
import subprocess
import textwrap
from collections import Counter
from pathlib import Path

from model_runner.gguf_loader import default_model_path, read_metadata
from model_runner.tokenizer import Tokenizer

SOURCE_COMMIT = "6a72c81"  # main at the time edit128 was made
CODE_FILES = (
    "cache_manager/block.py",
    "cache_manager/block_pool.py",
    "cache_manager/eviction.py",
    "cache_manager/manager.py",
    "loadtest/generator.py",
    "loadtest/report.py",
    "loadtest/workload.py",
    "metrics/prometheus.py",
    "model_runner/kv_pool.py",
    "model_runner/sampler.py",
    "scheduler/policies.py",
    "scheduler/queue.py",
    "scheduler/scheduler.py",
    "server/engine.py",
    "server/outputs.py",
    "server/validation.py",
)
TEXT_FILES = ("README.md", "docs/metrics.md", "grafana/README.md")
NUM_CODE, NUM_TEXT = 32, 32
MIN_TOKENS, MAX_TOKENS = 128, 512
OUT = Path(__file__).resolve().parent / "prompts" / "edit128.json"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# Word replacements for the text prompts: the first that occurs in a paragraph is used.
WORDS = {
    "request": "query",
    "requests": "queries",
    "server": "service",
    "tokens": "pieces",
    "block": "page",
    "blocks": "pages",
    "cache": "store",
    "model": "network",
    "step": "round",
    "prompt": "input",
    "users": "clients",
    "runs": "executes",
    "time": "duration",
}


def chat(user: str) -> str:
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


def git_show(path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{SOURCE_COMMIT}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def code_prompts(rng: random.Random) -> list[str]:
    """Functions renamed: the most used local name of each function gets a new name."""
    reserved = set(dir(builtins)) | set(keyword.kwlist) | {"self", "cls"}
    candidates: list[str] = []
    for path in CODE_FILES:
        source = git_show(path)
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef):
                continue
            segment = ast.get_source_segment(source, node)
            if segment is None:
                continue
            segment = textwrap.dedent(" " * node.col_offset + segment)
            names = Counter(
                n.id
                for n in ast.walk(node)
                if isinstance(n, ast.Name) and len(n.id) >= 3 and n.id not in reserved
            )
            if not names:
                continue
            old = sorted(names.items(), key=lambda item: (-item[1], item[0]))[0][0]
            new = f"{old}_{rng.choice(['value', 'item', 'data', 'ref'])}"
            candidates.append(
                chat(
                    f"Rename the variable `{old}` to `{new}` in this Python function. Reply "
                    f"with the whole function and nothing else.\n\n```python\n{segment}\n```"
                )
            )
    return candidates


def text_prompts() -> list[str]:
    """Paragraphs (runs of non-blank lines, merged up to the length) with one word replaced."""
    candidates: list[str] = []
    for path in TEXT_FILES:
        paragraphs = [p.strip() for p in re.split(r"\n\s*\n", git_show(path)) if p.strip()]
        text = ""
        for paragraph in paragraphs:
            text = f"{text}\n\n{paragraph}" if text else paragraph
            if len(text) < 400:
                continue
            for old, new in WORDS.items():
                if re.search(rf"\b{old}\b", text):
                    candidates.append(
                        chat(
                            f'Rewrite this text, replacing the word "{old}" with "{new}". '
                            f"Keep everything else exactly as it is.\n\n{text}"
                        )
                    )
                    break
            text = ""
    return candidates


def pick(candidates: list[str], rng: random.Random, count: int, tokenizer: Tokenizer) -> list[str]:
    """``count`` of the candidates of MIN_TOKENS..MAX_TOKENS tokens, drawn with ``rng``."""
    sized = [c for c in candidates if MIN_TOKENS <= len(tokenizer.encode(c)) <= MAX_TOKENS]
    if len(sized) < count:
        raise SystemExit(f"only {len(sized)} prompts of {MIN_TOKENS}-{MAX_TOKENS} tokens")
    return rng.sample(sized, count)


def main() -> None:
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(default_model_path()))
    rng = random.Random(128)
    code = pick(code_prompts(rng), rng, NUM_CODE, tokenizer)
    text = pick(text_prompts(), rng, NUM_TEXT, tokenizer)
    prompts = [p for pair in zip(code, text, strict=True) for p in pair]
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    data = {
        "name": "edit128",
        "description": (
            f"{len(prompts)} chat prompts asking to rewrite a Python function (a rename) or a "
            f"README paragraph (one word replaced), {min(lengths)}-{max(lengths)} SmolLM2 "
            f"tokens (mean {sum(lengths) / len(lengths):.0f}, no BOS); code and text "
            f"alternate. Made by loadtest/workloads/make_edit128.py from this repository at "
            f"{SOURCE_COMMIT}."
        ),
        "prompt_tokens": lengths,
        "prompts": prompts,
    }
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}: {len(prompts)} prompts, {min(lengths)}-{max(lengths)} tokens")


if __name__ == "__main__":
    main()
