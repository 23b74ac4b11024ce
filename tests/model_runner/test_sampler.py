"""Sampler: greedy, truncation masks, penalties, seeds, distribution, logprobs, bad rows."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from model_runner.future import Placeholders
from model_runner.sampler import Sampler
from model_runner.sampling_ops import top_p_keep
from scheduler.output import PLACEHOLDER_TOKEN_ID, ScheduledSeq
from scheduler.request import SamplingParams

# probabilities 0.5, 0.3, 0.15, 0.05 as logits
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = [math.log(p) for p in PROBS]


def make_seq(
    request_id: str,
    sampling: SamplingParams | None = None,
    prompt: Sequence[int] = (1,),
    output: Sequence[int] = (),
    eos_token_ids: tuple[int, ...] = (),
) -> ScheduledSeq:
    all_ids = list(prompt) + list(output)
    return ScheduledSeq(
        request_id=request_id,
        token_ids=[all_ids[-1]],
        start_pos=len(all_ids) - 1,
        block_ids=[0],
        sampling=sampling or SamplingParams(),
        do_sample=True,
        all_token_ids=all_ids,
        num_prompt_tokens=len(prompt),
        num_output_tokens=len(output),
        eos_token_ids=eos_token_ids,
    )


def support(params: SamplingParams, logits: Sequence[float], num_draws: int = 400) -> set[int]:
    """Tokens drawn by ``num_draws`` rows with seeds 0..num_draws-1 (one batched call)."""
    seqs = [
        make_seq(f"r{i}", SamplingParams(**{**_fields(params), "seed": i}))
        for i in range(num_draws)
    ]
    x = torch.tensor([list(logits)] * num_draws)
    return set(Sampler().sample(x, seqs).token_ids)


def _fields(p: SamplingParams) -> dict[str, object]:
    return {name: getattr(p, name) for name in p.__dataclass_fields__}


def test_greedy_is_argmax() -> None:
    """Temperature 0 returns the row-wise argmax for every row."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen)
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=0.0)) for i in range(7)]
    result = Sampler().sample(logits, seqs)
    assert result.token_ids == logits.argmax(dim=1).tolist()
    assert result.logprobs == [None] * 7
    assert result.failed == {}


def test_greedy_rows_inside_a_sampled_batch_are_argmax() -> None:
    """Greedy rows mixed with sampled rows still take the argmax."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 30, generator=gen)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.3, top_p=0.9) for i in range(6)]
    seqs = [make_seq(f"r{i}", p) for i, p in enumerate(params)]
    result = Sampler(seed=0).sample(logits, seqs)
    argmax = logits.argmax(dim=1).tolist()
    assert [result.token_ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_top_k_one_equals_greedy() -> None:
    """top_k=1 at any temperature samples the argmax."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 100, generator=gen)
    seqs = [make_seq(f"r{i}", SamplingParams(temperature=2.0, top_k=1)) for i in range(64)]
    result = Sampler(seed=3).sample(logits, seqs)
    assert result.token_ids == logits.argmax(dim=1).tolist()


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), {0, 1, 2, 3}),
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        # mass before token 2 is 0.8 >= 0.75: dropped; before token 1 is 0.5 < 0.75: kept
        (SamplingParams(top_p=0.75), {0, 1}),
        (SamplingParams(top_p=0.45), {0}),  # mass before token 1 is 0.5 >= 0.45
        (SamplingParams(top_p=0.82), {0, 1, 2}),
        # top-k first: over {0,1,2} the mass before token 2 is 0.8/0.95 = 0.842 >= 0.82
        (SamplingParams(top_k=3, top_p=0.82), {0, 1}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # threshold 0.2 * 0.5 = 0.1
        (SamplingParams(min_p=0.5), {0, 1}),  # threshold 0.25
        (SamplingParams(min_p=0.61), {0}),  # threshold 0.305 > 0.3
        (SamplingParams(top_p=0.82, min_p=0.5), {0, 1}),
    ],
)
def test_truncation_support_is_exact(params: SamplingParams, expected: set[int]) -> None:
    """top-k / top-p / min-p keep exactly the tokens their definitions allow (400 seeded
    draws)."""
    assert support(params, LOGITS) == expected


