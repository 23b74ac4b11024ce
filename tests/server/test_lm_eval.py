"""lm-evaluation-harness's ``local-completions`` model against an in-process server with the
embedded SmolLM2: the shipped multiple-choice task (tests/data/eval, loglikelihood through
echo + logprobs) completes and reports an accuracy, and its per-choice loglikelihoods are
the sums of the prompt logprobs the server returns for the same tokens; the shipped
generate_until task completes and reports its exact match, each of its requests reached the
server, and its answers are the server's own greedy answers."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "eval"
NUM_QUESTIONS = 8
NUM_GEN_QUESTIONS = 6


def _export_tokenizer(tokenizer: Any, where: Path) -> Path:
    """The served tokenizer as a Hugging Face tokenizer directory (lm-eval tokenizes the
    context and the continuation itself to find where the continuation starts)."""
    where.mkdir()
    tokenizer.backend.save(str(where / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (where / "tokenizer_config.json").write_text(json.dumps(config))
    return where


def _evaluate(model_args: dict[str, Any], task: str) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="local-completions",
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS)),
        log_samples=True,
    )
    assert results is not None
    return results


@asynccontextmanager
async def _serving(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Any, str, dict[str, Any]]]:
    """The embedded model served on 127.0.0.1 (kvserve's defaults, 2 threads): the built
    engine, the completions URL and lm-eval's model_args for it."""
    from server.build import build_engine
    from server.config import build_config
    from server.lifecycle import KVServeServer

    monkeypatch.chdir(ROOT)  # the tasks' data_files are relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    built = await asyncio.to_thread(build_engine, build_config({"threads": 2}, environ={}))
    server = KVServeServer(built.engine, built.tokenizer, built.model)
    await server.start("127.0.0.1", 0, http_port=0)
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    model_args = {
        "model": server.model.name,
        "base_url": url,
        "tokenizer_backend": "huggingface",
        "tokenizer": str(_export_tokenizer(built.tokenizer, tmp_path / "tokenizer")),
        "num_concurrent": 1,
        "max_retries": 1,
    }
    try:
        yield built, url, model_args
    finally:
        await server.shutdown(grace_s=1)


async def test_local_completions_runs_the_shipped_multiple_choice_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 questions x 4 choices: the harness reports acc in [0, 1] over all 8, and each
    choice's loglikelihood equals the sum of its continuation's logprobs from the server's
    echo + logprobs + max_tokens 0 answer for the same tokens (within float rounding)."""
    async with _serving(tmp_path, monkeypatch) as (built, url, model_args):
        results = await asyncio.to_thread(_evaluate, model_args, "kvserve_mc")
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


def _finished(built: Any) -> int:
    """Requests the server's scheduler has finished, any reason."""
    return sum(built.engine.latest_stats.num_finished_total.values())


async def test_local_completions_runs_the_shipped_generate_until_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """6 free-form questions (until "\\n", at most 8 tokens): the harness reports an
    exact_match over all 6, the server finished exactly 6 requests for it, each answer is the
    server's own greedy answer to the same prompt (until "\\n"), and the metric is the share
    of those answers whose first word is the target."""
    async with _serving(tmp_path, monkeypatch) as (built, url, model_args):
        before = _finished(built)
        results = await asyncio.to_thread(_evaluate, model_args, "kvserve_gen")
        for _ in range(100):  # the stats snapshot follows the step that ended the last one
            if _finished(built) - before >= NUM_GEN_QUESTIONS:
                break
            await asyncio.sleep(0.1)
        during = _finished(built) - before
        samples = results["samples"]["kvserve_gen"]
        ours = []
        async with httpx.AsyncClient(timeout=60) as http:
            for sample in samples:
                context, gen_kwargs = sample["arguments"][0]
                assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == 8
                body = {"prompt": context, "max_tokens": 8, "temperature": 0, "stop": ["\n"]}
                answer = await http.post(url, json=body)
                assert answer.status_code == 200, answer.text
                ours.append(answer.json()["choices"][0]["text"])
    metric = results["results"]["kvserve_gen"]["exact_match,first_word"]
    assert 0.0 <= metric <= 1.0
    assert len(samples) == NUM_GEN_QUESTIONS
    assert during == NUM_GEN_QUESTIONS
    assert [s["resps"][0][0] for s in samples] == ours
    first_words = [re.search(r"\w+", text) for text in ours]
    hits = [
        w is not None and w.group(0).lower() == s["target"].lower()
        for w, s in zip(first_words, samples, strict=True)
    ]
    assert metric == pytest.approx(sum(hits) / len(hits))
