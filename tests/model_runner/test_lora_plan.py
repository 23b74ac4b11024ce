"""A step's adapters as the host plans them (``model_runner.lora.plan``), from the pass that
builds the step's rows (``StepRows.of``): slots, rows, scales and segments, exactly."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from model_runner.step import StepLimits, StepRows
from scheduler.request import LoraRef
from tests.model_runner.oracle import plan, seq

WEIGHTS: dict[str, Any] = {
    n: SimpleNamespace(rank=r, digest=f"{n}-digest", layers=[]) for n, r in (("x", 4), ("y", 8))
}
LIMITS = StepLimits(block_size=4, num_blocks=16, max_model_len=64, vocab_size=100)


def _on(s: Any, name: str | None, scale: float = 1.0) -> Any:
    return dataclasses.replace(s, lora=None if name is None else LoraRef(name, name, scale))


def _rows(names: tuple[str | None, str | None, str | None]) -> StepRows:
    """A prefill chunk of 3 rows, a base chunk of 2, then two decodes: adapters ``names``
    for the chunk and the two decodes (y's decode at scale 0.5)."""
    ids = list(range(1, 20))
    prefill = [_on(seq("p", ids, 0, 3, [1]), names[0]), seq("b", ids, 0, 2, [2])]
    decode = [_on(seq("d0", ids, 8, 9, [3, 4, 5]), names[1]),
              _on(seq("d1", ids, 4, 5, [6, 7]), names[2], 0.5)]  # fmt: skip
    return StepRows.of(plan(0, prefill=prefill, decode=decode), LIMITS, adapters=_lookup)


def _lookup(ref: LoraRef) -> Any:
    return WEIGHTS.get(ref.name)


def test_a_steps_rows_carry_their_adapters_by_slot_and_scale() -> None:
    rows = _rows(("y", "x", "y"))
    lora = rows.lora
    assert lora is not None and lora.names == ("x", "y")  # name order, not row order
    assert lora.slots == (WEIGHTS["x"], WEIGHTS["y"]) and lora.max_rank == 8
    # rows: p (3, y), b (2, base), d0 (x), d1 (y at 0.5)
    assert lora.row_slot == (1, 1, 1, -1, -1, 0, 1)
    assert lora.row_scale == (1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5)
    assert lora.segments == ((0, 3, 1),) and lora.longest_segment == 3
    assert lora.decode_rows == ((5, 0), (6, 1))


def test_the_same_adapters_in_another_row_order_keep_the_cuda_stacks() -> None:
    pytest.importorskip("triton")
    from model_runner.lora.cuda import StackCache

    cache = StackCache()
    first = cache.for_step(_rows(("y", "x", "y")).lora)  # type: ignore[arg-type]
    first[(0, "q")] = None
    assert cache.for_step(_rows(("x", "y", "x")).lora) is first  # type: ignore[arg-type]
    assert cache.for_step(_rows(("x", "x", None)).lora) is not first  # type: ignore[arg-type]


def test_a_seq_whose_adapter_is_not_resident_fails_alone_in_the_same_pass() -> None:
    rows = _rows(("z", "x", None))
    assert dict(rows.failed) == {"p": "adapter 'z' is not loaded on this server"}
    assert [s.request_id for s in rows.seqs] == ["b", "d0", "d1"]
    assert rows.lora is not None and rows.lora.row_slot == (-1, -1, 0, -1)
    base = _rows((None, None, None))
    assert base.lora is None and not base.failed


def test_split_passes_keep_each_parts_adapters() -> None:
    prefill, decode = _rows(("y", "x", "y")).split()
    assert prefill.lora is not None and prefill.lora.names == ("y",)
    assert prefill.lora.row_slot == (0, 0, 0, -1, -1)
    assert decode.lora is not None and decode.lora.names == ("x", "y")
    assert decode.lora.decode_rows == ((0, 0), (1, 1))