def test_top_k_keeps_ties_at_the_kth_value() -> None:
    """Tokens tied with the k-th logit all stay in, with and without top-p after it."""
    logits = [2.0, 1.0, 1.0, -5.0]
    assert support(SamplingParams(top_k=2), logits) == {0, 1, 2}
    assert support(SamplingParams(top_k=2, top_p=0.999), logits) == {0, 1, 2}


def test_top_p_keeps_ties_at_the_cut() -> None:
    """The tokens tied with the last one top-p keeps all stay: p = 0.4, 0.2, 0.2, 0.2 with
    top_p 0.5 keeps the first and the three tied with the second (no tie is split by an
    arbitrary order)."""
    logits = [math.log(p) for p in (0.4, 0.2, 0.2, 0.2)]
    assert support(SamplingParams(top_p=0.5), logits) == {0, 1, 2, 3}
    assert support(SamplingParams(top_p=0.4), logits) == {0}


def test_penalties_match_hand_computation() -> None:
    """Repetition (prompt+output, HF) then frequency/presence (output only, OpenAI), exactly."""
    logits = [2.0, 1.9, -1.0, 0.5, 0.25]
    prompt, output = [0, 2], [1, 1]
    params = SamplingParams(
        temperature=0.0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logprobs=5,
    )
    expected = [
        2.0 / 2.0,  # seen in the prompt, positive: divided; not an output token
        1.9 / 2.0 - 2 * 0.25 - 0.5,  # seen twice in the output
        -1.0 * 2.0,  # seen in the prompt, negative: multiplied
        0.5,
        0.25,
    ]
    seq = make_seq("r", params, prompt=prompt, output=output)
    result = Sampler(logprobs_mode="processed").sample(torch.tensor([logits]), [seq])
    assert result.token_ids == [0]
    ref = torch.tensor([expected]).log_softmax(dim=1)[0]
    lp = result.logprobs[0]
    assert lp is not None
    top = dict(lp.top)
    assert sorted(top) == [0, 1, 2, 3, 4]
    for token, value in top.items():
        assert value == pytest.approx(float(ref[token]), abs=1e-6)


