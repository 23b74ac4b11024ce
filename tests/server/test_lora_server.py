"""LoRA adapters through both fronts, on a tiny random-weight model against transformers +
PEFT: requests by adapter name, the model list, runtime load and unload with the admin key,
llama.cpp's lora list, the prefix cache keyed by adapter, and every refusal (the server
serving on after each)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from server.auth import Security
from server.client import KVServeClient
from server.fake_tokenizer import ByteTokenizer
from tests.model_runner.lora_oracle import peft_adapter
from tests.model_runner.oracle import hf_logits, make_runner, random_ids, tiny_hf
from tests.server.helpers import collect, serve
from tests.server.test_torch_model import MAX_TOKENS

pytestmark = pytest.mark.slow

ADMIN, USER = "admin-key", "user-key"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The base model and three PEFT adapters of it (saved to disk), by name."""
    folder = tmp_path_factory.mktemp("adapters")
    hf = tiny_hf("llama-gqa", seed=3)
    out: dict[str, Any] = {"base": hf}
    for name, r, seed in (("sql", 4, 1), ("chat", 8, 2), ("small", 2, 3)):
        out[name] = peft_adapter(hf, folder / name, r=r, seed=seed)
        out[name].path = folder / name  # type: ignore[attr-defined]
    return out


def hf_greedy(model: Any, prompt: list[int], num_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy tokens of a transformers (+ PEFT) model, whatever its EOS: one full forward
    per token (the models are tiny)."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt) :]


def runner_with(models: dict[str, Any], *names: str, **kwargs: Any) -> Any:
    runner = make_runner(models["base"], num_blocks=96, block_size=4, **kwargs)
    for name in names:
        runner.lora.load(name, models[name].path)
    return runner


def tokens(msgs: list[Any]) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


async def test_grpc_requests_by_adapter_equal_transformers_peft(models: dict[str, Any]) -> None:
    """Concurrent streams of three adapters and the base model (so mixed in steps, chunked
    prefill) each give their own transformers + PEFT greedy tokens; GetModelInfo lists the
    adapters; an unknown adapter is NOT_FOUND naming the loaded ones."""
    runner = runner_with(models, "sql", "chat", "small")
    prompts = {name: random_ids(7 + 3 * i, seed=60 + i) for i, name in enumerate(models)}
    want = {name: hf_greedy(models[name], prompts[name]) for name in models}
    async with serve(runner, ByteTokenizer(), max_num_seqs=8, max_num_batched_tokens=16) as h:
        info = await h.client.model_info()
        assert sorted(a.name for a in info.adapters) == ["chat", "small", "sql"]
        assert {a.name: a.rank for a in info.adapters} == {"sql": 4, "chat": 8, "small": 2}

        async def run(name: str) -> list[int]:
            adapter = None if name == "base" else name
            stream = h.client.generate(
                prompts[name], adapter=adapter, max_tokens=MAX_TOKENS, ignore_eos=True
            )
            return tokens(await collect(stream))

        got = dict(zip(models, await asyncio.gather(*(run(n) for n in models)), strict=True))
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(h.client.generate([5, 6], adapter="nope", max_tokens=2))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert "'nope' does not exist" in error.value.details()
        assert "'sql', 'chat', 'small'" in error.value.details()
        assert tokens(await collect(h.client.generate([5, 6], max_tokens=2))) != []
    assert got == want


async def test_openai_model_names_the_adapter(models: dict[str, Any]) -> None:
    """Over HTTP: /v1/models lists each adapter with its parent; model = an adapter gives
    PEFT's tokens; llama.cpp's lora list picks an adapter by id (and all-zero scales mean
    the base model); an unknown model is a 404 naming the base model and the adapters."""
    runner = runner_with(models, "sql", "chat")
    prompt = random_ids(9, seed=70)
    async with (
        serve(runner, ByteTokenizer(), http=True) as h,
        httpx.AsyncClient(base_url=h.http_url, timeout=120) as http,
    ):
        listed = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [
            ("tiny", None),
            ("sql", "tiny"),
            ("chat", "tiny"),
        ]

        async def complete(**extra: Any) -> Any:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                    "ignore_eos": True, **extra}  # fmt: skip
            return await http.post("/v1/completions", json=body)

        def ids(response: Any) -> list[int]:
            assert response.status_code == 200, response.text
            return [int(t) for t in response.json()["choices"][0]["text"].encode("latin-1")]

        by_model = await complete(model="chat")
        by_lora = await complete(lora=[{"id": 0, "scale": 0}, {"id": 1, "scale": 1.0}])
        base = await complete(lora=[{"id": 0, "scale": 0}])
        unknown = await complete(model="gpt-4")
        two = await complete(lora=[{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}])
    assert ids(by_model) == ids(by_lora) != ids(base)
    assert unknown.status_code == 404
    assert "serves 'tiny' and the adapters 'sql', 'chat'" in unknown.json()["error"]["message"]
    assert two.status_code == 400 and "one adapter per request" in two.text


