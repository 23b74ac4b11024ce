"""Perplexity of a long text under attention sinks + a sliding window, against the window
alone (StreamingLLM's experiment), on the embedded SmolLM2-135M.

    python -m benchmarks.bench_sinks                      # 4,096 tokens, cache of 256 tokens
    python -m benchmarks.bench_sinks --tokens 2048 --cache 128 --sinks 4

The text is ``benchmarks/data/gpl-3.0.txt`` (the GNU GPL v3, English prose, committed: no
download), or ``--text PATH``. Each configuration runs the text as one request through the
real Scheduler, KVCacheManager and TorchRunner (as ``kvserve serve`` would: the GGUF's
weights, fp16 KV), prefilled in chunks of ``--chunk`` tokens; the logits of every position
score the next token. Blocks that fall out of the window are released as it goes, so the
cache holds at most the sinks, the window and a chunk.

- ``sinks + window``: ``--sinks`` S tokens kept, window ``cache - S`` (``--attention-sinks
  S --sliding-window cache-S``).
- ``window alone``: window ``cache`` (``--sliding-window cache``): the same number of visible
  keys, no sinks.
- ``full attention``: no window, for reference (the text fits the model's context).

Perplexity is exp(mean negative log-likelihood), over all scored tokens and over those past
the first ``cache`` positions (where the window has started to evict).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.table import markdown_table

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "gpl-3.0.txt"
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Result:
    name: str
    sliding_window: int | None
    attention_sinks: int
    num_scored: int
    perplexity: float
    perplexity_past_cache: float  # tokens at positions >= the cache size
    peak_kv_slots: int  # most token slots the request held in KV blocks at once
    seconds: float


def run_config(
    loaded: Any,
    token_ids: list[int],
    name: str,
    window: int | None,
    sinks: int,
    chunk: int,
    cache: int,
) -> Result:
    import torch

    from cache_manager import KVCacheConfig, KVCacheManager
    from model_runner.config import RunnerOptions
    from model_runner.runner import TorchRunner
    from scheduler import ModelOutput, Request, SamplingParams, Scheduler, SchedulerConfig

    num_blocks = -(-len(token_ids) // BLOCK_SIZE) + 4
    options = RunnerOptions(
        num_blocks, BLOCK_SIZE, dtype=torch.float32, sliding_window=window, attention_sinks=sinks
    )
    runner = TorchRunner(loaded.config, loaded.state_dict, options)
    kv = KVCacheManager(
        KVCacheConfig(
            num_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=False,
            sliding_window=window,
            attention_sinks=sinks,
        )
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=1,
            max_num_batched_tokens=chunk,
            long_prefill_token_threshold=chunk,
            max_model_len=runner.max_model_len,
        ),
        kv,
    )
    request = Request("text", token_ids, sampling=SamplingParams(temperature=0.0, max_tokens=1))
    scheduler.add_request(request)
    nll: list[float] = []  # nll[p]: of token p + 1 given tokens 0..p
    peak = 0
    t0 = time.perf_counter()
    targets = torch.tensor([*token_ids[1:], 0])
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        logits = runner.step_logits(plan)
        sampled = {}
        for seq in plan.prefill:
            rows = logits[seq.request_id].float()
            logp = torch.log_softmax(rows, dim=-1)
            tgt = targets[seq.start_pos : seq.end_pos]
            nll.extend((-logp.gather(1, tgt.unsqueeze(1)).squeeze(1)).tolist())
            peak = max(peak, sum(b != kv.null_block_id for b in seq.block_ids) * BLOCK_SIZE)
            if seq.do_sample:
                sampled[seq.request_id] = int(rows[-1].argmax())
        scheduler.update(plan, ModelOutput(sampled_token_ids=sampled))
    seconds = time.perf_counter() - t0
    scored = nll[: len(token_ids) - 1]  # the last position has no next token
    past = scored[cache:]
    return Result(
        name=name,
        sliding_window=window,
        attention_sinks=sinks,
        num_scored=len(scored),
        perplexity=math.exp(sum(scored) / len(scored)),
        perplexity_past_cache=math.exp(sum(past) / len(past)) if past else float("nan"),
        peak_kv_slots=peak,
        seconds=seconds,
    )


def run(
    text_path: Path, num_tokens: int, cache: int, sinks: int, chunk: int, threads: int
) -> list[Result]:
    import torch

    from model_runner.loader import load_model

    torch.set_num_threads(threads)
    loaded = load_model(None, weights="native")
    token_ids = loaded.tokenizer.encode(text_path.read_text())[:num_tokens]
    if len(token_ids) < num_tokens:
        raise ValueError(f"{text_path} holds {len(token_ids)} tokens, fewer than {num_tokens}")
    return [
        run_config(loaded, token_ids, f"sinks {sinks} + window {cache - sinks}",
                   cache - sinks, sinks, chunk, cache),
        run_config(loaded, token_ids, f"window {cache} alone", cache, 0, chunk, cache),
        run_config(loaded, token_ids, "full attention", None, 0, chunk, cache),
    ]  # fmt: skip


def format_table(results: list[Result], cache: int) -> str:
    header = ["Cache", "Perplexity, all tokens", f"Perplexity past the first {cache}",
              "Peak KV slots held"]  # fmt: skip
    rows = [
        [r.name, f"{r.perplexity:.2f}", f"{r.perplexity_past_cache:.2f}", f"{r.peak_kv_slots:,}"]
        for r in results
    ]
    return markdown_table(header, rows, pad=False)


def as_dicts(results: list[Result]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the text scored (4096)")
    p.add_argument("--cache", type=int, default=256, help="visible keys per query (256)")
    p.add_argument("--sinks", type=int, default=4, help="attention sinks (4)")
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (64)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    results = run(args.text, args.tokens, args.cache, args.sinks, args.chunk, args.threads)
    print(format_table(results, args.cache))
    for r in results:
        print(f"{r.name}: {r.num_scored} tokens scored in {r.seconds:.1f} s")


if __name__ == "__main__":
    main()
