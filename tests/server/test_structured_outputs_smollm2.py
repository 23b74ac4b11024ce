"""Acceptance of structured outputs on the embedded model (SmolLM2-135M as `kvserve serve`
loads it), sampled at temperature 1.0 through the OpenAI front: 20 JSON schemas x 10 samples
all parse and validate with jsonschema, regex and choice outputs all match, and the openai
SDK's ``parse`` fills a Pydantic model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import pytest_asyncio

from loadtest.schemas import CHOICES, REGEXES, SCHEMAS, schema_prompt

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
NUM_SAMPLES = 10


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client() -> AsyncIterator[openai.AsyncOpenAI]:
    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    built = await asyncio.to_thread(build_engine, build_config({"threads": 2}, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    await server.start("127.0.0.1", 0, http_port=0)
    url = f"http://127.0.0.1:{server.http_port}/v1"
    sdk = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    try:
        yield sdk
    finally:
        await sdk.close()
        await server.shutdown(grace_s=1)


async def samples(client: openai.AsyncOpenAI, prompt: str, **fields: Any) -> list[Any]:
    done = await client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], n=NUM_SAMPLES,
        temperature=1.0, max_tokens=256, **fields,
    )  # fmt: skip
    return list(done.choices)


async def test_twenty_schemas_ten_samples_all_validate(client: openai.AsyncOpenAI) -> None:
    """Every one of 200 sampled answers ends with stop, parses, and validates."""
    answers = await asyncio.gather(*(
        samples(client, schema_prompt(what, schema), response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema},
        })
        for what, schema in SCHEMAS
    ))  # fmt: skip
    for (what, schema), choices in zip(SCHEMAS, answers, strict=True):
        assert len(choices) == NUM_SAMPLES
        for choice in choices:
            assert choice.finish_reason == "stop", (what, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


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
