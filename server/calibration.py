"""The step-cost model's start: a few seconds of scripted steps on the real runner.

The ``slo`` policy sizes every step with ``scheduler.cost_model.StepCostModel``, which the
engine refits online. Its prior comes from here (``--cost-model-prior calibrate``, the
default) or from a simulated device's roofline (``model_runner.sim.roofline_cost_model``).

Calibration runs before the server accepts requests, on a throwaway scheduler and cache
manager over the runner's own KV pool (the served cache manager has nothing in it yet):
prefill chunks after short and long prefixes, decode batches of 1 to 16 over short and long
contexts. Each step's shape and ``runner.execute`` time is one sample; the first step (a
cold start) is dropped, and the least-squares fit is the prior.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.base import Runner
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.cost_model import StepCostModel, StepShape

logger = logging.getLogger(__name__)

Round = tuple[int, int, int, int]  # requests, prompt tokens, prefill chunk, output tokens

# (requests, prompt tokens, prefill chunk, output tokens): each round runs to its end.
ROUNDS: tuple[Round, ...] = (
    (1, 512, 128, 4),  # chunks after 0, 128, 256, 384 tokens: attention grows
    (1, 64, 64, 6),  # short prefill, batch-1 decodes
    (4, 96, 384, 6),  # one 384-token prefill step, batch-4 decodes
    (16, 24, 384, 6),  # many short prompts, batch-16 decodes
    (8, 200, 128, 4),  # mixed steps: chunks beside decodes
)


# Drafts per decode in the speculative rounds (``run_rounds(..., speculative=True)``).
SPEC_DRAFTS = 3


def calibrate(
    runner: Runner,
    cache: KVCacheConfig,
    max_model_len: int,
    *,
    seed: int = 0,
    make_kv: Callable[[KVCacheConfig], KVCacheManager] = KVCacheManager,
) -> StepCostModel:
    """Fit a step-cost model to scripted steps on ``runner`` (see the module docstring)."""
    started = time.perf_counter()
    rounds = run_rounds(runner, cache, max_model_len, ROUNDS, seed=seed, make_kv=make_kv)
    samples = rounds[1:]  # the first is cold
    model = StepCostModel.fit(samples)
    logger.info(
        "step-cost model calibrated on %d steps in %.1f s: %s",
        len(samples),
        time.perf_counter() - started,
        ", ".join(f"{c:.3g}" for c in model.coefficients_s),
    )
    return model


def run_rounds(
    runner: Runner,
    cache: KVCacheConfig,
    max_model_len: int,
    rounds: Sequence[Round],
    *,
    seed: int = 0,
    speculative: bool = False,
    make_kv: Callable[[KVCacheConfig], KVCacheManager] = KVCacheManager,
) -> list[tuple[StepShape, float]]:
    """Run each round (random prompts, greedy, to its end) on a throwaway scheduler and
    cache manager over ``runner``'s pool; every non-empty step's (shape, execute seconds).
    ``speculative``: n-gram drafts on, and each prompt a random 8-token phrase repeated, so
    the drafter finds matches and decodes carry verification rows. ``make_kv``: the cache
    manager the server runs (the sliding layers' own tables, ``cache_manager.hybrid``)."""
    rng = random.Random(seed)
    vocab = runner.info.vocab_size
    drafts = SPEC_DRAFTS if speculative else 0
    samples: list[tuple[StepShape, float]] = []
    for round_id, (num_reqs, prompt_len, chunk, num_out) in enumerate(rounds):
        prompt_len = min(prompt_len, max_model_len - num_out)
        kv = make_kv(replace(cache, enable_prefix_caching=False))
        sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=num_reqs,
                max_num_batched_tokens=max(chunk, num_reqs * (1 + drafts)),
                max_model_len=max_model_len,
                long_prefill_token_threshold=chunk,
                speculative="ngram" if speculative else "off",
                num_speculative_tokens=max(drafts, 1),
            ),
            kv,
        )
        for i in range(num_reqs):
            ids = [rng.randrange(1, vocab) for _ in range(8 if speculative else prompt_len)]
            if speculative:  # the 8-token phrase, repeated
                ids = [ids[j % 8] for j in range(prompt_len)]
            sched.add_request(
                Request(
                    request_id=f"kvserve-calibration-{round_id}-{i}",
                    prompt_token_ids=ids,
                    sampling=SamplingParams(max_tokens=num_out, ignore_eos=True, temperature=0),
                )
            )
        while sched.has_unfinished_requests():
            plan = sched.schedule()
            t0 = time.perf_counter()
            result = runner.execute(plan)
            elapsed = time.perf_counter() - t0
            sched.update(plan, result)
            if not plan.is_empty:
                samples.append((StepShape.of_plan(plan), elapsed))
    return samples