def test_penalties_only_touch_their_rows() -> None:
    """A penalised row next to a plain one: the plain row's logits are untouched."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    seqs = [
        make_seq("pen", SamplingParams(temperature=0.0, repetition_penalty=4.0), prompt=[1]),
        make_seq("plain", SamplingParams(temperature=0.0, logprobs=3)),
    ]
    result = Sampler(logprobs_mode="processed").sample(logits, seqs)
    assert result.token_ids == [2, 1]  # 3.0 / 4 = 0.75 < 2.0
    plain = result.logprobs[1]
    assert plain is not None
    ref = logits[1].log_softmax(dim=0)
    assert dict(plain.top) == {t: float(ref[t]) for t in range(3)}


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    """EOS and stop_token_ids cannot be sampled while num_output_tokens < min_tokens."""
    logits = torch.tensor([[0.0, 9.0, 8.0, 1.0]] * 4)
    stop = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,))
    seqs = [
        make_seq("early", stop, output=[3], eos_token_ids=(1,)),
        make_seq("done", stop, output=[3, 3], eos_token_ids=(1,)),
        make_seq(
            "ignore",
            SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True),
            output=[3],
            eos_token_ids=(1,),
        ),
        make_seq("none", SamplingParams(temperature=0.0), eos_token_ids=(1,)),
    ]
    result = Sampler().sample(logits, seqs)
    assert result.token_ids == [3, 1, 1, 1]


def test_seeded_row_is_batch_invariant() -> None:
    """Same seed and logits give the same tokens alone and inside a batch of 16 other rows."""
    vocab = 64
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=1234)
    others = [
        SamplingParams(
            temperature=[0.0, 0.5, 1.0, 1.5][i % 4],
            top_k=[None, 5, 50][i % 3],
            top_p=[1.0, 0.7][i % 2],
            min_p=[0.0, 0.1][i % 2],
            repetition_penalty=[1.0, 1.3][i % 2],
            seed=None if i % 3 else 1000 + i,
            logprobs=[None, 2][i % 2],
        )
        for i in range(16)
    ]
    alone: list[int] = []
    batched: list[int] = []
    for step in range(12):
        row = torch.randn(vocab, generator=gen)
        seq = make_seq("me", params, output=[7] * step)
        alone.append(Sampler().sample(row.unsqueeze(0), [seq]).token_ids[0])
        rest = torch.randn(16, vocab, generator=gen)
        logits = torch.cat([rest[:9], row.unsqueeze(0), rest[9:]])
        seqs = [make_seq(f"o{i}", p, output=[3] * i) for i, p in enumerate(others)]
        seqs.insert(9, seq)
        batched.append(Sampler().sample(logits, seqs).token_ids[9])
    assert alone == batched
    # And the seed matters: a different seed draws a different sequence on flat logits.
    flat = torch.zeros(1, 1000)
    draws = {
        seed: [
            Sampler()
            .sample(
                flat,
                [make_seq("x", SamplingParams(seed=seed), output=[0] * step)],
            )
            .token_ids[0]
            for step in range(5)
        ]
        for seed in (1, 2)
    }
    assert draws[1] != draws[2]
    assert len(set(draws[1])) > 1  # the step enters the generator seed


@pytest.mark.parametrize(
    ("seeded", "top_p"), [(False, 1.0), (True, 1.0), (False, 0.9), (True, 0.9)]
)
def test_temperature_sampling_matches_softmax(seeded: bool, top_p: float) -> None:
    """Empirical frequencies over 20000 draws match softmax(logits / T), renormalised over the
    top-p nucleus, within 5 sigma (unseeded and seeded)."""
    num_draws = 20_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -3.0])
    temperature = 0.7
    params = SamplingParams(temperature=temperature, top_p=top_p)
    seqs = [
        make_seq(f"r{i}", SamplingParams(**{**_fields(params), "seed": i if seeded else None}))
        for i in range(num_draws)
    ]
    sampler = Sampler(seed=42)
    result = sampler.sample(logits.expand(num_draws, -1), seqs)
    counts = Counter(result.token_ids)
    expected = (logits / temperature).softmax(dim=0).tolist()
    if top_p < 1.0:
        # softmax(logits / 0.7) sorted: tokens 5, 0, 1, 6, 2, ... with cumulative mass
        # 0.652, 0.808, 0.885, 0.935: the mass before token 2 is the first >= 0.9, so the
        # nucleus is {5, 0, 1, 6}.
        nucleus = {5, 0, 1, 6}
        mass = sum(expected[t] for t in nucleus)
        expected = [p / mass if t in nucleus else 0.0 for t, p in enumerate(expected)]
    for token, p in enumerate(expected):
        # A frequency over N independent draws has std sqrt(p(1-p)/N); 5 sigma bounds a
        # correct sampler's deviation with probability > 1 - 1e-6 per token, while a wrong
        # temperature (e.g. T=1: p5 = 0.41 vs 0.55) is off by > 30 sigma.
        sigma = math.sqrt(p * (1 - p) / num_draws)
        assert abs(counts[token] / num_draws - p) <= 5 * sigma, (token, counts[token], p)


def test_logprobs_are_raw_log_softmax() -> None:
    """Default logprobs: log_softmax of the raw logits for the sampled token and the top n."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 40, generator=gen)
    params = [
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=0.9, top_k=10, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, logprobs=None),
        SamplingParams(temperature=1.2, logprobs=3, seed=4),
    ]
    seqs = [make_seq(f"r{i}", p, prompt=[0, 1, 2]) for i, p in enumerate(params)]
    result = Sampler(seed=0).sample(logits, seqs)
    ref = logits.log_softmax(dim=1)
    for i, n in ((0, 5), (1, 0), (3, 3)):
        lp = result.logprobs[i]
        assert lp is not None
        token = result.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == float(ref[i, token])
        top = ref[i].topk(n) if n else None
        expected_top = (
            tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else ()
        )
        assert lp.top == expected_top
    assert result.logprobs[2] is None


