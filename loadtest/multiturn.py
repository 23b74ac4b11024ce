"""Multi-turn conversations from a workload file's ``conversations`` section.

    {"conversations": {"num": S, "turns": T, "first_len": N, "think_time_s": {"min", "max"}}}

Conversation i's turn t prompt is its whole history: turn 0's ``first_len`` tokens, then per
turn the model's answer and a user message of ``prompt.len`` tokens. The answers are only known
once generated, so a driver asks ``prompt(t)`` after recording ``answers[t - 1]``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.workload import LengthDist


@dataclass(slots=True)
class Conversation:
    name: str
    user: list[list[int]]  # user message of each turn (turn 0: the first message)
    think_time_s: list[float]  # before each turn (0 for turn 0)
    answers: list[list[int]] = field(default_factory=list)

    def prompt(self, turn: int) -> list[int]:
        """Turn ``turn``'s prompt: every earlier message and answer, then its user message."""
        if len(self.answers) < turn:
            raise ValueError(f"{self.name}: turn {turn} needs the answers of turns 0..{turn - 1}")
        tokens: list[int] = []
        for t in range(turn + 1):
            tokens += self.user[t]
            if t < turn:
                tokens += self.answers[t]
        return tokens


@dataclass(frozen=True, slots=True)
class MultiTurnWorkload:
    num_conversations: int
    num_turns: int
    first_len: int
    turn_len: LengthDist
    think_min_s: float
    think_max_s: float
    output_len: int
    seed: int

    @classmethod
    def load(cls, path: str | Path) -> MultiTurnWorkload:
        spec: dict[str, Any] = json.loads(Path(path).read_text())
        conv = spec["conversations"]
        num, turns = int(conv["num"]), int(conv["turns"])
        if num * turns != int(spec["num_requests"]):
            raise ValueError(f"num_requests must be conversations x turns = {num * turns}")
        think = conv.get("think_time_s", {"min": 0.0, "max": 0.0})
        return cls(
            num_conversations=num,
            num_turns=turns,
            first_len=int(conv["first_len"]),
            turn_len=LengthDist.parse(spec.get("prompt", {}).get("len"), 64),
            think_min_s=float(think["min"]),
            think_max_s=float(think["max"]),
            output_len=int(spec.get("output", {}).get("len", 32)),
            seed=int(spec.get("seed", 0)),
        )

    def scaled(self, **changes: Any) -> MultiTurnWorkload:
        """A copy with some fields changed (a smaller run of the same shape)."""
        from dataclasses import replace

        return replace(self, **changes)

    def build(self, vocab_size: int) -> list[Conversation]:
        """The conversations' user messages and think times (token ids in [V/8, 7V/8))."""
        rng = random.Random(self.seed)
        low, high = vocab_size // 8, 7 * vocab_size // 8
        conversations = []
        for i in range(self.num_conversations):
            user = [
                [
                    rng.randrange(low, high)
                    for _ in range(self.first_len if t == 0 else self.turn_len.sample(rng))
                ]
                for t in range(self.num_turns)
            ]
            think = [
                0.0 if t == 0 else rng.uniform(self.think_min_s, self.think_max_s)
                for t in range(self.num_turns)
            ]
            conversations.append(Conversation(f"conv{i}", user, think))
        return conversations
