"""Streaming from a tiny random-weight real model (TorchRunner) equals transformers' greedy."""

from __future__ import annotations

import asyncio

import pytest

from server.fake_tokenizer import ByteTokenizer
from server.rpc import generation_pb2 as pb
from tests.model_runner.oracle import make_runner, random_ids, tiny_hf
from tests.server.helpers import collect, serve

MAX_TOKENS = 10


def hf_greedy(hf: object, prompt: list[int]) -> list[int]:
    """transformers generate(): greedy, exactly MAX_TOKENS new tokens (no EOS stop)."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0,
        bos_token_id=None,
    )  # fmt: skip
    with torch.no_grad():
        ids = torch.tensor([prompt], device=hf.device)  # type: ignore[attr-defined]
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)  # type: ignore[attr-defined]
    return list(out[0, len(prompt) :].tolist())


@pytest.mark.slow
async def test_streams_from_tiny_llama_equal_transformers_greedy() -> None:
    """6 concurrent greedy streams (16-token steps: chunked prefill; two share a prefix)
    give generate()'s tokens exactly."""
    hf = tiny_hf("llama-gqa", seed=3)
    runner = make_runner(hf, num_blocks=64, block_size=4)
    shared = random_ids(9, seed=50)
    prompts = [
        random_ids(5, seed=51),
        shared + random_ids(4, seed=52),
        random_ids(17, seed=53),
        shared + random_ids(2, seed=54),
        random_ids(1, seed=55),
        random_ids(30, seed=56),
    ]
    want = [hf_greedy(hf, p) for p in prompts]
    async with serve(runner, ByteTokenizer(), max_num_seqs=8, max_num_batched_tokens=16) as h:
        info = await h.client.model_info()
        results = await asyncio.gather(
            *(
                collect(h.client.generate(p, request_id=f"m{i}", max_tokens=MAX_TOKENS,
                                          temperature=0.0, ignore_eos=True))
                for i, p in enumerate(prompts)
            )
        )  # fmt: skip
        stats = await h.client.kv_cache_stats()
    assert (info.vocab_size, info.kv_block_size, info.kv_num_blocks) == (128, 4, 64)
    for i, msgs in enumerate(results):
        assert [t for m in msgs for t in m.token_ids] == want[i], f"prompt {i}"
        assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert stats.num_blocks_used == 0
