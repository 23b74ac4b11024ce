"""``RunnerOptions`` validates its fields when it is made, before a runner loads anything."""

from __future__ import annotations

import pytest

from model_runner.config import RunnerOptions


@pytest.mark.parametrize(
    "field", ["block_size", "num_blocks", "max_decode_rows", "max_lora_rank", "max_cpu_loras"]
)
def test_a_size_below_one_is_refused_by_name(field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be >= 1, got 0$"):
        RunnerOptions(**{field: 0})  # type: ignore[arg-type]


def test_the_defaults_and_unset_sizes_are_valid() -> None:
    options = RunnerOptions(num_blocks=None, max_lora_rank=1, max_cpu_loras=1)
    assert options.max_lora_rank == 1 and options.max_cpu_loras == 1
    with pytest.raises(ValueError, match="attention_sinks must be >= 0, got -1"):
        RunnerOptions(attention_sinks=-1)