def test_processed_logprobs_include_temperature() -> None:
    """logprobs_mode='processed': log_softmax of logits / temperature."""
    logits = torch.tensor([[3.0, 1.0, 0.0, -2.0]])
    seq = make_seq("r", SamplingParams(temperature=0.5, logprobs=4, seed=1))
    result = Sampler(logprobs_mode="processed").sample(logits, [seq])
    lp = result.logprobs[0]
    assert lp is not None
    ref = (logits[0] / 0.5).log_softmax(dim=0)
    assert lp.logprob == float(ref[result.token_ids[0]])
    assert dict(lp.top) == {t: float(ref[t]) for t in range(4)}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_rows_fail_alone(temperature: float) -> None:
    """NaN, +inf and all -inf rows go to failed; the other rows still sample correctly."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [0.0, 5.0, 1.0],
            [0.0, nan, 1.0],
            [inf, 0.0, 1.0],
            [-inf, -inf, -inf],
            [9.0, 0.0, 1.0],
        ]
    )
    seqs = [
        make_seq(f"r{i}", SamplingParams(temperature=temperature, top_k=1, logprobs=1))
        for i in range(5)
    ]
    result = Sampler(seed=0).sample(logits, seqs)
    assert sorted(result.failed) == ["r1", "r2", "r3"]
    assert "1 NaN" in result.failed["r1"]
    assert "1 +inf" in result.failed["r2"]
    assert "only -inf" in result.failed["r3"]
    assert [result.token_ids[i] for i in (0, 4)] == [1, 0]
    assert [result.logprobs[i] is None for i in range(5)] == [False, True, True, True, False]


def test_shape_mismatch_raises() -> None:
    """Logits rows must match the number of seqs."""
    with pytest.raises(ValueError, match=r"len\(seqs\)=2"):
        Sampler().sample(torch.zeros(3, 4), [make_seq("a"), make_seq("b")])


def test_empty_batch() -> None:
    """No rows, no tokens."""
    result = Sampler().sample(torch.zeros(0, 4), [])
    assert result.token_ids == [] and result.logprobs == [] and result.failed == {}


@pytest.mark.parametrize("top_k", [None, 600])
def test_large_vocab_draws_follow_weights_across_chunks(top_k: int | None) -> None:
    """V=1000 spans several inverse-CDF chunks: frequencies match the (top-k) softmax."""
    vocab, num_draws = 1000, 20_000
    logits = torch.full((vocab,), -2.0)
    heavy = {3: 2.0, 255: 1.5, 256: 1.0, 511: 2.5, 700: 0.5, 999: 1.8}
    for token, value in heavy.items():
        logits[token] = value
    logits[650:] = -3.0  # a tail below the 600th largest logit
    logits[700], logits[999] = heavy[700], heavy[999]
    seqs = [make_seq(f"r{i}", SamplingParams(top_k=top_k)) for i in range(num_draws)]
    result = Sampler(seed=7).sample(logits.expand(num_draws, -1), seqs)
    counts = Counter(result.token_ids)
    x = logits.clone()
    if top_k is not None:
        x[x < x.topk(top_k).values[-1]] = float("-inf")
    expected = x.softmax(dim=0)
    for token in heavy:
        p = float(expected[token])
        sigma = math.sqrt(p * (1 - p) / num_draws)  # 5 sigma: see the test above
        assert abs(counts[token] / num_draws - p) <= 5 * sigma, (token, counts[token], p)
    if top_k is not None:
        allowed = set(torch.nonzero(expected > 0).flatten().tolist())
        assert set(counts) <= allowed
        # The 600th largest logit is -2.0, shared by the 646 light tokens below 650: ties all
        # stay, so the 6 heavy tokens and those 646 survive, the -3.0 tail does not.
        assert allowed == set(heavy) | (set(range(650)) - set(heavy))


# ---------------------------------------------------------------------- distributions


def reference_probs(logits: Sequence[float], params: SamplingParams, history: Sequence[int] = (),
                    num_prompt: int = 0) -> list[float]:  # fmt: skip
    """The filtered softmax the sampler must draw from, written out plainly in float64:
    penalties, temperature, top-k (ties stay), top-p over the top-k survivors (a token stays
    when the tokens strictly above it hold less than top_p of their mass), min-p."""
    x = list(logits)
    for t in set(history):
        if params.repetition_penalty != 1.0:
            x[t] = (
                x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
            )
    outputs = list(history[num_prompt:])
    for t in set(outputs):
        x[t] -= params.frequency_penalty * outputs.count(t) + params.presence_penalty
    x = [v / params.temperature for v in x]
    keep = set(range(len(x)))
    if params.top_k is not None:
        kth = sorted(x, reverse=True)[params.top_k - 1]
        keep = {t for t in keep if x[t] >= kth}
    top = max(x)
    probs = [math.exp(v - top) for v in x]
    if params.top_p < 1.0:
        mass = sum(probs[t] for t in keep)
        keep = {t for t in keep if sum(probs[u] for u in keep if x[u] > x[t]) < params.top_p * mass}
    if params.min_p > 0.0:
        keep = {t for t in keep if probs[t] >= params.min_p * max(probs)}
    total = sum(probs[t] for t in keep)
    return [probs[t] / total if t in keep else 0.0 for t in range(len(x))]


def chi_square_bound(df: int, z: float = 4.75) -> float:
    """The chi-square quantile with ``df`` degrees of freedom that a correct sampler exceeds
    with probability about 1e-6 (Wilson-Hilferty)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


