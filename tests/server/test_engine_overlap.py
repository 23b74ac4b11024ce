"""The engine one step ahead (issue 38): the next plan is built while the device runs the step
before it, and every client gets what the synchronous loop gives it, on the fake device and
on real models, with stop strings, max_tokens, aborts mid-stream, preemption, n > 1,
speculation and structured outputs in the mix."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from cache_manager import KVCacheConfig, KVCacheManager
from model_runner.config import RunnerOptions
from model_runner.constraints import ConstraintCompiler, ConstraintTracker
from model_runner.fake import FakeRunner
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.request import Constraint, FinishReason
from server.engine import EngineLoop
from server.engine_client import EngineClient
from server.fake_tokenizer import ByteTokenizer
from server.outputs import GenerationOutput
from server.text import make_text_stream_factory
from tests.server.helpers import RecordingSink, fake_info


@dataclass(frozen=True)
class Ask:
    """One client request of a workload: ``abort_after`` outputs, the client cancels."""

    rid: str
    prompt: Sequence[int]
    sampling: SamplingParams
    abort_after: int | None = None


@dataclass
class Got:
    """What one client got: tokens and text per sample, and how each sample ended."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    text: dict[int, str] = field(default_factory=dict)
    reasons: dict[int, FinishReason | None] = field(default_factory=dict)


@asynccontextmanager
async def engine_for(
    runner: Any,
    *,
    overlap: bool,
    num_blocks: int,
    block_size: int = 4,
    tokenizer: Any = None,
    **config: Any,
) -> AsyncIterator[tuple[EngineClient, EngineLoop, Scheduler]]:
    config.setdefault("max_model_len", runner.info.max_model_len)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_num_batched_tokens", 64)
    kv = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=True)
    )
    scheduler = Scheduler(SchedulerConfig(**config), kv)
    engine = EngineLoop(
        scheduler,
        runner,
        make_text_stream_factory(tokenizer or ByteTokenizer()),
        sink=RecordingSink(),
        overlap=overlap,
    )
    engine.start()
    try:
        yield EngineClient(engine), engine, scheduler
    finally:
        engine.stop()


async def _one(client: EngineClient, ask: Ask, eos: tuple[int, ...]) -> Got:
    got = Got()
    request = Request(ask.rid, list(ask.prompt), sampling=ask.sampling, eos_token_ids=eos)
    stream = client.generate(request)
    num_outputs = 0
    async for out in stream:
        assert isinstance(out, GenerationOutput)
        got.tokens.setdefault(out.index, []).extend(out.token_ids)
        got.text[out.index] = got.text.get(out.index, "") + out.text
        if out.finished:
            got.reasons[out.index] = out.finish_reason
        num_outputs += 1
        if ask.abort_after is not None and num_outputs >= ask.abort_after:
            await stream.aclose()  # what a cancelled call does
            break
    return got


async def run_workload(
    client: EngineClient, asks: Sequence[Ask], eos: tuple[int, ...]
) -> dict[str, Got]:
    results = await asyncio.gather(*(_one(client, ask, eos) for ask in asks))
    return {ask.rid: got for ask, got in zip(asks, results, strict=True)}


def assert_same(ahead: dict[str, Got], sync: dict[str, Got], asks: Sequence[Ask]) -> None:
    """Every client got the synchronous loop's tokens, text and ends; a client that cancelled
    got a prefix of the same tokens (how far it got depends on when its cancel landed)."""
    for ask in asks:
        a, s = ahead[ask.rid], sync[ask.rid]
        if ask.abort_after is None:
            assert (a.tokens, a.text, a.reasons) == (s.tokens, s.text, s.reasons), ask.rid
            continue
        assert len(a.tokens[0]) >= ask.abort_after - 1, ask.rid
        n = min(len(a.tokens[0]), len(s.tokens[0]))
        assert a.tokens[0][:n] == s.tokens[0][:n], ask.rid


def fake_asks(n: int = 1) -> list[Ask]:
    """Stop strings, max_tokens, an abort mid-stream, n > 1, a constrained request."""

    def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)

    return [
        Ask("stop", [65, 66, 67], greedy(20, stop=("END",))),
        Ask("max", [70] * 9, greedy(7)),
        Ask("abort", [71, 72], greedy(30), abort_after=4),
        Ask("fork", [73, 74, 75, 76, 77], greedy(6, n=3)),
        Ask("json", [78, 79], greedy(20, constraint=Constraint("regex", "[a-c]{5}x"))),
        Ask("spec", [80, 81, 82, 80, 81, 82, 80], greedy(12)),
        *[Ask(f"fill{i}", list(range(90, 100 + i)), greedy(10)) for i in range(n)],
    ]


