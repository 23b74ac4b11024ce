"""Prompt logprobs through the fronts on a tiny random Llama (fp32 weights and KV) served
with the byte tokenizer: the openai SDK's echo + logprobs (max_tokens 0 scores the prompt
only), vLLM's prompt_logprobs, the gRPC field, all equal to transformers' log-softmax; and
the 400s of what cannot be served."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import grpc
import httpx
import openai
import pytest
import torch

from server.fake_tokenizer import ByteTokenizer
from tests.model_runner.oracle import ATOL, hf_logits, make_runner, random_ids, tiny_hf
from tests.server.helpers import collect, serve

TOK = ByteTokenizer()
SHARED = random_ids(12, seed=300)
PROMPT = SHARED + random_ids(9, seed=301)  # 21 tokens: chunked by the 8-token budget


def _reference(hf: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """transformers' log-softmax [len - 1, V] at each position but the last."""
    return hf_logits(hf, prompt).log_softmax(dim=-1)[:-1].cpu()


def _assert_scores(ref: torch.Tensor, prompt: Sequence[int], logprobs: Sequence[float]) -> None:
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    err = (torch.tensor(list(logprobs)) - want).abs().max().item()
    assert err <= ATOL, f"max |ours - transformers| = {err:.3e}"


def _sdk(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_sdk_echo_logprobs_max_tokens_0_scores_the_prompt_as_transformers() -> None:
    """completions.create(echo=True, logprobs=1, max_tokens=0), chunked by an 8-token step
    budget, before and after another request cached the prompt's prefix: the prompt's text
    alone, its tokens' logprobs (the first null) equal to transformers' and each position's
    top one, text_offset per token, finish_reason length, no completion tokens."""
    hf = tiny_hf("llama", seed=5)
    ref = _reference(hf, PROMPT)
    runner = make_runner(hf, num_blocks=64, block_size=4)
    async with serve(runner, TOK, http=True, max_num_seqs=4, max_num_batched_tokens=8) as h:
        client = _sdk(h.http_url)
        name = h.server.model.name
        cold = await client.completions.create(
            model=name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
        )
        await client.completions.create(  # caches SHARED's three blocks
            model=name, prompt=[*SHARED, 5, 6, 7], max_tokens=1
        )
        warm = await client.completions.create(
            model=name, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0
        )
        await client.close()
    for done in (cold, warm):
        choice = done.choices[0]
        assert choice.text == TOK.decode(PROMPT)
        assert choice.finish_reason == "length"
        assert done.usage is not None
        assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(PROMPT), 0)
        assert done.usage.prompt_tokens_details is not None
        assert done.usage.prompt_tokens_details.cached_tokens == 0  # scored: no prefix hit
        lps = choice.logprobs
        assert lps is not None and lps.token_logprobs is not None and lps.top_logprobs is not None
        assert lps.tokens == [TOK.id_to_token(t) for t in PROMPT]
        assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
        _assert_scores(ref, PROMPT, lps.token_logprobs[1:])  # type: ignore[arg-type]
        best = ref.argmax(dim=-1).tolist()
        for i, top in enumerate(lps.top_logprobs[1:]):
            # The position's top one, and the token itself (vLLM's shape).
            assert set(top) == {TOK.id_to_token(best[i]), TOK.id_to_token(PROMPT[i + 1])}
        assert lps.text_offset == list(range(len(PROMPT)))  # one character per byte token


