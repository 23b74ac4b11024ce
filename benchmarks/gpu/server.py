"""The GPU ``server`` section's measurement: the path users take, ``kvserve serve`` over HTTP.

The closed loop (``gpu.step.serve_closed_loop``) runs the scheduler and the runner in one
process with no server around them. Here the same model (the GPU sections' random weights,
written as a Hugging Face directory with a word-level tokenizer of the model's vocabulary,
``write_checkpoint``) is served by a ``kvserve serve`` subprocess on loopback and driven by
the load tester (``loadtest``) through the OpenAI HTTP API (streaming ``/v1/completions``)
with the closed loop's traffic: at each user count, ``users x requests_per_user`` requests
of ``prompt_len`` random token ids and ``output_len`` greedy tokens with ``ignore_eos``,
each user sending its next request when its last one finished. The server gets the closed
loop's scheduler limits (step token budget, block size, KV memory; prefix caching off: the
closed loop has none), so the ratio of the two is what the server's own layers cost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.generator import LoadConfig, LoadGenerator
from loadtest.launch import ServerProcess
from loadtest.report import build_report
from loadtest.workload import Workload


def write_tokenizer(dest: Path, vocab_size: int) -> None:
    """``dest/tokenizer.json``: a word-level tokenizer whose token ``i`` is ``<ti>``, so every
    id the model can sample has text (prompts are sent as token ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"<t{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))


def write_checkpoint(hf: Any, dest: Path) -> Path:
    """``hf`` (a transformers causal LM) saved as a model directory ``kvserve serve --model``
    loads: ``config.json``, safetensors, ``tokenizer.json``."""
    dest.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(dest)  # safetensors (transformers 5 writes nothing else)
    write_tokenizer(dest, int(hf.config.vocab_size))
    return dest


@dataclass(frozen=True, slots=True)
class ServerLoad:
    """The traffic and the server's limits, the closed loop's (``harness.sizes.Sizes``)."""

    users: tuple[int, ...]
    requests_per_user: int
    prompt_len: int
    output_len: int
    vocab_size: int
    max_num_batched_tokens: int
    block_size: int
    kv_memory_bytes: int


def chat_workload(load: ServerLoad, num_requests: int) -> Workload:
    """Random-token prompts of ``prompt_len`` (ids clear of both ends of the vocabulary),
    ``output_len`` greedy tokens each, ``ignore_eos``."""
    v = load.vocab_size
    return Workload.from_dict(
        {
            "name": f"chat{load.prompt_len}-random",
            "seed": 1,
            "num_requests": num_requests,
            "prompt": {"source": "random", "len": load.prompt_len,
                       "token_id_range": [v // 8, 7 * v // 8]},
            "output": {"len": load.output_len, "ignore_eos": True},
            "sampling": {"temperature": 0.0},
        }
    )  # fmt: skip


def serve_args(
    model_dir: Path, load: ServerLoad, device: str, dtype: str, backend: str
) -> list[str]:
    """``kvserve serve`` flags for ``model_dir`` with the closed loop's limits."""
    return [
        "--runner", "torch", "--model", str(model_dir), "--device", device, "--dtype", dtype,
        "--attention-backend", backend, "--max-num-seqs", str(max(load.users)),
        "--max-num-batched-tokens", str(load.max_num_batched_tokens),
        "--block-size", str(load.block_size), "--kv-memory", str(load.kv_memory_bytes),
        "--no-enable-prefix-caching", "--log-level", "warning",
    ]  # fmt: skip


def _run(url: str, workload: Workload, users: int, num_requests: int) -> dict[str, Any]:
    config = LoadConfig(
        target=url, mode="closed", users=users, num_requests=num_requests, duration_s=1800,
        progress=False, api="openai",
    )  # fmt: skip
    return build_report(asyncio.run(LoadGenerator(config, workload).run()), workload)


def serve_http(
    model_dir: Path,
    load: ServerLoad,
    *,
    device: str,
    dtype: str,
    backend: str,
    log_path: Path | None = None,
    startup_timeout_s: float = 600.0,
    emit: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One server, a warm-up (2 requests), then a closed-loop run per user count: output
    tokens per second over HTTP, failed requests, TTFT and TPOT medians. Each row is handed
    to ``emit`` as soon as it is measured."""
    rows: list[dict[str, Any]] = []
    args = serve_args(model_dir, load, device, dtype, backend)
    with ServerProcess(args, metrics=False, startup_timeout_s=startup_timeout_s,
                       log_path=log_path) as server:  # fmt: skip
        _run(server.http_url, chat_workload(load, 2), users=2, num_requests=2)
        for users in load.users:
            n = users * load.requests_per_user
            report = _run(server.http_url, chat_workload(load, n), users=users, num_requests=n)
            latency = report["latency_s"]
            row = {
                "users": users,
                "requests": n,
                "ok": report["requests"]["ok"],
                "failed": report["requests"]["failed"],
                "output_tokens": report["output_tokens_total"],
                "tok_s": report["output_token_throughput_tps"],
                "ttft_p50_s": latency["ttft"]["p50"],
                "tpot_p50_s": latency["tpot"]["p50"],
            }
            rows.append(row)
            if emit is not None:
                emit(row)
    return rows
