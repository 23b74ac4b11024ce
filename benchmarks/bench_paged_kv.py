"""Paged KV against contiguous max-length preallocation, within the same KV memory.

Method: the real ``Scheduler`` and ``KVCacheManager`` step a batch of requests to completion
with a ``FakeRunner`` (tokens without a model: how many requests fit depends only on the
cache, not on compute). All requests arrive at once, so the running set is bounded by memory
alone (``max_num_seqs`` is far above it). The three layouts share one KV budget of
``budget_tokens`` token slots (``budget_tokens * kv_bytes_per_token`` bytes):

- **contiguous** (what a flat per-sequence cache does, e.g. a static max-length cache): each
  sequence gets one region of ``max_model_len`` slots at admission. Modelled exactly by the
  same cache manager with ``block_size = max_model_len`` (one block per sequence) and no
  prefix caching.
- **paged, reserve**: blocks of 16 tokens, a request admitted only when blocks for its whole
  length (prompt + max_tokens) are free (never preempts).
- **paged, optimistic**: blocks of 16 allocated as tokens arrive; preemption by recompute when
  they run out (kvserve's default).

Per step we read ``Scheduler.make_stats()``: concurrency is ``num_running``; ``cache_efficiency``
is the KV stats' token slots in use / token slots allocated. Reported: the peak and mean
concurrency, the mean cache_efficiency over steps, the steps to drain the batch (fewer steps =
larger decode batches) and preemptions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.fake import FakeRunner, make_fake_info
from scheduler.request import Request, SamplingParams

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class PagedResult:
    layout: str
    workload: str
    num_requests: int
    budget_tokens: int
    peak_concurrent: int
    mean_concurrent: float
    mean_cache_efficiency: float
    num_steps: int
    preemptions: int

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def make_lengths(
    workload: str, num_requests: int, max_model_len: int, seed: int = 0
) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per request, each fitting ``max_model_len``.

    chat128: 128 / 128. mixed: lognormal prompts (median ~150) and outputs (median ~80).
    """
    if workload == "chat128":
        return [(128, 128)] * num_requests
    if workload == "mixed":
        rng = random.Random(f"{seed}:paged-mixed")
        out = []
        for _ in range(num_requests):
            num_output = min(max_model_len // 4, max(4, round(rng.lognormvariate(4.4, 0.7))))
            num_prompt = max(8, round(rng.lognormvariate(5.0, 0.8)))
            out.append((min(num_prompt, max_model_len - num_output), num_output))
        return out
    raise ValueError(f"unknown paged-KV workload {workload!r}: chat128 | mixed")


def run_layout(
    layout: str,
    lengths: list[tuple[int, int]],
    *,
    workload: str,
    budget_tokens: int,
    max_model_len: int,
    max_steps: int = 100_000,
) -> PagedResult:
    from scheduler import Scheduler, SchedulerConfig

    if layout == "contiguous":
        kv = KVCacheConfig(
            num_blocks=budget_tokens // max_model_len,
            block_size=max_model_len,
            enable_prefix_caching=False,
        )
        memory_mode = "reserve"
    elif layout in ("paged-reserve", "paged-optimistic"):
        kv = KVCacheConfig(
            num_blocks=budget_tokens // BLOCK_SIZE,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=False,
        )
        memory_mode = "reserve" if layout == "paged-reserve" else "optimistic"
    else:
        raise ValueError(f"unknown layout {layout!r}")
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=1024,
            max_num_batched_tokens=4096,
            max_model_len=max_model_len,
            memory_mode=memory_mode,
        ),
        KVCacheManager(kv),
    )
    runner = FakeRunner(make_fake_info(vocab_size=32_000, max_model_len=max_model_len))
    rng = random.Random(f"paged:{workload}")
    for i, (num_prompt, num_output) in enumerate(lengths):
        sched.add_request(
            Request(
                request_id=f"r{i}",
                prompt_token_ids=[rng.randrange(100, 30_000) for _ in range(num_prompt)],
                sampling=SamplingParams(temperature=0.0, max_tokens=num_output, ignore_eos=True),
                eos_token_ids=(2,),
            )
        )
    concurrency: list[int] = []
    efficiency: list[float] = []
    steps = 0
    while sched.has_unfinished_requests():
        if steps >= max_steps:
            raise RuntimeError(f"{layout}: not drained after {max_steps} steps")
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
        steps += 1
        stats = sched.make_stats()
        concurrency.append(stats.num_running)
        if stats.kv.total_sequences:
            efficiency.append(stats.kv.cache_efficiency)
    final = sched.make_stats()
    return PagedResult(
        layout=layout,
        workload=workload,
        num_requests=len(lengths),
        budget_tokens=budget_tokens,
        peak_concurrent=max(concurrency),
        mean_concurrent=sum(concurrency) / len(concurrency),
        mean_cache_efficiency=sum(efficiency) / len(efficiency) if efficiency else 0.0,
        num_steps=steps,
        preemptions=final.num_preemptions_total,
    )


def run(
    *,
    num_requests: int = 64,
    budget_tokens: int = 16_384,
    max_model_len: int = 2048,
    workloads: tuple[str, ...] = ("chat128", "mixed"),
) -> list[PagedResult]:
    out = []
    for workload in workloads:
        lengths = make_lengths(workload, num_requests, max_model_len)
        for layout in ("contiguous", "paged-reserve", "paged-optimistic"):
            out.append(
                run_layout(
                    layout,
                    lengths,
                    workload=workload,
                    budget_tokens=budget_tokens,
                    max_model_len=max_model_len,
                )
            )
    return out


if __name__ == "__main__":
    for r in run():
        print(r)
