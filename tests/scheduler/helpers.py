"""Small builders for exact scheduler tests: a scheduler over a tiny cache, requests, steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.fake import FakeRunner, make_fake_info
from scheduler import (
    ModelOutput,
    Request,
    RequestOutput,
    SamplingParams,
    ScheduledSeq,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)

EOS = 2


def make_scheduler(
    num_blocks: int = 8,
    block_size: int = 4,
    *,
    enable_prefix_caching: bool = False,
    sliding_window: int | None = None,
    attention_sinks: int = 0,
    kv_strategy: str = "always",
    kv_strategy_threshold: int = 512,
    cost_model: Any = None,
    **config: Any,
) -> tuple[Scheduler, KVCacheManager]:
    """A scheduler over a fresh cache. Small defaults: 4 seqs, 8 tokens per step, no chunk cap."""
    config.setdefault("max_num_seqs", 4)
    config.setdefault("max_num_batched_tokens", 8)
    config.setdefault("max_model_len", 256)
    config.setdefault("long_prefill_token_threshold", 0)
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=sliding_window,
            attention_sinks=attention_sinks,
            kv_strategy=kv_strategy,
            kv_strategy_threshold=kv_strategy_threshold,
        )
    )
    return Scheduler(SchedulerConfig(**config), kv, cost_model), kv


def make_runner(
    kv: KVCacheManager, script: dict[str, list[int]] | None = None, **kwargs: Any
) -> FakeRunner:
    """A FakeRunner that also checks every plan against a shadow paged KV of token ids."""
    return FakeRunner(
        make_fake_info(eos_token_ids=(EOS,)),
        script=script,
        verify_kv_block_size=kv.block_size,
        verify_kv_null_block_id=kv.null_block_id,
        **kwargs,
    )


def make_request(
    request_id: str,
    prompt_len: int = 10,
    max_tokens: int = 4,
    *,
    prompt: list[int] | None = None,
    first_token: int = 100,
    priority: int = 0,
    **sampling: Any,
) -> Request:
    """Prompt ``first_token, first_token + 1, ...`` unless ``prompt`` is given; EOS is 2."""
    tokens = prompt if prompt is not None else list(range(first_token, first_token + prompt_len))
    return Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_ids=(EOS,),
        priority=priority,
    )


@dataclass
class Step:
    plan: SchedulerOutput
    result: ModelOutput
    outputs: list[RequestOutput]

    def out(self, request_id: str) -> RequestOutput:
        (found,) = [o for o in self.outputs if o.request_id == request_id]
        return found


def step(scheduler: Scheduler, runner: FakeRunner, now_s: float | None = None) -> Step:
    """One engine step, then the cache manager's invariants."""
    plan = scheduler.schedule(now_s)
    result = runner.execute(plan)
    outputs = scheduler.update(plan, result)
    scheduler.kv.check_invariants()
    return Step(plan, result, outputs)


def run_until_done(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[Step]:
    steps = []
    while scheduler.has_unfinished_requests():
        assert len(steps) < max_steps, "did not finish"
        steps.append(step(scheduler, runner))
    return steps


def seq_view(seq: ScheduledSeq) -> tuple[str, int, int, list[int], bool]:
    """(request id, start_pos, num tokens, block ids, do_sample)."""
    return (seq.request_id, seq.start_pos, seq.num_tokens, seq.block_ids, seq.do_sample)


def prefill_view(plan: SchedulerOutput) -> list[tuple[str, int, int, list[int], bool]]:
    return [seq_view(s) for s in plan.prefill]


def decode_view(plan: SchedulerOutput) -> list[tuple[str, int, list[int]]]:
    return [(s.request_id, s.start_pos, s.block_ids) for s in plan.decode]


def assert_no_blocks_held(kv: KVCacheManager) -> None:
    """Every block is back on the free list and no request holds a table."""
    kv.check_invariants()
    stats = kv.make_stats()
    assert stats.num_blocks_used == 0
    assert stats.total_sequences == 0
    assert kv.num_free_blocks == kv.num_usable_blocks