DISTRIBUTION_CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.1, top_k=12, top_p=0.9, min_p=0.05),
    SamplingParams(
        temperature=1.0,
        top_p=0.95,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
    ),
]


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("params", DISTRIBUTION_CASES, ids=lambda p: repr(p)[15:60])
def test_distribution_matches_the_filtered_softmax(params: SamplingParams, seeded: bool) -> None:
    """20,000 draws of one row, each filter alone and combined (penalties first): tokens the
    filters remove are never drawn, and the counts of the rest pass a chi-square test
    against ``reference_probs`` (about 1e-6 false alarms), seeded and unseeded."""
    num_draws, vocab = 20_000, 40
    logits = (torch.randn(vocab, generator=torch.Generator().manual_seed(11)) * 1.5).tolist()
    prompt, output = [3, 7, 7], [7, 12, 12, 5]
    seqs = [
        make_seq(
            f"r{i}",
            SamplingParams(**{**_fields(params), "seed": i if seeded else None}),
            prompt=prompt,
            output=output,
        )
        for i in range(num_draws)
    ]
    result = Sampler(seed=5).sample(torch.tensor([logits] * num_draws), seqs)
    counts = Counter(result.token_ids)
    expected = reference_probs(logits, params, prompt + output, len(prompt))
    assert {t for t in counts} <= {t for t, p in enumerate(expected) if p > 0}
    support_ = [t for t, p in enumerate(expected) if p > 0]
    stat = sum(
        (counts[t] - num_draws * expected[t]) ** 2 / (num_draws * expected[t]) for t in support_
    )
    assert len(support_) > 1
    assert stat < chi_square_bound(len(support_) - 1), (stat, len(support_))


