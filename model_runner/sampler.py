"""Turns one step's logits into next tokens where the logits live, with no host synchronisation.

Three phases, so a runner can launch a step and read its tokens later (one step ahead)::

    prepare(seqs)          host, before the step: each row's parameters, its uniform, the
                           (row, token) pairs of its penalties -> SamplingBatch (small
                           tensors, moved to the device without waiting)
    launch(logits, batch)  device: tensor ops only (``model_runner.sampling_ops``)
                           -> DeviceSample (token ids, bad-row counts, logprobs)
    collect(batch, host)   host, once the DeviceSample is copied over -> SampleResult

``sample(logits, seqs)`` runs the three back to back.

Pipeline, per row (each stage runs only when some row in the batch needs it, which the host
knows from the rows' parameters)::

    raw logits --> [NaN/inf check] --> min_tokens mask (EOS + stop ids -> -inf)
               --> repetition penalty (HF: prompt + output tokens)
               --> presence / frequency penalties (OpenAI: output tokens)
               --> greedy rows: argmax                                   (temperature == 0)
               --> sampled rows: / temperature --> top-k --> top-p --> min-p --> draw

Truncation follows Hugging Face ``generate()``: top-k, then top-p over the top-k survivors
(renormalised), then min-p, which compares each probability with the row's largest (no stage
removes that one, so the min-p mask does not depend on the others). Tokens tied with the k-th
value stay, and so do tokens tied with the last one top-p keeps. Top-p needs no sort
(``sampling_ops.top_p_keep``).

Drawing is by inverse CDF with one uniform per row: the token is the first whose cumulative
(float64) weight exceeds ``u * total``. A seeded row's ``u`` is a pure function of ``(seed,
num_output_tokens)`` (``seeded_uniform``), computed on the host; every stage is row-wise and a
row's code path depends only on its own parameters and logits, so the same request and seed
give the same token whatever else is in the batch. Unseeded rows draw ``u`` from the sampler's
own ``random.Random``. No per-request ``torch.Generator``, no ``torch.multinomial``.

Logprobs (``logprobs_mode``):
- ``"raw"`` (default, like vLLM): ``log_softmax`` of the model's logits, before penalties,
  temperature and truncation; comparable across requests whatever their sampling settings.
- ``"processed"``: ``log_softmax`` after the min_tokens mask, penalties and temperature
  (temperature 1 for greedy rows), before top-k / top-p / min-p truncation.

A row whose logits contain NaN or +inf, or are all -inf, does not kill the batch: it is
reported in ``SampleResult.failed`` (with the counts, found on the device) and every other row
samples as usual.

Scheduling one step ahead: a seq whose input token is in flight has that token in its penalty
history too. ``prepare`` takes the id that stands for it on the device (``history_id``:
``model_runner.future.Placeholders``) and ``launch`` resolves the pairs there (``resolve``),
so a penalty never waits for the token to reach the host.

When ``prepare`` raises for a batch, ``prepare_or_isolate`` prepares its rows one by one
(``RowByRow``), and ``sample_row_by_row`` samples them so that only the rows that raise fail
(an error path: it waits for each row's token).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from model_runner.sampling_ops import (
    NEG_INF,
    apply_token_bitmask,
    inverse_cdf,
    penalise_presence_frequency,
    penalise_repetition,
    to_device,
    top_k_keep,
    top_p_keep,
)
from scheduler.output import ScheduledSeq, TokenLogprobs

__all__ = [
    "DeviceSample",
    "HistoryId",
    "LogprobsMode",
    "RowByRow",
    "SampleResult",
    "Sampler",
    "SamplingBatch",
    "SamplingError",
    "apply_token_bitmask",
    "mix_seed",
    "seeded_uniform",
]

LogprobsMode = Literal["raw", "processed"]
Resolve = Callable[[torch.Tensor], torch.Tensor]
# The id standing on the device for a seq's input token in flight (in its penalty history),
# or None when that token is known: ``Placeholders.history_id``.
HistoryId = Callable[[ScheduledSeq], int | None]

_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a well-spread 63-bit number per (request, token)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def seeded_uniform(seed: int, step: int) -> float:
    """The uniform in [0, 1) that output token ``step`` of a request seeded ``seed`` draws
    with: 53 bits of ``mix_seed``, the same on every device and in every batch."""
    return (mix_seed(seed, step) >> 10) * 2.0**-53


@dataclass(slots=True)
class SampleResult:
    """One token per row of the logits.

    ``token_ids[i]`` and ``logprobs[i]`` belong to ``seqs[i]``. Rows whose request id is in
    ``failed`` (request_id -> message) hold a placeholder token 0 and no logprobs; the
    caller must not use them.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class SamplingBatch:
    """One step's sampling inputs (``Sampler.prepare``), on the logits' device. Row i is
    ``seqs[i]``; "sampled" rows are those with temperature > 0 (index ``sampled``), and the
    per-row parameters below are theirs, in that order. Which stages run is decided here,
    from the parameters: nothing in ``launch`` depends on a value it would have to read back.
    """

    seqs: Sequence[ScheduledSeq]
    device: torch.device
    vocab_size: int
    processes: bool = False  # any stage beyond argmax runs
    sampled: list[int] = field(default_factory=list)
    sampled_index: torch.Tensor | None = None  # None: every row samples (or none does)
    temperature: torch.Tensor | None = None  # [S] float32
    u: torch.Tensor | None = None  # [S] float64
    top_k: torch.Tensor | None = None  # [S] int64, 0 for no top-k
    max_top_k: int = 0
    top_p_index: torch.Tensor | None = None  # rows of S with top_p < 1 (None: all of S)
    top_p: torch.Tensor | None = None  # [P] float64
    min_p: torch.Tensor | None = None  # [S] float32
    min_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, cols) -> -inf
    repetition: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    presence_frequency: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    has_placeholders: bool = False  # penalty pairs name placeholder tokens (resolve them)
    logprob_rows: list[int] = field(default_factory=list)
    logprob_index: torch.Tensor | None = None
    max_logprobs: int = 0
    processed_logprobs: bool = False

    @property
    def num_rows(self) -> int:
        return len(self.seqs)