def fake_device(*, hold: bool) -> FakeRunner:
    """The fake device: steps on a worker thread, 2 ms each, scripted stop string and
    repetitive tokens (so n-gram drafts get accepted), structured outputs on."""
    script = {"stop": list(b"abc END xyz"), "spec": [80, 81, 82] * 4}
    tracker = ConstraintTracker(ConstraintCompiler(ByteTokenizer()))
    return FakeRunner(
        fake_info(max_model_len=256),
        script=script,
        sleep_s=0.002,
        verify_kv_block_size=4,
        constraints=tracker,
        step_thread=True,
        hold_steps=hold,
    )


@pytest.mark.parametrize("speculative", ["off", "ngram"])
async def test_fake_device_gives_the_synchronous_loops_outputs(speculative: str) -> None:
    """On the fake device (its steps on a worker thread), overlap on and off: every client's
    tokens, text and finish reason are the same (an aborted one: a prefix), the KV pool was
    small enough to preempt, and the overlapped run really planned ahead."""
    asks = fake_asks(n=4)
    results = {}
    for overlap in (True, False):
        runner = fake_device(hold=overlap)
        async with engine_for(
            runner, overlap=overlap, num_blocks=12, speculative=speculative, ngram_min=1
        ) as (client, engine, scheduler):
            assert engine.overlap is overlap
            results[overlap] = await run_workload(client, asks, (257,))
            stats = scheduler.make_stats()
        runner.shutdown()
        assert stats.num_preemptions_total > 0
        assert stats.kv.num_blocks_used == 0
        if speculative == "ngram":
            assert stats.num_spec_accepted_tokens_total > 0
    assert_same(results[True], results[False], asks)
    assert results[False]["stop"].text[0] == "abc " and results[False]["fork"].tokens.keys() == {
        0,
        1,
        2,
    }


async def test_the_next_plan_is_built_while_the_step_runs() -> None:
    """Timestamps of the fake device: with overlap, every step's successor was submitted
    before the step finished (the host planned N+1 while N ran); without it, never. Its
    steps are held until the next is submitted or their result is asked for, so this holds
    on a machine of any speed."""
    asks = [Ask(f"r{i}", [65 + i] * (3 + i), SamplingParams(temperature=0.0, max_tokens=12))
            for i in range(4)]  # fmt: skip
    for overlap in (True, False):
        runner = fake_device(hold=True)
        async with engine_for(runner, overlap=overlap, num_blocks=64) as (client, *_):
            await run_workload(client, asks, (257,))
        runner.shutdown()
        spans = [s for s in runner.spans if s.finished_s is not None]
        pairs = list(itertools.pairwise(spans))
        assert len(pairs) >= 10
        overlapped = [nxt.submitted_s < cur.finished_s for cur, nxt in pairs]  # type: ignore[operator]
        if overlap:
            assert sum(overlapped) >= len(pairs) - 2, overlapped  # a drained queue ends a run
        else:
            assert not any(overlapped)


def test_overlap_needs_a_runner_that_can_run_ahead() -> None:
    """overlap=True with a runner that computes inside submit raises; None turns it off."""
    kv = KVCacheManager(KVCacheConfig(num_blocks=8, block_size=4))
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), kv)
    runner = FakeRunner(fake_info())
    with pytest.raises(ValueError, match="overlap needs a runner"):
        EngineLoop(scheduler, runner, make_text_stream_factory(ByteTokenizer()), overlap=True)
    engine = EngineLoop(scheduler, runner, make_text_stream_factory(ByteTokenizer()))
    assert engine.overlap is False


# ---------------------------------------------------------------------- real models


def spy_on_submit(runner: Any) -> list[Any]:
    """The plans ``runner`` is given, in order."""
    planned: list[Any] = []
    submit = runner.submit

    def recording(plan: Any) -> Any:
        planned.append(plan)
        return submit(plan)

    runner.submit = recording
    return planned


def tiny_asks(hf: Any) -> tuple[list[Ask], dict[str, list[int]]]:
    """Greedy requests on a tiny random model, and transformers' tokens for the plain ones: a
    stop string cut from a request's own greedy text, max_tokens, an abort, n = 2."""
    from tests.model_runner.oracle import random_ids
    from tests.server.test_torch_model import MAX_TOKENS, hf_greedy

    prompts = {f"p{i}": random_ids(4 + 5 * i, seed=70 + i) for i in range(5)}
    prompts["rep"] = random_ids(4, seed=80) * 4  # the n-gram drafter finds drafts here
    want = {rid: hf_greedy(hf, p) for rid, p in prompts.items()}
    stop_text = ByteTokenizer().decode(want["p1"][4:6])

    def greedy(**kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)

    asks = [
        Ask("p0", prompts["p0"], greedy()),
        Ask("p1", prompts["p1"], greedy(stop=(stop_text,))),
        Ask("p2", prompts["p2"], greedy(n=2)),
        Ask("p3", prompts["p3"], greedy(), abort_after=3),
        Ask("p4", prompts["p4"], greedy()),
        Ask("rep", prompts["rep"], greedy()),
    ]
    return asks, want