def sorted_top_p(x: torch.Tensor, weights: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p by sorting, in float64, for comparison: per distinct value (descending), keep it
    when the weight of the strictly larger values is below top_p of the total."""
    keep = torch.zeros_like(x, dtype=torch.bool)
    for r in range(x.shape[0]):
        values, inverse = torch.unique(x[r].double(), sorted=True, return_inverse=True)
        mass = torch.zeros(len(values), dtype=torch.float64).index_add_(
            0, inverse, weights[r].double()
        )
        above = mass.flip(0).cumsum(0).flip(0) - mass  # weight of strictly larger values
        keep[r] = (above < top_p * weights[r].double().sum())[inverse]
    return keep


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
@pytest.mark.parametrize("flat", [True, False])
def test_top_p_threshold_equals_sorting_on_any_row(top_p: float, flat: bool) -> None:
    """The sort-free top-p (radix selection over the float bits) keeps exactly what sorting
    keeps: flat rows whose nucleus spans thousands of tokens, peaked rows, rows with many ties
    (logits rounded to 0.01), and weights with zeros from a top-k before it."""
    gen = torch.Generator().manual_seed(21 + flat)
    x = torch.randn(6, 5000, generator=gen) * (0.05 if flat else 3.0)
    x[3] = (x[3] * 100).round() / 100  # ties
    probs = x.softmax(dim=1)
    weights = probs.clone()
    weights[4] *= x[4] >= x[4].topk(700).values[-1]  # a top-k before it
    got = top_p_keep(x, weights, torch.full((6,), top_p, dtype=torch.float64))
    want = sorted_top_p(x, weights, top_p) & (weights > 0)
    assert torch.equal(got & (weights > 0), want)
    assert bool(got.any(dim=1).all())
    if flat and top_p == 0.9:
        assert int(want[0].sum()) > 1000  # the nucleus really is large


def test_unseeded_rows_are_random() -> None:
    """Unseeded rows draw independently: 200 rows over a flat vocabulary of 1,000 give many
    distinct tokens, and two samplers with different seeds draw different tokens."""
    logits = torch.zeros(200, 1000)
    seqs = [make_seq(f"r{i}") for i in range(200)]
    first = Sampler(seed=1).sample(logits, seqs).token_ids
    second = Sampler(seed=2).sample(logits, seqs).token_ids
    assert len(set(first)) > 150
    assert first != second
    assert Sampler(seed=1).sample(logits, seqs).token_ids == first  # a seeded sampler repeats


def test_placeholder_token_counts_in_the_penalties() -> None:
    """A seq whose last token is a placeholder (scheduled one step ahead) is penalised for
    that token, resolved on the device through the runner's ``Placeholders`` (the request
    was row 2 of the step before, which sampled 4 there): the same logprobs as the seq whose
    history holds the token itself."""
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5, 0.25]])
    params = SamplingParams(
        temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.4, logprobs=5
    )
    known = make_seq("r", params, prompt=[0, 2], output=[1, 4])
    ahead = make_seq("r", params, prompt=[0, 2], output=[1])
    ahead.token_ids = [PLACEHOLDER_TOKEN_ID]
    ahead.num_output_tokens = 2
    placeholders = Placeholders(4, logits.device)
    placeholders.advance([make_seq("x"), make_seq("y"), make_seq("r")])
    placeholders.publish(torch.tensor([9, 9, 4]))
    ahead, error = placeholders.substitute(ahead, is_decode=True)
    assert error is None and ahead.token_ids == [-3]
    sampler = Sampler(logprobs_mode="processed")
    want = sampler.sample(logits, [known])
    batch = sampler.prepare([ahead], logits.device, 5, placeholders.history_id)
    got = sampler.collect(
        batch, sampler.launch(logits, batch, placeholders.resolve).map(lambda t: t)
    )
    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
