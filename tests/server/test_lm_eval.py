"""lm-evaluation-harness's ``local-completions`` model against an in-process server with the
embedded SmolLM2: the shipped multiple-choice task (tests/data/eval, loglikelihood through
echo + logprobs) completes and reports an accuracy, and its per-choice loglikelihoods are
the sums of the prompt logprobs the server returns for the same tokens."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "eval"
NUM_QUESTIONS = 8


def _export_tokenizer(tokenizer: Any, where: Path) -> Path:
    """The served tokenizer as a Hugging Face tokenizer directory (lm-eval tokenizes the
    context and the continuation itself to find where the continuation starts)."""
    where.mkdir()
    tokenizer.backend.save(str(where / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


def _evaluate(model_args: dict[str, Any]) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=["kvserve_mc"],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
    )
    assert results is not None
    return results


async def test_local_completions_runs_the_shipped_multiple_choice_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 questions x 4 choices: the harness reports acc in [0, 1] over all 8, and each
    choice's loglikelihood equals the sum of its continuation's logprobs from the server's
    echo + logprobs + max_tokens 0 answer for the same tokens (within float rounding)."""
    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    built = await asyncio.to_thread(build_engine, build_config({"threads": 2}, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    await server.start("127.0.0.1", 0, http_port=0)
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    try:
        model_args = {
            "model": server.model.name,
            "base_url": url,
            "tokenizer_backend": "huggingface",
            "tokenizer": str(_export_tokenizer(built.tokenizer, tmp_path / "tokenizer")),
            "num_concurrent": 1,
            "max_retries": 1,
        }
        results = await asyncio.to_thread(_evaluate, model_args)
        samples = results["samples"]["kvserve_mc"]
        doc = samples[0]
        context, continuation = doc["arguments"][0]
        tok = built.tokenizer
        ctx_ids = tok.encode(context, add_special_tokens=False)
        whole_ids = tok.encode(context + continuation, add_special_tokens=False)
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(
                url, json={"prompt": whole_ids, "echo": True, "logprobs": 1, "max_tokens": 0}
            )
    finally:
        await server.shutdown(grace_s=1)
    acc = results["results"]["kvserve_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert len(samples) == NUM_QUESTIONS
    assert all(len(s["resps"]) == 4 for s in samples)
    logprobs = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(logprobs) == len(whole_ids) and logprobs[0] is None
    want = sum(logprobs[len(ctx_ids) :])
    got = doc["resps"][0][0][0]
    assert math.isfinite(got) and got < 0
    assert abs(got - want) < 1e-4, (got, want)
