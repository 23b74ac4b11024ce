"""Prompt logprobs through Scheduler + KVCacheManager + TorchRunner equal transformers'
log-softmax of the same prompt (fp32 weights and KV), chunked or not, with the prompt's
prefix cached by another request or not."""

from __future__ import annotations

import torch

from cache_manager import KVCacheConfig, KVCacheManager
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.output import RequestOutput, SchedulerOutput
from tests.model_runner.oracle import ATOL, hf_logits, make_runner, random_ids, tiny_hf

BLOCK_SIZE = 4
TOP_N = 3
SHARED = random_ids(12, seed=200)  # three full blocks
PROMPT = SHARED + random_ids(9, seed=201)  # 21 tokens: three 8-token chunks


def _engine(hf: torch.nn.Module, budget: int) -> tuple[Scheduler, KVCacheManager, object]:
    runner = make_runner(hf, num_blocks=32, block_size=BLOCK_SIZE)
    kv = KVCacheManager(
        KVCacheConfig(num_blocks=32, block_size=BLOCK_SIZE, block_bytes=runner.pool.block_bytes)
    )
    config = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=64,
        long_prefill_token_threshold=budget,
    )
    return Scheduler(config, kv), kv, runner


def _run(
    scheduler: Scheduler, kv: KVCacheManager, runner: object, requests: list[Request]
) -> tuple[dict[str, list[RequestOutput]], list[SchedulerOutput]]:
    """Run ``requests`` one after the other to the end; their outputs and every plan."""
    outputs: dict[str, list[RequestOutput]] = {}
    plans: list[SchedulerOutput] = []
    for request in requests:
        scheduler.add_request(request)
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            plans.append(plan)
            result = runner.execute(plan)  # type: ignore[attr-defined]
            assert not result.failed, result.failed
            for seq in (*plan.prefill, *plan.decode):
                assert (seq.request_id in result.prompt_logprobs) == bool(seq.num_prompt_logprobs)
            for out in scheduler.update(plan, result):
                outputs.setdefault(out.request_id, []).append(out)
            kv.check_invariants()
    return outputs, plans


def _assert_matches_transformers(hf: torch.nn.Module, outs: list[RequestOutput]) -> None:
    """The first output carries each prompt token's logprob (but the first's), its rank and
    the top n at its position, as transformers' log-softmax gives them; later outputs carry
    none."""
    assert outs[0].prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs[1:])
    ref = hf_logits(hf, PROMPT).log_softmax(dim=-1).cpu()
    scored = outs[0].prompt_logprobs
    assert [s.token_id for s in scored] == PROMPT[1:]
    ours = torch.tensor([s.logprob for s in scored])
    want = ref[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert (ours - want).abs().max().item() <= ATOL
    ranks = (ref[:-1] > want.unsqueeze(1)).sum(dim=1) + 1
    assert [s.rank for s in scored] == ranks.tolist()
    top = ref[:-1].topk(TOP_N, dim=-1)
    assert [[t for t, _ in s.top] for s in scored] == top.indices.tolist()
    top_ours = torch.tensor([[lp for _, lp in s.top] for s in scored])
    assert (top_ours - top.values).abs().max().item() <= ATOL


def _scoring(request_id: str, max_tokens: int = 2) -> Request:
    sampling = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=TOP_N
    )
    return Request(request_id, list(PROMPT), sampling=sampling)


def test_prompt_logprobs_in_one_chunk_equal_transformers() -> None:
    """A prompt prefilled in one chunk: its logprobs and top 3 equal transformers'."""
    hf = tiny_hf("llama", seed=3)
    scheduler, kv, runner = _engine(hf, budget=64)
    outputs, plans = _run(scheduler, kv, runner, [_scoring("r0")])
    assert plans[0].prefill[0].num_prompt_logprobs == len(PROMPT) - 1
    _assert_matches_transformers(hf, outputs["r0"])


def test_chunked_prompt_logprobs_after_a_cached_prefix_equal_transformers() -> None:
    """A prompt longer than the step's budget (three chunks, each scoring its rows), after
    another request cached its first three blocks: it takes no prefix hit, and its logprobs
    equal transformers'; a later request without prompt logprobs hits the blocks it keyed."""
    hf = tiny_hf("llama", seed=3)
    scheduler, kv, runner = _engine(hf, budget=8)
    plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = Request("warm", SHARED + random_ids(3, seed=202), sampling=plain)
    later = Request("later", list(PROMPT), sampling=plain)
    outputs, plans = _run(scheduler, kv, runner, [first, _scoring("r0"), later])
    chunks = [s for p in plans for s in p.prefill if s.request_id == "r0"]
    assert [(s.start_pos, s.num_tokens, s.num_prompt_logprobs) for s in chunks] == [
        (0, 8, 8),
        (8, 8, 8),
        (16, 5, 4),
    ]
    assert outputs["r0"][0].num_cached_tokens == 0
    assert outputs["later"][0].num_cached_tokens == 20  # 5 full blocks, not the last token
    _assert_matches_transformers(hf, outputs["r0"])


def test_prompt_logprobs_with_one_token_out_come_on_the_final_output() -> None:
    """max_tokens 1 (how an echo with max_tokens 0 scores a prompt): the one, final output
    carries the scores."""
    hf = tiny_hf("llama", seed=3)
    scheduler, kv, runner = _engine(hf, budget=8)
    outputs, _ = _run(scheduler, kv, runner, [_scoring("r0", max_tokens=1)])
    assert len(outputs["r0"]) == 1 and outputs["r0"][0].finished
    _assert_matches_transformers(hf, outputs["r0"])