@pytest.fixture
def admin_security() -> Security:
    return Security(api_keys=frozenset({ADMIN, USER}), admin_keys=frozenset({ADMIN}))


async def test_runtime_load_and_unload_need_the_admin_key(
    models: dict[str, Any], admin_security: Security, tmp_path: Path
) -> None:
    """Loading needs an admin key (none: 401, a user key: 403); a corrupt file, an adapter
    of another model and a rank over the limit are 400s naming the reason, a taken name a
    409; the loaded adapter then serves PEFT's tokens; unloading makes it a 404 while the
    server serves on. Every refusal leaves the server serving, and a base-model stream in
    flight through all of them (its client not reading until the end) gets all its tokens."""
    runner = runner_with(models, max_lora_rank=4)
    prompt = random_ids(6, seed=71)
    other = tiny_hf("llama-gqa", hidden_size=32, intermediate_size=64)
    peft_adapter(other, tmp_path / "other")
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    admin = {"Authorization": f"Bearer {ADMIN}"}
    long_prompt = random_ids(7, seed=74)
    async with serve(runner, ByteTokenizer(), http=True, security=admin_security) as h, \
            httpx.AsyncClient(base_url=h.http_url, timeout=120) as http, \
            KVServeClient(h.address, api_key=ADMIN) as client:  # fmt: skip

        async def load(name: str, path: Path, headers: dict[str, str] | None = None) -> Any:
            body = {"lora_name": name, "lora_path": str(path)}
            return await http.post("/v1/load_lora_adapter", json=body, headers=headers)

        in_flight = client.generate(long_prompt, max_tokens=60, ignore_eos=True)
        first = await anext(in_flight)
        no_key = await load("sql", models["sql"].path)
        user = await load("sql", models["sql"].path, {"Authorization": f"Bearer {USER}"})
        corrupt = await load("c", tmp_path / "corrupt", admin)
        wrong = await load("o", tmp_path / "other", admin)
        big = await load("chat", models["chat"].path, admin)  # rank 8 > 4
        ok = await load("sql", models["sql"].path, admin)
        again = await load("sql", models["sql"].path, admin)
        body = {"prompt": prompt, "model": "sql", "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        served = await http.post("/v1/completions", json=body, headers=admin)
        gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=admin)
        after = await http.post("/v1/completions", json=body, headers=admin)
        base = await http.post("/v1/completions", json={**body, "model": "tiny"}, headers=admin)
        rest = await collect(in_flight)
    assert tokens([first, *rest]) == hf_greedy(models["base"], long_prompt, 60)
    assert (no_key.status_code, user.status_code) == (401, 403)
    assert corrupt.status_code == 400 and "corrupt or truncated" in corrupt.text
    assert wrong.status_code == 400 and "another model" in wrong.text
    assert big.status_code == 400 and "over --max-lora-rank 4" in big.text
    assert ok.status_code == 200 and ok.json()["parent"] == "tiny"
    assert again.status_code == 409
    text = served.json()["choices"][0]["text"]
    assert [int(t) for t in text.encode("latin-1")] == hf_greedy(models["sql"], prompt)
    assert gone.status_code == 200
    assert after.status_code == 404 and "'sql' does not exist" in after.text
    assert base.status_code == 200


async def test_load_is_refused_without_admin_keys(models: dict[str, Any]) -> None:
    """A server started without --admin-api-key refuses runtime loading (403) instead of
    letting anyone load files from its disk."""
    runner = runner_with(models)
    async with (
        serve(runner, ByteTokenizer(), http=True) as h,
        httpx.AsyncClient(base_url=h.http_url, timeout=60) as http,
    ):
        body = {"lora_name": "sql", "lora_path": str(models["sql"].path)}
        response = await http.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 403 and "--admin-api-key" in response.text


