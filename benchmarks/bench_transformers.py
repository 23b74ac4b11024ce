"""Hugging Face transformers baselines on the same fp32 weights kvserve serves.

The model is transformers' ``LlamaForCausalLM`` built from ``model_runner.loader.load_model``'s
config and (dequantized, Hugging Face-named) state dict, so both sides run identical weights.
Two ways to serve with it, each timed per generated token with a streamer:

- **one at a time**: ``generate`` on one prompt after the other (what a naive server does);
- **static batches**: ``generate`` on B prompts at once, the next batch only after the whole
  batch finished (what a server without continuous batching does).

Generation is greedy with exactly ``max_new_tokens`` tokens (``min_new_tokens`` equal to it,
the ``ignore_eos`` of the kvserve side). Token times come from a ``BaseStreamer`` whose ``put``
is called once per decoding step; inter-token latency is the gap between consecutive steps
(every sequence of a static batch gets its token at the same step).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loadtest.stats import percentile


@dataclass(frozen=True, slots=True)
class HFRun:
    """One measured configuration: totals and per-token timings."""

    mode: str  # "one-at-a-time" or "static-batch"
    batch_size: int
    num_requests: int
    output_tokens: int
    wall_s: float
    itl_s: list[float]
    ttft_s: list[float]  # per request, from the start of its batch (queueing excluded)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "batch_size": self.batch_size,
            "num_requests": self.num_requests,
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "itl_p50_s": percentile(self.itl_s, 50),
            "itl_p99_s": percentile(self.itl_s, 99),
            "ttft_p50_s": percentile(self.ttft_s, 50),
            "ttft_p99_s": percentile(self.ttft_s, 99),
        }


class _StepClock:
    """A streamer that records the time of every decoding step (the prompt put is skipped)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _generate(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, pad_id: int
) -> tuple[float, list[float], int]:
    """One generate call over ``prompts`` (left-padded); (start time, step times, new tokens)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        attention[i, width - len(p) :] = 1
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device),
            attention_mask=attention.to(model.device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            streamer=clock,
            pad_token_id=pad_id,
        )
    new_tokens = int(out.shape[1] - width)
    if new_tokens != max_new_tokens:
        raise RuntimeError(f"transformers generated {new_tokens} tokens, expected {max_new_tokens}")
    return start, clock.times, new_tokens * len(prompts)


def run_batches(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    batch_size: int,
    max_new_tokens: int,
    pad_id: int,
) -> HFRun:
    """Serve ``prompts`` in consecutive static batches of ``batch_size`` (1 = one at a time)."""
    itl: list[float] = []
    ttft: list[float] = []
    total_tokens = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        start, times, tokens = _generate(model, batch, max_new_tokens, pad_id)
        total_tokens += tokens
        ttft.extend([times[0] - start] * len(batch))
        gaps = [b - a for a, b in itertools.pairwise(times)]
        for _ in batch:
            itl.extend(gaps)
    wall = time.perf_counter() - t0
    return HFRun(
        mode="one-at-a-time" if batch_size == 1 else "static-batch",
        batch_size=batch_size,
        num_requests=len(prompts),
        output_tokens=total_tokens,
        wall_s=wall,
        itl_s=itl,
        ttft_s=ttft,
    )


def warm_up(model: Any, prompt: Sequence[int], pad_id: int) -> None:
    _generate(model, [prompt], 4, pad_id)
