"""LoRA adapters through the cluster (slow): replicas of the embedded model each load the
same adapter (``--lora``); the openai SDK naming the adapter as its model gets a single
server's greedy tokens, and the model list shows the adapter with its parent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from benchmarks.tools.make_random_lora import gguf_config, write_peft
from tests.cluster.helpers import LocalCluster, start_local_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPTS = ("What is the capital of France?", "Name a color.", "Say hello to Bob.")


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    yield from start_local_cluster()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random rank-8 PEFT adapter of the embedded model."""
    folder = tmp_path_factory.mktemp("lora") / "sql"
    return write_peft(folder, gguf_config(None), rank=8, seed=3, b_std=0.02)


async def answers(url: str, model: str) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    out = []
    for prompt in PROMPTS:
        done = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16,
            temperature=0,
        )  # fmt: skip
        out.append(done.choices[0].message.content or "")
    return out


async def single_server(engine: dict[str, Any]) -> tuple[list[str], list[str], str]:
    """The adapter's and the base model's answers from one server with the same settings."""
    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    built = build_engine(build_config(engine, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model, adapters=built.adapters)
    await server.start("127.0.0.1", 0, http_port=0)
    try:
        url = f"http://127.0.0.1:{server.http_port}"
        return await answers(url, "sql"), await answers(url, built.model.name), built.model.name
    finally:
        await server.shutdown(grace_s=1.0)


async def test_sdk_with_an_adapter_as_model_answers_as_one_server(
    cluster: LocalCluster, adapter: Path
) -> None:
    """Two replicas load the adapter; through the cluster's OpenAI API the SDK's greedy
    answers with model = the adapter equal a single server's, and differ from the base
    model's; /v1/models lists the adapter with the base model as its parent."""
    engine = {"lora": [f"sql={adapter}"], "threads": 1, "max_model_len": 512}
    want, base, base_name = await single_server(engine)
    cluster.deploy_openai("lora", engine=engine, num_replicas=2)
    client = openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused")
    listed = {m.id: getattr(m, "parent", None) for m in (await client.models.list()).data}
    assert listed == {base_name: None, "sql": base_name}
    got = await answers(cluster.http_url, "sql")
    assert got == want
    assert want != base
