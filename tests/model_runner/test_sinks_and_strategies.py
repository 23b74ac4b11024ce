"""Attention sinks and KV cache strategies on a real (tiny, random-weight) model, driven by
the real Scheduler and KVCacheManager.

The sink and windowing oracles use a ONE-layer model: there a token's key and value depend
only on its own embedding and position, so attention over the keys a cache keeps equals a
fresh forward pass of transformers over just those tokens. StreamingLLM's positions within
the cache are then plain positions 0..L-1 of that shorter input.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cache_manager import KVCacheConfig, KVCacheManager
from scheduler import ModelOutput, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.request import FinishReason
from tests.model_runner.oracle import DEVICE, make_runner, random_ids, tiny_hf

CONTEXT = 256  # the tiny models' max_position_embeddings
BLOCK_SIZE = 4
ATOL = 2e-4


def _hf_last_logits(
    hf: torch.nn.Module, token_ids: list[int], positions: list[int]
) -> torch.Tensor:
    with torch.no_grad():
        ids = torch.tensor([token_ids], device=DEVICE)
        pos = torch.tensor([positions], device=DEVICE)
        return hf(ids, position_ids=pos).logits[0, -1].float()


def _run_greedy(
    scheduler: Scheduler,
    runner: object,
    check_step: Callable[[str, int, list[int], torch.Tensor], None] | None = None,
    max_steps: int = 2000,
) -> dict[str, list[int]]:
    """Greedy decoding by argmax of ``runner.step_logits``; ``check_step(rid, position,
    block_ids, logits)`` sees the logits of every sampling position."""
    outputs: dict[str, list[int]] = {}
    finish: dict[str, FinishReason | None] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        plan = scheduler.schedule()
        logits = runner.step_logits(plan)  # type: ignore[attr-defined]
        sampled = {}
        for seq in (*plan.prefill, *plan.decode):
            if seq.do_sample:
                row = logits[seq.request_id][-1]
                if check_step is not None:
                    check_step(seq.request_id, seq.end_pos - 1, seq.block_ids, row)
                sampled[seq.request_id] = int(row.argmax())
        for out in scheduler.update(plan, ModelOutput(sampled_token_ids=sampled)):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            finish[out.request_id] = out.finish_reason
        scheduler.kv.check_invariants()
    else:
        raise AssertionError("the run did not finish")
    assert all(r == FinishReason.LENGTH for r in finish.values()), finish
    return outputs


def _scheduler(kv: KVCacheManager, **config: int) -> Scheduler:
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 64)
    return Scheduler(
        SchedulerConfig(max_model_len=CONTEXT, long_prefill_token_threshold=0, **config), kv
    )


def test_sinks_generate_twice_the_context_within_sinks_plus_window() -> None:
    """Sinks 4 + window 60 on a 256-token context: an 8-token prompt generates 504 tokens
    (512 in all, twice the context). After every step the request holds at most
    S + W + one block of KV slots, and every sampled position's logits equal transformers'
    over the kept tokens (the sinks, then the window) at positions within the cache."""
    sinks, window = 4, 60
    hf = tiny_hf("llama-gqa", seed=11, num_hidden_layers=1)
    runner = make_runner(
        hf, num_blocks=40, block_size=BLOCK_SIZE, sliding_window=window, attention_sinks=sinks
    )
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=40,
            block_size=BLOCK_SIZE,
            sliding_window=window,
            attention_sinks=sinks,
            enable_prefix_caching=False,
        )
    )
    scheduler = _scheduler(kv)
    prompt = random_ids(8, seed=12)
    max_tokens = 2 * CONTEXT - len(prompt)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = Request("r0", prompt, sampling=sampling)
    scheduler.add_request(request)
    bound = sinks + window + BLOCK_SIZE
    null = kv.null_block_id
    peak = 0
    checked: list[int] = []

    def check(rid: str, pos: int, block_ids: list[int], logits: torch.Tensor) -> None:
        nonlocal peak
        held = sum(b != null for b in block_ids) * BLOCK_SIZE
        peak = max(peak, held)
        assert held <= bound, f"position {pos}: {held} KV slots held > S + W + block = {bound}"
        tokens = request.all_token_ids
        kept = list(range(sinks)) + list(range(max(sinks, pos - window + 1), pos + 1))
        ref = _hf_last_logits(hf, [tokens[p] for p in kept], list(range(len(kept))))
        err = (logits.to(ref.device) - ref).abs().max().item()
        assert err <= ATOL, f"position {pos}: max |ours - transformers| = {err:.2e}"
        checked.append(pos)

    outputs = _run_greedy(scheduler, runner, check)
    assert len(outputs["r0"]) == max_tokens and request.num_tokens == 2 * CONTEXT
    assert checked[-1] == 2 * CONTEXT - 2 and len(checked) == max_tokens
    assert peak == bound  # the window did fill up
    assert kv.make_stats().num_blocks_used == 0


def test_max_tokens_past_the_context_needs_sinks() -> None:
    """Without sinks, prompt + max_tokens past max_model_len stays a ValueError with the
    numbers (a window alone does not make it acceptable); with sinks it is accepted."""
    sampling = SamplingParams(max_tokens=CONTEXT)
    for window in (None, 60):
        kv = KVCacheManager(KVCacheConfig(num_blocks=40, block_size=4, sliding_window=window))
        with pytest.raises(ValueError, match=r"= 264 tokens exceeds max_model_len \(256\)"):
            _scheduler(kv).add_request(Request("r0", random_ids(8, 1), sampling=sampling))
    kv = KVCacheManager(
        KVCacheConfig(num_blocks=40, block_size=4, sliding_window=60, attention_sinks=4)
    )
    _scheduler(kv).add_request(Request("r0", random_ids(8, 1), sampling=sampling))


PROMPTS = [random_ids(n, seed=20 + n) for n in (5, 14, 23)]


@pytest.mark.parametrize(
    ("strategy", "threshold"),
    [("disabled", 512), ("long-sequence-only", 20), ("adaptive", 512)],
)
def test_strategies_give_the_tokens_of_always(strategy: str, threshold: int) -> None:
    """Three requests, 12 greedy tokens each: disabled (every token recomputed from position
    0), long-sequence-only (recomputed below 20 tokens) and adaptive (no memory pressure
    here) give exactly the tokens of always, on a 2-layer GQA model."""

    def run(kv_strategy: str) -> tuple[dict[str, list[int]], int]:
        hf = tiny_hf("llama-gqa", seed=5)
        runner = make_runner(hf, num_blocks=64, block_size=BLOCK_SIZE)
        kv = KVCacheManager(
            KVCacheConfig(
                num_blocks=64,
                block_size=BLOCK_SIZE,
                kv_strategy=kv_strategy,
                kv_strategy_threshold=threshold,
            )
        )
        scheduler = _scheduler(kv)
        sampling = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            scheduler.add_request(Request(f"r{i}", prompt, sampling=sampling))
        outputs: dict[str, list[int]] = {}
        while scheduler.has_unfinished_requests():
            plan = scheduler.schedule()
            result = runner.execute(plan)
            assert not result.failed, result.failed
            for out in scheduler.update(plan, result):
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            kv.check_invariants()
        return outputs, kv.make_stats().strategy_dropped_tokens_total

    reference, none_dropped = run("always")
    outputs, dropped = run(strategy)
    assert outputs == reference and all(len(t) == 12 for t in outputs.values())
    assert none_dropped == 0
    assert (dropped > 0) == (strategy != "adaptive")


def test_adaptive_windowing_attends_to_the_kept_tokens_only() -> None:
    """Adaptive under memory pressure (12 usable blocks, two requests of 8 + 24 tokens):
    the longest request loses its old blocks instead of being preempted, and every sampled
    position's logits equal transformers' over exactly the positions whose blocks it kept."""
    hf = tiny_hf("llama-gqa", seed=13, num_hidden_layers=1)
    runner = make_runner(hf, num_blocks=13, block_size=BLOCK_SIZE)
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=13,
            block_size=BLOCK_SIZE,
            kv_strategy="adaptive",
            kv_strategy_threshold=8,
            enable_prefix_caching=False,
        )
    )
    scheduler = _scheduler(kv, max_num_seqs=2)
    requests = [
        Request(
            f"r{i}",
            random_ids(8, seed=30 + i),
            sampling=SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        )
        for i in range(2)
    ]
    for request in requests:
        scheduler.add_request(request)
    null = kv.null_block_id
    num_skipping = 0

    def check(rid: str, pos: int, block_ids: list[int], logits: torch.Tensor) -> None:
        nonlocal num_skipping
        tokens = requests[int(rid[1:])].all_token_ids
        kept = [p for p in range(pos + 1) if block_ids[p // BLOCK_SIZE] != null]
        num_skipping += len(kept) < pos + 1
        ref = _hf_last_logits(hf, [tokens[p] for p in kept], kept)
        err = (logits.to(ref.device) - ref).abs().max().item()
        assert err <= ATOL, f"{rid} position {pos}: max |ours - transformers| = {err:.2e}"

    _run_greedy(scheduler, runner, check)
    stats = scheduler.make_stats()
    assert stats.num_preemptions_total == 0
    assert stats.kv.strategy_windowed_tokens_total > 0 and num_skipping > 0
