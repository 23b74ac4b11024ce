"""SchedulerConfig validation: clear errors with the numbers."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler import SchedulerConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1, got 0"),
        ({"max_model_len": 0}, "max_model_len must be >= 1, got 0"),
        (
            {"max_num_seqs": 8, "max_num_batched_tokens": 4},
            r"max_num_batched_tokens \(4\) must be >= max_num_seqs \(8\)",
        ),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold must be >= 0"),
        ({"max_decode_starvation_steps": 0}, "max_decode_starvation_steps must be >= 1, got 0"),
        (
            {"policy": "fastest"},
            "policy must be one of stall-free, prefill-first, slo; got 'fastest'",
        ),
        ({"queue_order": "lifo"}, "queue_order must be one of fcfs, priority"),
        ({"preemption": "random"}, "preemption must be one of priority, newest"),
        ({"memory_mode": "yolo"}, "memory_mode must be one of optimistic, reserve"),
        ({"max_waiting_tokens": -5}, "max_waiting_tokens must be >= 0, got -5"),
    ],
)
def test_invalid_config_raises_value_error(kwargs: dict[str, object], message: str) -> None:
    """Each invalid field is refused with a message naming it and its value."""
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_config_is_frozen_and_chunk_cap_follows_threshold() -> None:
    """The config cannot be mutated; the chunk cap is the threshold, or the budget when 0."""
    config = SchedulerConfig(max_num_batched_tokens=1024, long_prefill_token_threshold=256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_seqs = 1  # type: ignore[misc]
    assert config.max_chunk_tokens == 256
    assert dataclasses.replace(config, long_prefill_token_threshold=0).max_chunk_tokens == 1024
    assert dataclasses.replace(config, long_prefill_token_threshold=4096).max_chunk_tokens == 1024


def test_max_decode_rows_counts_drafts_within_the_budget() -> None:
    """48 requests: 48 rows; with 3 ngram drafts each 192; with a budget of 100 tokens 100."""
    config = SchedulerConfig(max_num_seqs=48)
    assert config.max_decode_rows == 48
    spec = dataclasses.replace(config, speculative="ngram", num_speculative_tokens=3)
    assert spec.max_decode_rows == 192
    assert dataclasses.replace(spec, max_num_batched_tokens=100).max_decode_rows == 100