@dataclass(frozen=True, slots=True)
class SamplingError:
    """Why one row's sampling failed (``RowByRow``): a ``SampleResult.failed`` entry."""

    request_id: str
    message: str

    @classmethod
    def of(cls, seq: ScheduledSeq, exc: Exception) -> SamplingError:
        return cls(seq.request_id, f"sampling failed: {type(exc).__name__}: {exc}")


@dataclass(frozen=True, slots=True)
class RowByRow:
    """A batch whose ``prepare`` raised, prepared row by row (``prepare_or_isolate``): row
    i's own batch, or why its inputs could not be prepared."""

    rows: list[SamplingBatch | SamplingError]


@dataclass(slots=True)
class DeviceSample:
    """What ``launch`` leaves on the device: ``token_ids`` [R] (the next inputs of a step
    planned ahead), ``ints`` [R, 4] (token, bad row, NaN count, +inf count), and for the
    rows that want logprobs ``logprobs`` [L, 1 + n] (the sampled token's, then the top n)
    and ``top_ids`` [L, n]."""

    token_ids: torch.Tensor
    ints: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> DeviceSample:
        """The same sample with ``fn`` applied to each tensor the host reads (a copy)."""
        ints = fn(self.ints)
        return DeviceSample(
            ints[:, 0],
            ints,
            None if self.logprobs is None else fn(self.logprobs),
            None if self.top_ids is None else fn(self.top_ids),
        )