@pytest.mark.parametrize("speculative", ["off", "ngram"])
async def test_tiny_model_gives_the_synchronous_loops_outputs(speculative: str) -> None:
    """A tiny random llama on the torch runner, its steps on a CPU step thread: overlap on
    and off give every client the same tokens, text and end (an aborted one: a prefix), on a
    pool small enough to preempt; and the plain greedy ones are transformers' tokens."""
    from tests.model_runner.oracle import make_runner, tiny_hf

    hf = tiny_hf("llama-gqa", seed=3)
    asks, want = tiny_asks(hf)
    results = {}
    for overlap in (True, False):
        runner = make_runner(hf, num_blocks=14, block_size=4)
        runner.use_step_thread(overlap)
        planned = spy_on_submit(runner)
        async with engine_for(
            runner,
            overlap=overlap,
            num_blocks=14,
            max_model_len=64,
            max_num_batched_tokens=16,
            speculative=speculative,
            ngram_min=1,
        ) as (client, engine, scheduler):
            assert engine.overlap is overlap
            results[overlap] = await run_workload(client, asks, ())
            stats = scheduler.make_stats()
        runner.use_step_thread(False)
        assert stats.num_preemptions_total > 0
        assert stats.kv.num_blocks_used == 0
        assert any(s.has_placeholder for p in planned for s in p.decode) is overlap
        if speculative == "ngram":  # drafts verified (synchronous steps), between the others
            assert stats.num_spec_draft_tokens_total > 0
    assert_same(results[True], results[False], asks)
    got = results[True]
    for rid in ("p0", "p4", "rep"):
        assert got[rid].tokens == {0: want[rid]}, rid
    assert got["p2"].tokens == {0: want["p2"], 1: want["p2"]}
    assert got["p1"].reasons == {0: FinishReason.STOP} and len(got["p1"].tokens[0]) <= 6


@pytest.mark.slow
async def test_embedded_model_gives_the_synchronous_loops_outputs() -> None:
    """The embedded SmolLM2 on its Q4 weights (the server's default model), on a CPU step
    thread: overlap on and off give every client the same tokens, text and end (an aborted
    one: a prefix), with a stop string, n = 2, a JSON-schema request, speculation and a pool
    small enough to preempt."""
    import json
    from pathlib import Path

    from model_runner import kernels
    from model_runner.loader import load_model
    from model_runner.runner import TorchRunner
    from server.build import constraint_tracker

    if not kernels.available():
        pytest.skip("kernels not built")
    model = load_model(None, weights="native")
    root = Path(__file__).resolve().parents[2]
    texts = json.loads((root / "loadtest/workloads/prompts/edit128.json").read_text())["prompts"]
    tok = model.tokenizer
    prompts = [tok.encode(t, add_special_tokens=False)[:48] for t in texts[:4]]
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}'

    def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)

    asks = [
        Ask("plain", prompts[0], greedy(ignore_eos=True)),
        Ask("stop", prompts[1], greedy(24, stop=(" the",))),
        Ask("fork", prompts[2], greedy(n=2, ignore_eos=True)),
        Ask("abort", prompts[3], greedy(24, ignore_eos=True), abort_after=4),
        Ask("json", prompts[0][:20], greedy(24, constraint=Constraint("json_schema", schema))),
    ]
    results = {}
    for overlap in (True, False):
        runner = TorchRunner(
            model.config,
            model.state_dict,
            RunnerOptions(num_blocks=12, block_size=16),
            constraints=constraint_tracker(tok, model.config.vocab_size),
        )
        runner.use_step_thread(overlap)
        planned = spy_on_submit(runner)
        async with engine_for(
            runner,
            overlap=overlap,
            num_blocks=12,
            block_size=16,
            tokenizer=tok,
            max_model_len=1024,
            max_num_batched_tokens=128,
            speculative="ngram",
        ) as (client, _engine, scheduler):
            results[overlap] = await run_workload(client, asks, model.config.eos_token_ids)
            stats = scheduler.make_stats()
        runner.use_step_thread(False)
        assert stats.num_preemptions_total > 0
        assert stats.kv.num_blocks_used == 0
        assert any(s.has_placeholder for p in planned for s in p.decode) is overlap
    assert_same(results[True], results[False], asks)
    assert json.loads(results[True]["json"].text[0])["ok"] in (True, False)
    assert results[True]["fork"].tokens[0] == results[True]["fork"].tokens[1]
