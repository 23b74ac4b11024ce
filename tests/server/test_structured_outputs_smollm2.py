"""Acceptance of structured outputs on the embedded model (SmolLM2-135M as `kvserve serve`
loads it), sampled at temperature 1.0 through the OpenAI front: 20 JSON schemas x 10 samples
all end, parse and validate with jsonschema on every kernel family this CPU has (each with
its own seed: the sampled path differs by family), the issue-46 number schema over 50 seeds,
regex and choice outputs all match, and the openai SDK's ``parse`` fills a Pydantic model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

import openai
import pydantic
import pytest
import pytest_asyncio

from loadtest.json_sweep import embedded_client, number_seeds, sweep
from loadtest.schemas import CHOICES, REGEXES, SCHEMAS
from model_runner import kernels

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
NUM_SAMPLES = 10


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    async with embedded_client(threads=2) as sdk:
        yield sdk


def kernel_families() -> list[str]:
    """This CPU's families, and the emulated avx512 one where the CPU lacks AVX-512 (its
    Q8_0 sums, so its sampled path, differ from avx2's); emulated avx2 equals avx2."""
    families = kernels.supported_isas()
    if families and "avx512" not in families:
        families.append("emu_vnni16")
    return families or ["none"]


async def samples(client: openai.AsyncOpenAI, prompt: str, **fields: Any) -> list[Any]:
    done = await client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], n=NUM_SAMPLES,
        temperature=1.0, max_tokens=256, **fields,
    )  # fmt: skip
    return list(done.choices)


# The plain-C++ families (portable, a tenth of the SIMD families' speed, and the emulated
# one) sample the schemas with numbers only, twice each: 20 x 10 there would take most of
# a CI run.
NUMBER_SCHEMAS = [(what, schema) for what, schema in SCHEMAS if '"number"' in json.dumps(schema)]


@pytest.mark.parametrize("family", kernel_families())
async def test_twenty_schemas_ten_samples_all_validate(
    client: openai.AsyncOpenAI, family: str
) -> None:
    """On kernel family ``family``: every one of 200 sampled answers (8 on the plain-C++
    families) ends with stop, parses, and validates (numbers bounded: none runs on to
    max_tokens)."""
    seed = 1000 * kernel_families().index(family)  # sample i draws with seed + i
    slow = family == "portable" or family in kernels.EMULATED
    schemas, num_samples = (NUMBER_SCHEMAS, 2) if slow else (SCHEMAS, NUM_SAMPLES)
    before = kernels.isa() if family != "none" else None
    if before is not None:
        kernels.use_isa(family)
    try:
        tallies = await sweep(client, schemas, seeds=[seed], samples=num_samples)
    finally:
        if before is not None:
            kernels.use_isa(before)
    for what, tally in tallies.items():
        assert tally.num_answers == num_samples
        assert not tally.bad, (family, what, tally.bad)


async def test_number_schema_fifty_seeds_all_end(client: openai.AsyncOpenAI) -> None:
    """Issue 46's case: a bounded number asked for in a few words, 50 seeds at temperature
    1.0: every answer ends with stop, parses and validates."""
    tally = await number_seeds(client, 50)
    assert tally.num_answers == 50 and not tally.bad, tally.bad


async def test_regex_and_choice_outputs_all_match(client: openai.AsyncOpenAI) -> None:
    """Regex (structured_outputs.regex) and choice (guided_choice) answers: 100 % match."""
    regex_answers = await asyncio.gather(*(
        samples(client, f"Write {what}.", extra_body={"structured_outputs": {"regex": regex}})
        for what, regex in REGEXES
    ))  # fmt: skip
    choice_answers = await asyncio.gather(*(
        samples(client, question, extra_body={"guided_choice": options})
        for question, options in CHOICES
    ))  # fmt: skip
    for (_, regex), choices in zip(REGEXES, regex_answers, strict=True):
        for choice in choices:
            assert choice.finish_reason == "stop"
            assert re.fullmatch(regex, choice.message.content), (regex, choice.message.content)
    for (_, options), choices in zip(CHOICES, choice_answers, strict=True):
        for choice in choices:
            assert choice.finish_reason == "stop" and choice.message.content in options


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float = pydantic.Field(ge=0, le=50)
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


async def test_openai_sdk_parse_fills_a_pydantic_model(client: openai.AsyncOpenAI) -> None:
    """``client.beta.chat.completions.parse(response_format=City)``: a parsed City."""
    done = await client.beta.chat.completions.parse(
        model="", messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City, temperature=1.0, max_tokens=256,
    )  # fmt: skip
    city = done.choices[0].message.parsed
    assert isinstance(city, City)
    assert City.model_validate_json(done.choices[0].message.content or "") == city