async def test_echo_streams_the_prompt_first_and_prompt_logprobs_in_vllm_shape() -> None:
    """A streamed echo with logprobs and 2 generated tokens: the first chunk carries the
    prompt and its scores, then the generated text follows; vLLM's prompt_logprobs gives
    null, then per token {id: {logprob, rank, decoded_token}} equal to transformers'."""
    hf = tiny_hf("llama", seed=5)
    ref = _reference(hf, PROMPT)
    runner = make_runner(hf, num_blocks=64, block_size=4)
    async with serve(runner, TOK, http=True) as h:
        body: dict[str, Any] = {
            "prompt": PROMPT, "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True,
            "temperature": 0, "ignore_eos": True,
        }  # fmt: skip
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{h.http_url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [
                    json.loads(line.removeprefix("data: "))
                    async for line in r.aiter_lines()
                    if line.startswith("data: {")
                ]
            scored = (
                await http.post(
                    f"{h.http_url}/v1/completions",
                    json={"prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 1},
                )
            ).json()
    first = events[0]["choices"][0]
    assert first["text"].startswith(TOK.decode(PROMPT))
    assert first["logprobs"]["token_logprobs"][0] is None
    _assert_scores(ref, PROMPT, first["logprobs"]["token_logprobs"][1 : len(PROMPT)])
    streamed = [c for e in events for c in e["choices"]]
    assert sum(len(c["logprobs"]["tokens"]) for c in streamed) == len(PROMPT) + 2
    assert streamed[-1]["finish_reason"] == "length"
    choice = scored["choices"][0]
    assert not choice["text"].startswith(TOK.decode(PROMPT))  # no echo: only scores
    assert choice["logprobs"] is None
    prompt_lps = choice["prompt_logprobs"]
    assert len(prompt_lps) == len(PROMPT) and prompt_lps[0] is None
    scores = [e[str(t)]["logprob"] for e, t in zip(prompt_lps[1:], PROMPT[1:], strict=True)]
    _assert_scores(ref, PROMPT, scores)
    top2 = ref.topk(2, dim=-1).indices.tolist()
    for i, entry in enumerate(prompt_lps[1:]):
        assert [k for k, v in entry.items() if v["rank"] in (1, 2)] == [str(t) for t in top2[i]]
        rank = int((ref[i] > ref[i, PROMPT[i + 1]]).sum()) + 1
        assert entry[str(PROMPT[i + 1])]["rank"] == rank


async def test_grpc_prompt_logprobs_on_the_first_response() -> None:
    """gRPC sampling.prompt_logprobs: the first response carries every prompt token but the
    first, each equal to transformers' logprob with its top 3; later ones carry none; 21 is
    INVALID_ARGUMENT naming the field and its range."""
    hf = tiny_hf("llama", seed=5)
    ref = _reference(hf, PROMPT)
    runner = make_runner(hf, num_blocks=64, block_size=4)
    async with serve(runner, TOK, max_num_seqs=4, max_num_batched_tokens=8) as h:
        messages = await collect(
            h.client.generate(PROMPT, max_tokens=3, prompt_logprobs=3, ignore_eos=True)
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(h.client.generate(PROMPT, max_tokens=1, prompt_logprobs=21))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.prompt_logprobs must be in [0, 20], got 21" in str(refused.value.details())
    assert [len(m.prompt_logprobs) for m in messages] == [len(PROMPT) - 1] + [0] * (
        len(messages) - 1
    )
    scored = messages[0].prompt_logprobs
    assert [s.sampled.token_id for s in scored] == PROMPT[1:]
    _assert_scores(ref, PROMPT, [s.sampled.logprob for s in scored])
    assert [[t.token_id for t in s.top] for s in scored] == ref.topk(3, dim=-1).indices.tolist()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"echo": True, "logprobs": 21, "max_tokens": 0}, "logprobs must be in [0, 20], got 21"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be in [0, 20], got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be in [0, 20], got -1"),
        ({"echo": True, "logprobs": 1, "n": 2}, "echo with logprobs scores the prompt once"),
        ({"max_tokens": 0}, "max_tokens must be >= 1 (at most 127"),
        ({"echo": 1}, "echo must be true or false, got 1"),
    ],
)
async def test_bad_prompt_logprobs_requests_are_400s(body: dict[str, Any], message: str) -> None:
    """Scores over the limit, echo with logprobs and n > 1, max_tokens 0 without echo, a
    non-boolean echo: a 400 saying why, and the server keeps serving."""
    async with serve(http=True, max_n=4) as h, httpx.AsyncClient(timeout=30) as http:
        url = f"{h.http_url}/v1/completions"
        refused = await http.post(url, json={"prompt": "hi", **body})
        served = await http.post(url, json={"prompt": "hi", "echo": True, "max_tokens": 1})
    assert refused.status_code == 400, refused.text
    assert message in refused.json()["error"]["message"]
    assert served.status_code == 200 and served.json()["choices"][0]["text"].startswith("hi")
