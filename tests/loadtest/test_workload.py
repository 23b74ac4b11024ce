"""Workload files: exact counts for priorities, cancellations and prefixes; seeded draws."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from loadtest.workload import (
    WORKLOADS_DIR,
    LengthDist,
    Workload,
    apportion,
    arrival_offsets,
    resolve_workload,
)

VOCAB = 32_000


def _workload(**spec: object) -> Workload:
    return Workload.from_dict({"name": "t", **spec})


def test_apportion_largest_remainder() -> None:
    """Weights 1:2:5 over 80 give 10/20/50; over 10 the largest remainders win (1, 3, 6)."""
    assert apportion([1, 2, 5], 80) == [10, 20, 50]
    assert apportion([1, 2, 5], 10) == [1, 3, 6]
    assert apportion([1, 1, 1], 2) == [1, 1, 0]


def test_priority_mix_and_cancel_fraction_are_exact() -> None:
    """Of 80 requests exactly 10/20/50 get priorities 0/1/2 and round(0.1*80)=8 are cancelled."""
    w = _workload(
        num_requests=80,
        priorities=[
            {"value": 0, "weight": 1},
            {"value": 1, "weight": 2},
            {"value": 2, "weight": 5},
        ],
        cancel={"fraction": 0.1, "after_tokens": {"type": "uniform", "min": 1, "max": 8}},
        output={"len": {"type": "uniform", "min": 4, "max": 32}},
    )
    specs = w.build(vocab_size=VOCAB)
    assert Counter(s.priority for s in specs) == {0: 10, 1: 20, 2: 50}
    cancelled = [s for s in specs if s.cancel_after_tokens is not None]
    assert len(cancelled) == 8
    for s in cancelled:
        assert 1 <= s.cancel_after_tokens <= min(8, s.max_tokens - 1)  # type: ignore[operator]
    assert [s.index for s in specs] == list(range(80))


def test_build_is_deterministic_and_seeded() -> None:
    """The same seed gives the same requests; another seed gives other prompts."""
    spec = {"num_requests": 20, "prompt": {"len": {"type": "uniform", "min": 4, "max": 64}}}
    a = _workload(seed=3, **spec).build(vocab_size=VOCAB)
    b = _workload(seed=3, **spec).build(vocab_size=VOCAB)
    c = _workload(seed=4, **spec).build(vocab_size=VOCAB)
    assert a == b
    assert [s.prompt_token_ids for s in a] != [s.prompt_token_ids for s in c]


def test_cancel_fraction_does_not_change_prompts() -> None:
    """Each aspect draws from its own seeded stream: adding cancellations keeps the prompts."""
    plain = _workload(num_requests=10).build(vocab_size=VOCAB)
    with_cancel = _workload(num_requests=10, cancel={"fraction": 0.5}).build(vocab_size=VOCAB)
    assert [s.prompt_token_ids for s in plain] == [s.prompt_token_ids for s in with_cancel]
    assert sum(s.cancel_after_tokens == 1 for s in with_cancel) == 5


def test_shared_prefixes_are_shared_exactly() -> None:
    """90 of 100 requests start with one of 4 prefixes of 16 tokens, spread 23/23/22/22."""
    w = _workload(
        num_requests=100,
        prompt={"len": 8, "token_id_range": [100, 200]},
        shared_prefix={"num_prefixes": 4, "len": 16, "fraction": 0.9},
    )
    specs = w.build(vocab_size=VOCAB)
    assert Counter(s.prefix_id for s in specs) == {0: 23, 1: 23, 2: 22, 3: 22, None: 10}
    by_prefix: dict[int, set[tuple[int, ...]]] = {}
    for s in specs:
        assert s.prompt_token_ids is not None
        assert all(100 <= t < 200 for t in s.prompt_token_ids)
        if s.prefix_id is None:
            assert len(s.prompt_token_ids) == 8
        else:
            assert len(s.prompt_token_ids) == 24
            by_prefix.setdefault(s.prefix_id, set()).add(s.prompt_token_ids[:16])
    assert all(len(prefixes) == 1 for prefixes in by_prefix.values())
    assert len({next(iter(p)) for p in by_prefix.values()}) == 4


def test_prompt_file_cycles_and_prefix_texts(tmp_path: Path) -> None:
    """A prompt file is cycled in order; text prefixes are prepended."""
    (tmp_path / "p.json").write_text(json.dumps({"prompts": ["a", "b", "c"]}))
    (tmp_path / "w.json").write_text(
        json.dumps(
            {
                "num_requests": 5,
                "prompt": {"source": "file", "path": "p.json"},
                "shared_prefix": {"texts": ["S:"], "fraction": 1.0},
                "output": {"len": 3, "ignore_eos": False},
            }
        )
    )
    specs = Workload.load(tmp_path / "w.json").build(vocab_size=VOCAB)
    assert [s.prompt_text for s in specs] == ["S:a", "S:b", "S:c", "S:a", "S:b"]
    assert all(s.prompt_token_ids is None and s.max_tokens == 3 and not s.ignore_eos for s in specs)


def test_length_distributions_stay_in_bounds() -> None:
    """Uniform draws stay in [min, max]; lognormal draws are clipped to [min, max]."""
    import random

    rng = random.Random(0)
    uni = LengthDist.parse({"type": "uniform", "min": 3, "max": 5}, 1)
    assert {uni.sample(rng) for _ in range(200)} == {3, 4, 5}
    logn = LengthDist.parse(
        {"type": "lognormal", "median": 50, "sigma": 2.0, "min": 10, "max": 90}, 1
    )
    draws = [logn.sample(rng) for _ in range(500)]
    assert min(draws) == 10 and max(draws) == 90
    assert LengthDist.parse(7, 1).sample(rng) == 7


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"bogus": 1}, "unknown workload keys"),
        ({"cancel": {"fraction": 1.5}}, "cancel_fraction must be in"),
        ({"prompt": {"len": {"type": "uniform", "min": 9, "max": 3}}}, "min=9 max=3"),
        ({"prompt": {"len": 0}}, "got 0"),
        ({"sampling": {"temprature": 0}}, "temprature"),
        ({"prompt": {"source": "file"}}, "needs prompt.path"),
    ],
)
def test_invalid_workloads_raise_with_details(spec: dict[str, object], message: str) -> None:
    """Bad workload files fail at load time with a message naming the problem."""
    with pytest.raises(ValueError, match=message):
        _workload(**spec)


def test_shipped_workloads_load() -> None:
    """Every example in loadtest/workloads/ parses and builds its requests."""
    names = sorted(p.stem for p in WORKLOADS_DIR.glob("*.json"))
    assert "chat128" in names and "shared_prefix" in names
    for name in names:
        w = Workload.load(resolve_workload(name))
        assert len(w.build(vocab_size=VOCAB)) == w.num_requests


def test_arrival_offsets() -> None:
    """Open-loop arrivals: first at 0, seeded, increasing; mean gap 1/rate; inf rate -> all at 0."""
    assert arrival_offsets(4, float("inf"), 1.0, 0) == [0.0] * 4
    a = arrival_offsets(20_000, 5.0, 0.5, 1)
    assert a == arrival_offsets(20_000, 5.0, 0.5, 1)
    assert a[0] == 0.0 and all(x < y for x, y in itertools.pairwise(a))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.2, rel=0.05)


def test_default_token_id_range_comes_from_the_vocabulary() -> None:
    """Random prompts draw ids from [V // 8, 7V // 8); without V or a range, build raises."""
    w = _workload(num_requests=50, prompt={"len": 64})
    ids = {t for s in w.build(vocab_size=258) for t in s.prompt_token_ids or ()}
    assert min(ids) >= 32 and max(ids) < 225
    assert len(ids) > 150  # the range is used, not a corner of it
    with pytest.raises(ValueError, match="vocab_size"):
        w.build()


def test_shared_prefix_order_random_draws_tenants_in_seeded_random_order() -> None:
    """order "random": each request's prefix is a seeded uniform draw (not k % K), the same
    on every build; an unknown order names the two choices."""
    spec = {
        "name": "t",
        "seed": 5,
        "prompt": {"source": "random", "len": 4},
        "shared_prefix": {"num_prefixes": 4, "len": 8, "fraction": 1.0, "order": "random"},
    }
    ids = [r.prefix_id for r in Workload.from_dict(spec).build(40, vocab_size=100)]
    assert ids == [r.prefix_id for r in Workload.from_dict(spec).build(40, vocab_size=100)]
    assert ids != [k % 4 for k in range(40)]
    assert set(ids) == {0, 1, 2, 3}
    cyclic = {**spec, "shared_prefix": {**spec["shared_prefix"], "order": "cycle"}}
    assert [r.prefix_id for r in Workload.from_dict(cyclic).build(8, vocab_size=100)] == [
        0, 1, 2, 3, 0, 1, 2, 3
    ]  # fmt: skip
    bad = {**spec, "shared_prefix": {**spec["shared_prefix"], "order": "zipf"}}
    with pytest.raises(ValueError, match=r"order must be cycle\|random"):
        Workload.from_dict(bad)


def test_constrained_workload_reaches_both_backends() -> None:
    """chat128_json's constraint travels on every request: the gRPC oneof and vLLM's
    structured_outputs object; a constraint with two kinds is refused."""
    import json as json_

    from loadtest.grpc_backend import build_request
    from loadtest.openai_backend import completion_body
    from loadtest.workload import resolve_workload

    workload = Workload.load(resolve_workload("chat128_json"))
    spec = workload.build(2)[1]
    schema = workload.constraint["json_schema"] if workload.constraint else None
    assert schema is not None and schema["minItems"] == 32 and not spec.ignore_eos
    request = build_request(spec, "r1")
    assert request.WhichOneof("constraint") == "json_schema"
    assert json_.loads(request.json_schema) == schema
    assert completion_body(spec, None)["structured_outputs"] == {"json": schema}
    regex = Workload.from_dict(
        {"prompt": {"token_id_range": [5, 9]}, "constraint": {"regex": "a+"}}
    )
    assert build_request(regex.build(1)[0], "r2").regex == "a+"
    with pytest.raises(ValueError, match="exactly one of"):
        Workload.from_dict({"constraint": {"regex": "a", "choice": ["b"]}})
