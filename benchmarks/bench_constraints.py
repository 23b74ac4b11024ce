"""llguidance vs xgrammar on kvserve's workloads: SmolLM2's 49k vocabulary (from the embedded
GGUF), the 20 JSON schemas, regexes and choice lists of ``loadtest.schemas``.

Per library: the tokenizer set-up time, how many of the 20 schemas compile (coverage), the
compile time per constraint (cold: each library's cache is cleared by building a fresh
compiler), and the mask time per token: a seeded walk through each constraint (mask, pick
an allowed token, consume it) for up to ``--steps`` tokens, the same token sequence for both
libraries (the walk picks among the tokens BOTH allow, so the libraries see equal work).

    python -m benchmarks.bench_constraints [--steps 64]

xgrammar is not a kvserve dependency: ``pip install -c /tmp/torch-pin.txt xgrammar`` to
run its column (the script says so when it is missing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import llguidance as llg
import numpy as np

from loadtest.schemas import CHOICES, REGEXES, SCHEMAS
from model_runner.constraints import ConstraintCompiler, allowed_token_ids, grammar_of
from model_runner.gguf_loader import default_model_path, read_metadata
from model_runner.tokenizer import Tokenizer
from scheduler.request import Constraint


@dataclass
class Result:
    name: str
    setup_s: float = 0.0
    compiled: int = 0
    failures: list[str] = field(default_factory=list)
    compile_s: list[float] = field(default_factory=list)
    mask_s: list[float] = field(default_factory=list)


class _Matcher(Protocol):
    """One library's matcher for one constraint."""

    def timed_mask(self) -> None: ...  # compute the next mask (what is timed)

    def mask(self) -> set[int]: ...  # the allowed ids

    def consume(self, token: int) -> None: ...

    def done(self) -> bool: ...


def _constraints() -> list[Constraint]:
    out = [Constraint("json_schema", json.dumps(s)) for _, s in SCHEMAS]
    out += [Constraint("regex", r) for _, r in REGEXES]
    out += [Constraint("choice", json.dumps(c)) for _, c in CHOICES]
    return out


def llguidance_lib(tokenizer: Tokenizer, vocab_size: int) -> tuple[float, Callable[..., Any]]:
    t0 = time.perf_counter()
    base = ConstraintCompiler(tokenizer, vocab_size)
    setup_s = time.perf_counter() - t0

    def compile_(constraint: Constraint) -> Callable[[], Any]:
        template = llg.LLMatcher(base.ll_tokenizer, grammar_of(constraint), log_level=0)
        if template.is_error():
            raise ValueError(template.get_error())

        def make() -> Any:
            m = template.deep_copy()
            mask = base.empty_masks(1)

            class M:
                def mask(self) -> set[int]:
                    m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
                    return set(allowed_token_ids(mask[0], vocab_size))

                def timed_mask(self) -> None:
                    m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

                def consume(self, token: int) -> None:
                    assert m.consume_token(token), m.get_error()

                def done(self) -> bool:
                    return bool(m.is_stopped())

            return M()

        return make

    return setup_s, compile_


def xgrammar_lib(tokenizer: Tokenizer, vocab_size: int) -> tuple[float, Callable[..., Any]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
    info = xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=vocab_size,
        stop_token_ids=list(tokenizer.eos_token_ids),
    )
    setup_s = time.perf_counter() - t0

    def compile_(constraint: Constraint) -> Callable[[], Any]:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if constraint.kind == "json_schema":
            grammar = compiler.compile_json_schema(
                constraint.spec, any_whitespace=False, separators=(", ", ": ")
            )
        elif constraint.kind == "regex":
            grammar = compiler.compile_regex(constraint.spec)
        else:
            choices = json.loads(constraint.spec)
            ebnf = "root ::= " + " | ".join(json.dumps(c) for c in choices)
            grammar = compiler.compile_grammar(ebnf)

        def make() -> Any:
            m = xgr.GrammarMatcher(grammar)
            bitmask = xgr.allocate_token_bitmask(1, vocab_size)

            class M:
                def mask(self) -> set[int]:
                    m.fill_next_token_bitmask(bitmask)
                    row = bitmask[0].numpy()
                    return set(allowed_token_ids(np.ascontiguousarray(row), vocab_size))

                def timed_mask(self) -> None:
                    m.fill_next_token_bitmask(bitmask)

                def consume(self, token: int) -> None:
                    assert m.accept_token(token)

                def done(self) -> bool:
                    return bool(m.is_terminated())

            return M()

        return make

    return setup_s, compile_


def run(steps: int, seed: int) -> list[Result]:
    tokenizer = Tokenizer.from_gguf_metadata(read_metadata(default_model_path()))
    vocab_size = tokenizer.vocab_size
    libs: dict[str, Callable[..., Any]] = {"llguidance": llguidance_lib}
    try:
        import xgrammar  # noqa: F401

        libs["xgrammar"] = xgrammar_lib
    except ImportError:
        print("xgrammar is not installed: its column is left out")
    results = {name: Result(name) for name in libs}
    makers: dict[str, dict[int, Callable[[], Any]]] = {name: {} for name in libs}
    for name, lib in libs.items():
        setup_s, compile_ = lib(tokenizer, vocab_size)
        results[name].setup_s = setup_s
        for i, constraint in enumerate(_constraints()):
            t0 = time.perf_counter()
            try:
                makers[name][i] = compile_(constraint)
            except Exception as exc:  # a constraint this library cannot compile
                results[name].failures.append(f"{constraint.kind} #{i}: {exc}"[:120])
                continue
            results[name].compile_s.append(time.perf_counter() - t0)
            if constraint.kind == "json_schema":
                results[name].compiled += 1
    # The walks: the same tokens for every library (chosen among those all of them allow).
    rng = random.Random(seed)
    for i, _ in enumerate(_constraints()):
        if not all(i in makers[name] for name in libs):
            continue
        matchers = {name: makers[name][i]() for name in libs}
        for _ in range(steps):
            if any(m.done() for m in matchers.values()):
                break
            for name, m in matchers.items():
                t0 = time.perf_counter()
                m.timed_mask()
                results[name].mask_s.append(time.perf_counter() - t0)
            allowed = set.intersection(*(m.mask() for m in matchers.values()))
            if not allowed:
                break
            token = rng.choice(sorted(allowed))
            for m in matchers.values():
                m.consume(token)
    return list(results.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = run(args.steps, args.seed)
    print(
        f"| library | tokenizer set-up (s) | schemas compiled (of {len(SCHEMAS)}) | "
        "compile p50 / max (ms) | mask per token mean / p50 / p99 (us) | tokens timed |"
    )
    print("|---|---|---|---|---|---|")
    for r in results:
        comp = sorted(r.compile_s)
        mask = sorted(r.mask_s)
        p99 = mask[min(len(mask) - 1, int(0.99 * len(mask)))] if mask else 0.0
        print(
            f"| {r.name} | {r.setup_s:.2f} | {r.compiled} | "
            f"{statistics.median(comp) * 1e3:.2f} / {comp[-1] * 1e3:.1f} | "
            f"{statistics.fmean(mask) * 1e6:.0f} / {statistics.median(mask) * 1e6:.0f} / "
            f"{p99 * 1e6:.0f} | {len(mask)} |"
        )
        for failure in r.failures:
            print(f"  {r.name} failed: {failure}")


if __name__ == "__main__":
    main()