class Sampler:
    """Sampling on the logits' device; see the module docstring.

    ``seed`` seeds the generator of unseeded rows' uniforms (tests); ``None`` seeds it from
    the operating system. Not thread-safe: one engine thread prepares every step.
    """

    def __init__(self, logprobs_mode: LogprobsMode = "raw", seed: int | None = None) -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self._rng = random.Random(seed)

    # ------------------------------------------------------------------ all three phases

    def sample(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> SampleResult:
        """Sample one token for each row of ``logits`` [B, V]; row i belongs to ``seqs[i]``.

        Never mutates ``logits``; never raises for bad values in a row (see ``failed``).
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [len(seqs)={len(seqs)}, vocab], got {tuple(logits.shape)}"
            )
        batch = self.prepare(seqs, logits.device, logits.shape[1])
        return self.collect(batch, self.launch(logits, batch).map(lambda t: t.cpu()))

    # ------------------------------------------------------------------ host, before

    def prepare(
        self,
        seqs: Sequence[ScheduledSeq],
        device: torch.device,
        vocab_size: int,
        history_id: HistoryId | None = None,
    ) -> SamplingBatch:
        """Read everything the step's sampling needs from ``seqs``, on the host, and move it
        to ``device`` without a synchronisation. ``history_id``: the id of a seq's input
        token in flight, counted in its penalties (``launch``'s ``resolve`` maps it)."""
        batch = SamplingBatch(seqs, device, vocab_size)
        params = [s.sampling for s in seqs]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        freq_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        min_tokens_rows = [
            i for i, s in enumerate(seqs) if s.num_output_tokens < s.sampling.min_tokens
        ]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        batch.processed_logprobs = bool(logprob_rows) and self.logprobs_mode == "processed"
        batch.processes = bool(
            sampled or rep_rows or freq_rows or min_tokens_rows or batch.processed_logprobs
        )
        if min_tokens_rows:
            batch.min_tokens = _stop_token_pairs(seqs, min_tokens_rows, vocab_size, device)
        history = _History(seqs, history_id)
        if rep_rows:
            rows, cols = history.pairs(rep_rows, device, prompt=True)
            penalty = [p.repetition_penalty for p in params]
            batch.repetition = (rows, cols, to_device(penalty, torch.float32, device))
        if freq_rows:
            rows, cols = history.pairs(freq_rows, device, prompt=False)
            batch.presence_frequency = (
                rows,
                cols,
                to_device([p.frequency_penalty for p in params], torch.float32, device),
                to_device([p.presence_penalty for p in params], torch.float32, device),
            )
        batch.has_placeholders = history.has_placeholders
        if sampled:
            self._prepare_sampled(batch, sampled, vocab_size)
        if logprob_rows:
            batch.logprob_rows = logprob_rows
            if len(logprob_rows) < len(seqs):
                batch.logprob_index = to_device(logprob_rows, torch.int64, device)
            batch.max_logprobs = max(params[i].logprobs or 0 for i in logprob_rows)
        return batch

    def prepare_or_isolate(
        self,
        seqs: Sequence[ScheduledSeq],
        device: torch.device,
        vocab_size: int,
        history_id: HistoryId | None = None,
    ) -> SamplingBatch | RowByRow:
        """``prepare``'s batch, or when it raises each row prepared alone, so that only the
        culprit fails (an error path; ``sample_row_by_row`` samples them)."""
        try:
            return self.prepare(seqs, device, vocab_size, history_id)
        except Exception:
            rows: list[SamplingBatch | SamplingError] = []
            for seq in seqs:
                try:
                    rows.append(self.prepare([seq], device, vocab_size, history_id))
                except Exception as exc:
                    rows.append(SamplingError.of(seq, exc))
            return RowByRow(rows)

    def _prepare_sampled(self, batch: SamplingBatch, sampled: list[int], vocab_size: int) -> None:
        device = batch.device
        seqs = batch.seqs
        params = [seqs[i].sampling for i in sampled]
        batch.sampled = sampled
        if len(sampled) < len(seqs):
            batch.sampled_index = to_device(sampled, torch.int64, device)
        batch.temperature = to_device([p.temperature for p in params], torch.float32, device)
        uniforms = []
        for i in sampled:
            seed = seqs[i].sampling.seed
            step = seqs[i].num_output_tokens
            uniforms.append(self._rng.random() if seed is None else seeded_uniform(seed, step))
        batch.u = to_device(uniforms, torch.float64, device)
        top_ks = [p.top_k if p.top_k is not None and p.top_k < vocab_size else 0 for p in params]
        if any(top_ks):
            batch.top_k = to_device(top_ks, torch.int64, device)
            batch.max_top_k = max(top_ks)
        top_p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if top_p_rows:
            if len(top_p_rows) < len(params):
                batch.top_p_index = to_device(top_p_rows, torch.int64, device)
            batch.top_p = to_device([params[j].top_p for j in top_p_rows], torch.float64, device)
        if any(p.min_p > 0.0 for p in params):
            batch.min_p = to_device([p.min_p for p in params], torch.float32, device)

    # ------------------------------------------------------------------ device

    def launch(
        self, logits: torch.Tensor, batch: SamplingBatch, resolve: Resolve | None = None
    ) -> DeviceSample:
        """Sample on ``logits``' device: tensor ops only, nothing the host waits for. Never
        mutates ``logits``. ``resolve`` maps placeholder ids to the tokens they stand for
        (needed when ``batch.has_placeholders``)."""
        device = logits.device
        x = logits if logits.dtype == torch.float32 else logits.float()
        num_rows = x.shape[0]
        if num_rows == 0:
            empty = torch.zeros(0, 4, dtype=torch.int64, device=device)
            return DeviceSample(empty[:, 0], empty)
        # amax propagates NaN: one reduction finds every bad row.
        bad = ~torch.isfinite(x.amax(dim=1))
        if batch.processes:
            processed = torch.where(bad.unsqueeze(1), 0.0, x)  # NaN kept out of shared ops
            if batch.min_tokens is not None:
                processed.index_put_(batch.min_tokens, processed.new_full((), NEG_INF))
            if batch.repetition is not None:
                rows, cols, penalty = batch.repetition
                if batch.has_placeholders:
                    assert resolve is not None, "placeholder tokens need a resolver"
                    cols = resolve(cols)
                penalise_repetition(processed, rows, cols, penalty)
            if batch.presence_frequency is not None:
                rows, cols, frequency, presence = batch.presence_frequency
                if batch.has_placeholders:
                    assert resolve is not None, "placeholder tokens need a resolver"
                    cols = resolve(cols)
                penalise_presence_frequency(processed, rows, cols, frequency, presence)
            tokens = processed.argmax(dim=1)
            scaled = processed
            if batch.sampled:
                assert batch.temperature is not None
                index = batch.sampled_index
                rows_x = processed if index is None else processed.index_select(0, index)
                xs = rows_x / batch.temperature.unsqueeze(1)
                drawn = _draw(xs, batch)
                if index is None:
                    tokens, scaled = drawn, xs
                else:
                    tokens = tokens.index_copy(0, index, drawn)
                    if batch.processed_logprobs:
                        scaled = processed.index_copy(0, index, xs)
        else:
            tokens = x.argmax(dim=1)
            scaled = x
        tokens = torch.where(bad, 0, tokens)
        counts = torch.stack(
            (bad.to(torch.int64), torch.isnan(x).sum(dim=1), torch.isposinf(x).sum(dim=1)), dim=1
        )
        ints = torch.cat((tokens.unsqueeze(1), counts), dim=1)
        sample = DeviceSample(tokens, ints)
        if batch.logprob_rows:
            source = scaled if batch.processed_logprobs else x
            index = batch.logprob_index
            chosen = tokens if index is None else tokens.index_select(0, index)
            rows_lp = source if index is None else source.index_select(0, index)
            logprobs = rows_lp.log_softmax(dim=1)
            chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
            if batch.max_logprobs > 0:
                top = logprobs.topk(batch.max_logprobs, dim=1)
                sample.logprobs = torch.cat((chosen_lp, top.values), dim=1)
                sample.top_ids = top.indices
            else:
                sample.logprobs = chosen_lp
        return sample

    def sample_row_by_row(
        self, logits: torch.Tensor, batches: RowByRow, resolve: Resolve | None = None
    ) -> SampleResult:
        """Sample each row of ``logits`` with its own batch and fail only the rows that
        raise, or whose inputs could not be prepared (an error path: it waits for each
        row's token)."""
        result = SampleResult(token_ids=[], logprobs=[])
        for i, batch in enumerate(batches.rows):
            if isinstance(batch, SamplingError):
                row = SampleResult([0], [None], {batch.request_id: batch.message})
            else:
                try:
                    sample = self.launch(logits[i : i + 1], batch, resolve)
                    row = self.collect(batch, sample.map(lambda t: t.cpu()))
                except Exception as exc:
                    error = SamplingError.of(batch.seqs[0], exc)
                    row = SampleResult([0], [None], {error.request_id: error.message})
            result.token_ids.extend(row.token_ids)
            result.logprobs.extend(row.logprobs)
            result.failed.update(row.failed)
        return result

    # ------------------------------------------------------------------ host, after

    def collect(self, batch: SamplingBatch, host: DeviceSample) -> SampleResult:
        """The host's view of a sample whose tensors are on the host now."""
        seqs = batch.seqs
        ints: list[list[int]] = host.ints.tolist()
        token_ids = [row[0] for row in ints]
        failed: dict[str, str] = {}
        for i, (_, is_bad, num_nan, num_posinf) in enumerate(ints):
            if is_bad:
                failed[seqs[i].request_id] = (
                    f"model produced invalid logits ({_what(num_nan, num_posinf)} in a "
                    f"vocabulary of {batch.vocab_size}) at output token "
                    f"{seqs[i].num_output_tokens}"
                )
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if batch.logprob_rows and host.logprobs is not None:
            values: list[list[float]] = host.logprobs.tolist()
            ids: list[list[int]] = host.top_ids.tolist() if host.top_ids is not None else []
            for j, i in enumerate(batch.logprob_rows):
                seq = seqs[i]
                if seq.request_id in failed:
                    continue
                n = seq.sampling.logprobs or 0
                top = tuple(zip(ids[j][:n], values[j][1 : 1 + n], strict=True)) if n else ()
                logprobs[i] = TokenLogprobs(token_id=token_ids[i], logprob=values[j][0], top=top)
        return SampleResult(token_ids=token_ids, logprobs=logprobs, failed=failed)


# ---------------------------------------------------------------------- host-side helpers


def _what(num_nan: int, num_posinf: int) -> str:
    if num_nan or num_posinf:
        return f"{num_nan} NaN and {num_posinf} +inf values"
    return "only -inf values"


def _stop_token_pairs(
    seqs: Sequence[ScheduledSeq], rows: list[int], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """min_tokens: the (row, token) pairs that cannot be sampled yet (EOS unless ignore_eos,
    and the stop token ids)."""
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i in rows:
        s = seqs[i]
        ids = set(s.sampling.stop_token_ids)
        if not s.sampling.ignore_eos:
            ids.update(s.eos_token_ids)
        for t in sorted(ids):
            if t < vocab_size:
                row_idx.append(i)
                col_idx.append(t)
    if not row_idx:
        return None
    return to_device(row_idx, torch.int64, device), to_device(col_idx, torch.int64, device)


class _History:
    """The tokens each row's penalties count, as (row, token) pairs: O(total tokens), no
    [R, V] mask. A seq whose input token is in flight counts it too, by the id that stands
    for it (``history_id``)."""

    def __init__(self, seqs: Sequence[ScheduledSeq], history_id: HistoryId | None) -> None:
        self.seqs = seqs
        self.history_id = history_id
        self.has_placeholders = False

    def pairs(
        self, rows: list[int], device: torch.device, *, prompt: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token of each row's prompt + output (``prompt``) or output only."""
        row_idx: list[int] = []
        cols: list[int] = []
        for i in rows:
            s = self.seqs[i]
            tokens = s.all_token_ids if prompt else s.all_token_ids[s.num_prompt_tokens :]
            row_idx.extend([i] * len(tokens))
            cols.extend(tokens)
            in_flight = None if self.history_id is None else self.history_id(s)
            if in_flight is not None:
                cols.append(in_flight)
                row_idx.append(i)
                self.has_placeholders = True
        return to_device(row_idx, torch.int64, device), to_device(cols, torch.int64, device)


# ---------------------------------------------------------------------- device: the draw


def _draw(xs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Truncate (top-k, top-p over its survivors, min-p) and draw one token per row of the
    temperature-scaled logits ``xs`` [S, V]."""
    probs = xs.softmax(dim=1)
    keep: torch.Tensor | None = None
    if batch.top_k is not None:
        k = batch.top_k
        kept_k = top_k_keep(xs, k.clamp(min=1), batch.max_top_k)
        keep = kept_k | (k == 0).unsqueeze(1)
    if batch.top_p is not None:
        index = batch.top_p_index
        sub_x = xs if index is None else xs.index_select(0, index)
        weights = probs if index is None else probs.index_select(0, index)
        if keep is not None:
            weights = weights * (keep if index is None else keep.index_select(0, index))
        kept_p = top_p_keep(sub_x, weights, batch.top_p)
        if index is None:
            keep = kept_p if keep is None else keep & kept_p
        else:
            full = torch.ones_like(probs, dtype=torch.bool) if keep is None else keep
            keep = full.index_copy(0, index, full.index_select(0, index) & kept_p)
    if batch.min_p is not None:
        kept_m = probs >= probs.amax(dim=1, keepdim=True) * batch.min_p.unsqueeze(1)
        keep = kept_m if keep is None else keep & kept_m
    assert batch.u is not None
    return inverse_cdf(probs if keep is None else probs * keep, batch.u)
