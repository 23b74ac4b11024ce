"""The multi-turn workload: conversations whose turns carry their whole history."""

from __future__ import annotations

import pytest

from loadtest.multiturn import MultiTurnWorkload
from loadtest.workload import Workload, resolve_workload


def test_shipped_multiturn_workload_shape() -> None:
    """multiturn.json: 8 conversations x 4 turns, a 384-token first message, 48-96 token user
    turns, 32-token answers; the plain loader reads it as 32 independent requests."""
    path = resolve_workload("multiturn")
    w = MultiTurnWorkload.load(path)
    assert (w.num_conversations, w.num_turns, w.first_len, w.output_len) == (8, 4, 384, 32)
    convs = w.build(vocab_size=1000)
    assert [len(c.user[0]) for c in convs] == [384] * 8
    assert all(48 <= len(u) <= 96 for c in convs for u in c.user[1:])
    assert all(125 <= t < 875 for c in convs for u in c.user for t in u)
    assert all(c.think_time_s[0] == 0.0 and 0 <= max(c.think_time_s) <= 0.5 for c in convs)
    assert Workload.load(path).num_requests == 32


def test_a_turn_prompt_is_the_whole_history() -> None:
    """Turn t = user 0 + answer 0 + ... + user t; asking before the answers raises."""
    w = MultiTurnWorkload.load(resolve_workload("multiturn")).scaled(num_conversations=1)
    (conv,) = w.build(vocab_size=1000)
    with pytest.raises(ValueError, match="needs the answers"):
        conv.prompt(1)
    conv.answers = [[1, 2], [3]]
    assert conv.prompt(2) == conv.user[0] + [1, 2] + conv.user[1] + [3] + conv.user[2]
    assert conv.prompt(0) == conv.user[0]