async def test_unload_lets_requests_in_flight_finish(
    models: dict[str, Any], admin_security: Security
) -> None:
    """Unloading an adapter while a request streams with it (100 tokens, its client not
    reading yet, so it is surely in flight): that request keeps its pin and finishes with
    the adapter's tokens; a new request for it is NOT_FOUND; the adapter's weights go once
    the request ended."""
    runner = runner_with(models, "chat")
    prompt = random_ids(8, seed=72)
    want = hf_greedy(models["chat"], prompt, 100)
    async with serve(runner, ByteTokenizer(), http=True, security=admin_security) as h, \
            KVServeClient(h.address, api_key=ADMIN) as client:  # fmt: skip
        stream = client.generate(prompt, adapter="chat", max_tokens=100, ignore_eos=True)
        first = await anext(stream)
        async with httpx.AsyncClient(base_url=h.http_url, timeout=60) as http:
            gone = await http.post(
                "/v1/unload_lora_adapter", json={"lora_name": "chat"},
                headers={"Authorization": f"Bearer {ADMIN}"},
            )  # fmt: skip
        assert gone.status_code == 200
        assert runner.lora.pins("chat") == 1  # in flight, and still holding the weights
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await collect(client.generate(prompt, adapter="chat", max_tokens=2))
        rest = await collect(stream)
    assert tokens([first, *rest]) == want
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    assert runner.lora.infos() == [] and runner.lora.pins("chat") == 0


async def test_an_adapters_prefix_is_never_served_to_another(models: dict[str, Any]) -> None:
    """The same prompt under adapter sql, then the base model, then adapter chat, then sql
    again: only the second sql request hits the prefix cache (the cache key holds the
    adapter: without it the base and chat requests would hit sql's blocks and read KV
    made by another model), and every answer is its own model's."""
    runner = runner_with(models, "sql", "chat")
    prompt = random_ids(21, seed=73)
    async with serve(runner, ByteTokenizer()) as h:
        cached = {}
        answers = {}
        for i, name in enumerate(("sql", "base", "chat", "sql")):
            adapter = None if name == "base" else name
            msgs = await collect(
                h.client.generate(prompt, adapter=adapter, max_tokens=MAX_TOKENS, ignore_eos=True)
            )
            cached[i] = msgs[-1].usage.cached_prompt_tokens
            answers[i] = tokens(msgs)
    assert cached == {0: 0, 1: 0, 2: 0, 3: 20}
    for i, name in enumerate(("sql", "base", "chat", "sql")):
        assert answers[i] == hf_greedy(models[name], prompt), name


async def test_adapters_reach_their_steps_one_step_ahead(models: dict[str, Any]) -> None:
    """The engine one step ahead (overlap on, a CPU step thread, the next plan built while a
    step runs, decodes on placeholder tokens): three adapters and the base model in the same
    steps, on a pool small enough to preempt, each get their own transformers + PEFT greedy
    tokens, so each request's adapter reaches every step it runs in; the pins are released."""
    from scheduler import Request, SamplingParams
    from server.engine_client import EngineClient
    from tests.server.test_engine_overlap import engine_for, spy_on_submit

    runner = runner_with(models, "sql", "chat", "small")
    runner.use_step_thread(True)
    planned = spy_on_submit(runner)
    prompts = {name: random_ids(5 + 4 * i, seed=90 + i) for i, name in enumerate(models)}
    want = {name: hf_greedy(models[name], prompts[name]) for name in models}
    sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run(client: EngineClient, name: str) -> list[int]:
        lora = None if name == "base" else runner.lora.resolve(name)
        request = Request(name, prompts[name], sampling=sampling, lora=lora)
        return [t async for out in client.generate(request) for t in out.token_ids]

    try:
        async with engine_for(
            runner, overlap=True, num_blocks=14, max_model_len=64, max_num_batched_tokens=16
        ) as (_, engine, scheduler):
            assert engine.overlap is True
            client = EngineClient(engine, runner.lora)
            got = await asyncio.gather(*(run(client, name) for name in models))
            stats = scheduler.make_stats()
    finally:
        runner.use_step_thread(False)
    assert dict(zip(models, got, strict=True)) == want
    assert stats.num_preemptions_total > 0 and stats.kv.num_blocks_used == 0
    ahead = {s.lora.name for p in planned for s in p.decode if s.has_placeholder and s.lora}
    assert ahead == {"sql", "chat", "small"}
    assert all(runner.lora.pins(name) == 0 for name in ("sql", "chat", "small"))
