"""Sampled JSON answers that must end: the constrained workloads (``loadtest.schemas``) at
temperature 1.0 over several seeds, through the openai SDK, each answer checked to end with
``stop``, parse and validate. With ``--probes``, schemas whose grammar alone never forces an
end (unbounded arrays, ``additionalProperties`` maps, unbounded strings) are sampled too and
reported (they are not failures: a schema that allows any length lets a model take it).

    python -m loadtest.json_sweep                       # the embedded model, in process
    python -m loadtest.json_sweep --url http://127.0.0.1:8000/v1 --seeds 3 --samples 10

Exits 1 when an answer of the 20 schemas or of the ``number`` schema does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import openai

from loadtest.schemas import SCHEMAS, schema_prompt

# The issue-46 case: a bounded number, asked for in the fewest words.
NUMBER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"temp_c": {"type": "number", "minimum": -50, "maximum": 60}},
    "required": ["temp_c"],
}
NUMBER_PROMPT = "Answer in JSON about: number"

# Constructs where only the model decides when to stop (reported, never failed).
PROBES: list[tuple[str, dict[str, Any]]] = [
    ("a list of numbers", {"type": "array", "items": {"type": "number"}}),
    ("scores by name", {"type": "object", "additionalProperties": {"type": "number"}}),
    ("a free object", {"type": "object"}),
    ("a long description", {"type": "object", "properties": {"text": {"type": "string"}},
                            "required": ["text"]}),
]  # fmt: skip


@dataclass(slots=True)
class Tally:
    """Answers of one schema: how many, and the ones that did not hold (why, text)."""

    num_answers: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)

    def check(self, schema: dict[str, Any], finish_reason: str | None, content: str) -> None:
        self.num_answers += 1
        if finish_reason != "stop":
            self.bad.append((f"finish_reason={finish_reason}", content))
            return
        try:
            jsonschema.validate(json.loads(content), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            self.bad.append((type(exc).__name__, content))


async def sample(
    client: openai.AsyncOpenAI,
    prompt: str,
    schema: dict[str, Any],
    *,
    n: int,
    seed: int,
    max_tokens: int = 256,
) -> list[tuple[str | None, str]]:
    """``n`` answers to ``prompt`` under ``schema`` at temperature 1.0 with ``seed``."""
    done = await client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], n=n, seed=seed,
        temperature=1.0, max_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    return [(c.finish_reason, c.message.content or "") for c in done.choices]


async def sweep(
    client: openai.AsyncOpenAI,
    schemas: Sequence[tuple[str, dict[str, Any]]],
    *,
    seeds: Sequence[int],
    samples: int,
    max_tokens: int = 256,
) -> dict[str, Tally]:
    """Every schema x seed (``samples`` answers each), sent at once; a tally per schema."""
    jobs = [(what, schema, seed) for what, schema in schemas for seed in seeds]
    answers = await asyncio.gather(*(
        sample(client, schema_prompt(what, schema), schema, n=samples, seed=seed,
               max_tokens=max_tokens)
        for what, schema, seed in jobs
    ))  # fmt: skip
    tallies = {what: Tally() for what, _ in schemas}
    for (what, schema, _), choices in zip(jobs, answers, strict=True):
        for finish_reason, content in choices:
            tallies[what].check(schema, finish_reason, content)
    return tallies


async def number_seeds(client: openai.AsyncOpenAI, num_seeds: int) -> Tally:
    """The ``number`` schema with its short prompt, one answer per seed 0..num_seeds-1."""
    answers = await asyncio.gather(
        *(sample(client, NUMBER_PROMPT, NUMBER_SCHEMA, n=1, seed=s) for s in range(num_seeds))
    )
    tally = Tally()
    for choices in answers:
        for finish_reason, content in choices:
            tally.check(NUMBER_SCHEMA, finish_reason, content)
    return tally


@asynccontextmanager
async def embedded_client(threads: int = 2) -> AsyncIterator[openai.AsyncOpenAI]:
    """The embedded model served in process on 127.0.0.1 (port 0), and a client of it."""
    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    built = await asyncio.to_thread(build_engine, build_config({"threads": threads}, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    await server.start("127.0.0.1", 0, http_port=0)
    url = f"http://127.0.0.1:{server.http_port}/v1"
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=1800)
    try:
        yield client
    finally:
        await client.close()
        await server.shutdown(grace_s=1)


def report(title: str, tallies: dict[str, Tally]) -> int:
    """Print one line per schema (and each bad answer); the number of bad answers."""
    print(title)
    total = 0
    for what, tally in tallies.items():
        total += len(tally.bad)
        print(f"  {what:32s} {tally.num_answers - len(tally.bad):4d}/{tally.num_answers} held")
        for why, content in tally.bad:
            print(f"    {why}: {content[:160]!r}")
    return total


async def main_async(args: argparse.Namespace) -> int:
    # Sample i of a seeded request draws with seed + i: seeds 1000 apart share no sample.
    seeds = [1000 * k for k in range(args.seeds)]
    async with (
        embedded_client(args.threads)
        if args.url is None
        else openai.AsyncOpenAI(base_url=args.url, api_key=args.api_key, max_retries=0)
    ) as client:
        bad = report(
            f"{len(SCHEMAS)} schemas x {args.seeds} seeds x {args.samples} samples",
            await sweep(client, SCHEMAS, seeds=seeds, samples=args.samples),
        )
        bad += report(
            f"the number schema, {args.number_seeds} seeds",
            {"number": await number_seeds(client, args.number_seeds)},
        )
        if args.probes:
            report(
                f"probes (reported, not failed), {args.seeds} seeds x {args.samples} samples",
                await sweep(client, PROBES, seeds=seeds, samples=args.samples),
            )
    print("all held" if bad == 0 else f"{bad} answers did not hold")
    return 0 if bad == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an OpenAI base URL (default: the embedded model here)")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--number-seeds", type=int, default=50)
    parser.add_argument("--probes", action="store_true", help="sample the open-ended schemas")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
