"""The greedy fast path copies to the host once per step (one GPU synchronization)."""

from __future__ import annotations

import pytest
import torch

from model_runner.sampler import Sampler
from scheduler.request import SamplingParams
from tests.model_runner.test_sampler import make_seq

GREEDY = SamplingParams(temperature=0.0)


def _count_tolist(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    original = torch.Tensor.tolist

    def counting(self: torch.Tensor) -> object:
        calls.append(1)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    return calls


def test_greedy_batch_takes_one_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three greedy rows: the argmaxes come back with ONE ``tolist`` (tokens and bad-row
    flags together)."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 1.0, 2.0]])
    calls = _count_tolist(monkeypatch)
    result = Sampler().sample(logits, [make_seq(f"r{i}", GREEDY) for i in range(3)])
    assert result.token_ids == [1, 0, 2]
    assert len(calls) == 1


def test_greedy_batch_still_reports_a_nan_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN row in a greedy batch fails its request alone (token 0), the others argmax."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [float("nan"), 0.0, 1.0]])
    result = Sampler().sample(logits, [make_seq("ok", GREEDY), make_seq("bad", GREEDY)])
    assert result.token_ids == [1, 0]
    assert list(result.failed) == ["bad"]
