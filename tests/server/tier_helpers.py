"""A multi-turn workload through a real EngineLoop with tier 2 on or off (tests of
server.kv_tier). The cache manager's invariants are checked after every engine step."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from cache_manager import KVCacheConfig, KVCacheManager, KVCacheStats
from metrics.records import NullSink, StepRecord
from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig
from server.engine import EngineLoop
from server.engine_client import EngineClient
from server.fake_tokenizer import ByteTokenizer
from server.kv_tier import KVTier, open_kv_tier
from server.text import make_text_stream_factory

BLOCK_SIZE = 4


class InvariantSink(NullSink):
    """Checks the cache manager after every step (on the engine thread: a failure kills the
    engine, so the test sees it); drops every other record."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.num_steps = 0

    def on_step(self, record: StepRecord) -> None:
        self.kv.check_invariants()
        self.num_steps += 1


@dataclass(slots=True)
class Conversation:
    """Turn t's prompt = the previous prompt + its answer + ``user[t]``."""

    name: str
    user: list[list[int]]
    salt: str | None = None
    answers: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: int) -> list[int]:
        tokens: list[int] = []
        for t in range(turn + 1):
            tokens += self.user[t]
            if t < turn:
                tokens += self.answers[t]
        return tokens


def make_conversations(
    num: int, num_turns: int, vocab: int = 128, first_len: int = 14, turn_len: int = 7
) -> list[Conversation]:
    rng = random.Random(7)
    return [
        Conversation(
            f"c{i}",
            [
                [rng.randrange(3, vocab) for _ in range(first_len if t == 0 else turn_len)]
                for t in range(num_turns)
            ],
        )
        for i in range(num)
    ]


@dataclass(slots=True)
class RunResult:
    answers: dict[tuple[str, int], list[int]]
    kv: KVCacheStats
    num_cached_tokens: dict[tuple[str, int], int]


def build(
    runner: Any,
    num_blocks: int,
    disk_dir: str | None,
    capacity_bytes: int = 1 << 30,
    store_kind: str = "lmdb",
) -> tuple[EngineLoop, KVCacheManager, KVTier | None]:
    kv = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, kv_tier=disk_dir is not None)
    )
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64), kv
    )
    tier = None
    if disk_dir is not None:
        tier = open_kv_tier(
            kv,
            runner,
            disk_dir=disk_dir,
            capacity_bytes=capacity_bytes,
            store_kind=store_kind,
            source="fake",
            block_size=BLOCK_SIZE,
        )
    engine = EngineLoop(
        scheduler,
        runner,
        make_text_stream_factory(ByteTokenizer()),
        sink=InvariantSink(kv),
        kv_tier=tier,
    )
    return engine, kv, tier


async def run_turns(
    engine: EngineLoop,
    conversations: list[Conversation],
    turns: range,
    max_tokens: int = 5,
) -> RunResult:
    """Run ``turns`` of every conversation: each turn's requests at once (interleaved),
    turns one after the other. Greedy; each answer is appended to its conversation."""
    client = EngineClient(engine)
    answers: dict[tuple[str, int], list[int]] = {}
    cached: dict[tuple[str, int], int] = {}

    async def one(conv: Conversation, turn: int) -> None:
        req = Request(
            request_id=f"{conv.name}-t{turn}",
            prompt_token_ids=conv.prompt(turn),
            sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            eos_token_ids=(2,),
            cache_salt=conv.salt,
        )
        tokens: list[int] = []
        async for out in client.generate(req):
            tokens += out.token_ids
            if out.finished:
                cached[(conv.name, turn)] = out.num_cached_tokens
        answers[(conv.name, turn)] = tokens
        if len(conv.answers) == turn:
            conv.answers.append(tokens)

    for turn in turns:
        await asyncio.gather(*(one(c, turn) for c in conversations))
    return RunResult(answers, engine.latest_stats.kv, cached)


def run_workload(
    runner: Any,
    conversations: list[Conversation],
    turns: range,
    num_blocks: int,
    disk_dir: str | None,
    **build_kw: Any,
) -> RunResult:
    """Start an engine, run ``turns``, stop it (flushing tier 2); no block may be left held."""
    engine, kv, _tier = build(runner, num_blocks, disk_dir, **build_kw)
    engine.start()
    try:
        result = asyncio.run(run_turns(engine, conversations, turns))
    finally:
        engine.stop(30)
    assert engine.is_alive is False and engine.dead_error is None, engine.dead_error
    kv.check_invariants()
    stats = kv.make_stats()
    assert stats.num_blocks_used == 0 and stats.total_sequences == 0, "blocks leaked"
    return RunResult(result.answers, engine.latest_stats.kv, result.num_cached_tokens)
