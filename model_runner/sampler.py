"""Turns one step's logits into next tokens, vectorised over the batch.

Pipeline, per row (each stage runs only when some row in the batch needs it)::

    raw logits --> [NaN/inf check] --> min_tokens mask (EOS + stop ids -> -inf)
               --> repetition penalty (HF: prompt + output tokens)
               --> presence / frequency penalties (OpenAI: output tokens)
               --> greedy rows: argmax                                   (temperature == 0)
               --> sampled rows: / temperature --> top-k --> top-p --> min-p --> draw

Truncation order follows Hugging Face ``generate()``: top-k, then top-p over the top-k
survivors (renormalised), then min-p. min-p compares each probability with the row maximum,
which no earlier stage removes, so its mask does not depend on what ran before it.

Drawing is by inverse CDF: one uniform ``u`` per row, the token is the first whose cumulative
(float64) probability exceeds ``u * total``. A seeded row draws ``u`` from its own
``torch.Generator`` seeded from ``(seed, num_output_tokens)``; every stage is row-wise and a
row's code path depends only on its own parameters and logits, so the same request and seed
give the same token whatever else is in the batch.

Speed: a truncated row (top-k <= ``num_candidates``, or a top-p / min-p cut) first works on
its ``num_candidates`` largest logits (``topk``, no full sort); only when the cut does not
fall inside them (a very flat distribution) does it take the full-vocabulary path (sort for
top-p). Untruncated rows cost a softmax and a cumulative sum.

Logprobs (``logprobs_mode``):
- ``"raw"`` (default, like vLLM): ``log_softmax`` of the model's logits, before penalties,
  temperature and truncation; comparable across requests whatever their sampling settings.
- ``"processed"``: ``log_softmax`` after the min_tokens mask, penalties and temperature
  (temperature 1 for greedy rows), before top-k / top-p / min-p truncation.

A row whose logits contain NaN or +inf, or are all -inf, does not kill the batch: it is
reported in ``SampleResult.failed`` and every other row samples as usual.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from scheduler.output import ScheduledSeq, TokenLogprobs
from scheduler.request import SamplingParams

LogprobsMode = Literal["raw", "processed"]

_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in ``bitmask`` [R, ceil(V / 32)] int32 is
    clear (bit ``t % 32`` of word ``t // 32`` for token ``t``; ``model_runner.constraints``).
    Columns past the mask's ``32 * words`` are cleared too."""
    num_rows, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(num_rows, -1)
    allowed = allowed.to(logits.device, non_blocking=True)
    if allowed.shape[1] < vocab_size:
        logits[:, allowed.shape[1] :] = _NEG_INF
        vocab_size = allowed.shape[1]
    logits[:, :vocab_size].masked_fill_(~allowed[:, :vocab_size], _NEG_INF)


def mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): a well-spread 63-bit generator seed per (request, token)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


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


class Sampler:
    """Stateless apart from the generator that draws for unseeded rows.

    ``seed`` seeds that generator (tests); ``None`` seeds it from torch's default source.
    ``num_candidates``: how many of the largest logits a truncated row looks at before it
    falls back to the full vocabulary.
    """

    def __init__(
        self,
        logprobs_mode: LogprobsMode = "raw",
        seed: int | None = None,
        num_candidates: int = 256,
    ) -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1, got {num_candidates}")
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self.num_candidates = num_candidates
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------ public

    def sample(self, logits: torch.Tensor, seqs: Sequence[ScheduledSeq]) -> SampleResult:
        """Sample one token for each row of ``logits`` [B, V]; row i belongs to ``seqs[i]``.

        Never mutates ``logits``; never raises for bad values in a row (see ``failed``).
        """
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(
                f"logits must be [len(seqs)={len(seqs)}, vocab], got {tuple(logits.shape)}"
            )
        num_rows = logits.shape[0]
        if num_rows == 0:
            return SampleResult(token_ids=[], logprobs=[])
        if logits.dtype != torch.float32:
            logits = logits.float()

        row_max, argmax = logits.max(dim=1)  # max propagates NaN: one pass finds bad rows
        bad = ~torch.isfinite(row_max)

        params = [s.sampling for s in seqs]
        sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        rep_rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
        freq_rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
        min_tokens_rows = [
            i for i, s in enumerate(seqs) if s.num_output_tokens < s.sampling.min_tokens
        ]
        want_logprobs = any(p.logprobs is not None for p in params)
        processed_logprobs = want_logprobs and self.logprobs_mode == "processed"

        if sampled_rows or rep_rows or freq_rows or min_tokens_rows or processed_logprobs:
            failed = self._failed_rows(logits, bad.nonzero().flatten().tolist(), seqs)
            processed = logits.clone()
            if failed:
                processed[bad] = 0.0  # keep NaN out of shared ops; these rows are ignored
            if min_tokens_rows:
                _mask_stop_tokens(processed, seqs, min_tokens_rows)
            if rep_rows:
                _apply_repetition_penalty(processed, seqs, rep_rows)
            if freq_rows:
                _apply_presence_frequency(processed, seqs, freq_rows)
            tokens = processed.argmax(dim=1)
            if sampled_rows:
                self._sample_rows(processed, tokens, seqs, sampled_rows, processed_logprobs)
            token_list: list[int] = tokens.tolist()
        else:
            # Fast path (all greedy, nothing to mask): the argmax from the NaN check, and ONE
            # device-to-host copy for the tokens and the bad-row flags together (on a GPU
            # each copy is a synchronization: one per step).
            tokens = argmax
            processed = logits
            token_list, bad_flags = torch.stack((argmax, bad.to(argmax.dtype))).tolist()
            failed = self._failed_rows(logits, [i for i, b in enumerate(bad_flags) if b], seqs)
        for request_id in failed:
            for i, s in enumerate(seqs):
                if s.request_id == request_id:
                    token_list[i] = 0
        logprobs: list[TokenLogprobs | None] = [None] * num_rows
        if want_logprobs:
            source = processed if processed_logprobs else logits
            logprobs = _logprobs(source, tokens, seqs, failed)
        return SampleResult(token_ids=token_list, logprobs=logprobs, failed=failed)

    # ------------------------------------------------------------------ drawing

    def _sample_rows(
        self,
        processed: torch.Tensor,
        tokens: torch.Tensor,
        seqs: Sequence[ScheduledSeq],
        rows: list[int],
        write_back: bool,
    ) -> None:
        """Writes the sampled tokens of ``rows`` into ``tokens``. With ``write_back`` the
        temperature-scaled logits go back into ``processed`` (for processed logprobs)."""
        device = processed.device
        num_rows, vocab_size = processed.shape
        index = torch.tensor(rows, device=device)
        params = [seqs[i].sampling for i in rows]
        temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
        if len(rows) == num_rows:
            # Greedy argmaxes are taken already; scale our own copy in place.
            x = processed.div_(temperature)
        else:
            x = processed.index_select(0, index).div_(temperature)
            if write_back:
                processed.index_copy_(0, index, x)
        u = self._uniforms([seqs[i] for i in rows], device)

        num_candidates = min(self.num_candidates, vocab_size)
        local = [
            j
            for j, p in enumerate(params)
            if _truncates(p, vocab_size) and (p.top_k is None or p.top_k <= num_candidates)
        ]
        full = sorted(set(range(len(rows))) - set(local))
        drawn = torch.empty(len(rows), dtype=torch.long, device=device)
        if local:
            at = torch.tensor(local, device=device)
            picked, covered = _draw_from_candidates(
                _take_rows(x, local, at), [params[j] for j in local], u[at], num_candidates
            )
            drawn.index_copy_(0, at, picked)
            full += [j for j, ok in zip(local, covered.tolist(), strict=True) if not ok]
        if full:
            full.sort()
            at = torch.tensor(full, device=device)
            picked = _draw_full(_take_rows(x, full, at), [params[j] for j in full], u[at])
            drawn.index_copy_(0, at, picked)
        tokens.index_copy_(0, index, drawn)

    def _uniforms(self, seqs: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
        """U[0, 1) float64 per row: the shared generator, or the row's own seeded one."""
        u = torch.rand(len(seqs), dtype=torch.float64, generator=self._generator(device))
        for j, s in enumerate(seqs):
            if s.sampling.seed is not None:
                g = torch.Generator()
                g.manual_seed(mix_seed(s.sampling.seed, s.num_output_tokens))
                u[j] = torch.rand((), dtype=torch.float64, generator=g)
        return u.to(device)

    def _generator(self, device: torch.device) -> torch.Generator:
        # The uniforms are drawn on the CPU (a handful of numbers) and moved to the device,
        # so seeded draws are the same on every device.
        del device
        key = torch.device("cpu")
        g = self._generators.get(key)
        if g is None:
            g = torch.Generator()
            if self._seed is not None:
                g.manual_seed(self._seed)
            else:
                g.seed()
            self._generators[key] = g
        return g

    # ------------------------------------------------------------------ failures

    @staticmethod
    def _failed_rows(
        logits: torch.Tensor, bad_rows: list[int], seqs: Sequence[ScheduledSeq]
    ) -> dict[str, str]:
        failed: dict[str, str] = {}
        for i in bad_rows:
            row = logits[i]
            num_nan = int(torch.isnan(row).sum())
            num_posinf = int(torch.isposinf(row).sum())
            if num_nan or num_posinf:
                what = f"{num_nan} NaN and {num_posinf} +inf values"
            else:
                what = "only -inf values"
            failed[seqs[i].request_id] = (
                f"model produced invalid logits ({what} in a vocabulary of {row.numel()}) "
                f"at output token {seqs[i].num_output_tokens}"
            )
        return failed


# ---------------------------------------------------------------------- masks, penalties


def _mask_stop_tokens(logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]) -> None:
    """min_tokens: EOS (unless ignore_eos) and stop_token_ids cannot be sampled yet."""
    vocab_size = logits.shape[1]
    row_idx: list[int] = []
    col_idx: list[int] = []
    for i in rows:
        s = seqs[i]
        ids = set(s.sampling.stop_token_ids)
        if not s.sampling.ignore_eos:
            ids.update(s.eos_token_ids)
        for t in ids:
            if t < vocab_size:
                row_idx.append(i)
                col_idx.append(t)
    if row_idx:
        device = logits.device
        logits[torch.tensor(row_idx, device=device), torch.tensor(col_idx, device=device)] = (
            _NEG_INF
        )


def _pairs(
    token_lists: list[Sequence[int]], rows: list[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) for every token of every list: O(total tokens), no [R, V] mask."""
    lengths = torch.tensor([len(t) for t in token_lists])
    cols = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row_idx = torch.repeat_interleave(torch.tensor(rows), lengths)
    return row_idx.to(device), cols.to(device)


def _apply_repetition_penalty(
    logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]
) -> None:
    """HF semantics over prompt + output tokens: a seen token's logit is divided by the
    penalty when positive, multiplied when negative (each seen token once)."""
    row_idx, cols = _pairs([seqs[i].all_token_ids for i in rows], rows, logits.device)
    if cols.numel() == 0:
        return
    penalty = torch.tensor(
        [seqs[i].sampling.repetition_penalty for i in range(len(seqs))], device=logits.device
    )[row_idx]
    values = logits[row_idx, cols]
    # Repeated (row, token) pairs write the same value: penalised once.
    logits[row_idx, cols] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_presence_frequency(
    logits: torch.Tensor, seqs: Sequence[ScheduledSeq], rows: list[int]
) -> None:
    """OpenAI semantics over output tokens:
    ``logit -= frequency * count + presence * (count > 0)``."""
    outputs = [seqs[i].all_token_ids[seqs[i].num_prompt_tokens :] for i in rows]
    row_idx, cols = _pairs(outputs, rows, logits.device)
    if cols.numel() == 0:
        return
    device = logits.device
    freq = torch.tensor([s.sampling.frequency_penalty for s in seqs], device=device)[row_idx]
    presence = torch.tensor([s.sampling.presence_penalty for s in seqs], device=device)[row_idx]
    logits.index_put_((row_idx, cols), -freq, accumulate=True)  # once per occurrence
    logits[row_idx, cols] = logits[row_idx, cols] - presence  # repeated pairs: same value


# ---------------------------------------------------------------------- truncation + draw


def _take_rows(x: torch.Tensor, rows: list[int], index: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` without a copy when ``rows`` is every row in order."""
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, index)


def _truncates(p: SamplingParams, vocab_size: int) -> bool:
    return (p.top_k is not None and p.top_k < vocab_size) or p.top_p < 1.0 or p.min_p > 0.0


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Per row, the position of the first cumulative weight above ``u * total``.

    Two levels, so no [S, V] float64 copy or full-length cumulative sum: float64 sums of
    ``chunk``-wide slices pick the slice, then a float64 cumulative sum inside that one slice
    picks the position. A zero weight never wins: its cumulative value equals the one before,
    which is not above the target either, and targets stay strictly below each level's total.
    """
    num_rows, width = weights.shape
    pad = -width % chunk
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    chunks = weights.view(num_rows, -1, chunk)
    chunk_cdf = chunks.sum(dim=2, dtype=torch.float64).cumsum(dim=1)
    total = chunk_cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    which = torch.searchsorted(chunk_cdf, target.unsqueeze(1), right=True).squeeze(1)
    which = which.clamp_(max=chunk_cdf.shape[1] - 1)
    before = torch.where(
        which > 0, chunk_cdf.gather(1, (which - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0
    )
    rows = torch.arange(num_rows, device=weights.device)
    inner_cdf = chunks[rows, which].double().cumsum(dim=1)
    inner_total = inner_cdf[:, -1]
    residual = torch.minimum(
        target - before, torch.nextafter(inner_total, torch.zeros_like(inner_total))
    )
    pos = torch.searchsorted(inner_cdf, residual.unsqueeze(1), right=True).squeeze(1)
    return (which * chunk + pos.clamp_(max=chunk - 1)).clamp_(max=width - 1)


def _draw_from_candidates(
    x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate and draw within each row's ``num_candidates`` largest logits.

    Returns the tokens and, per row, whether the truncation provably removed every token
    outside the candidates (else the caller redraws that row on the full vocabulary).
    """
    num_rows, vocab_size = x.shape
    device = x.device
    lse = torch.logsumexp(x, dim=1, keepdim=True)
    values, ids = x.topk(num_candidates, dim=1)  # sorted, descending
    probs = (values - lse).exp()  # probabilities under the whole (untruncated) row
    keep = torch.ones_like(probs, dtype=torch.bool)
    covered = torch.full((num_rows,), num_candidates == vocab_size, device=device)

    has_top_k = torch.tensor([p.top_k is not None for p in params], device=device)
    k = torch.tensor(
        [min(p.top_k, num_candidates) if p.top_k is not None else num_candidates for p in params],
        device=device,
    ).unsqueeze(1)
    kth = values.gather(1, k - 1)
    keep &= values >= kth  # ties with the k-th value all stay
    covered |= has_top_k & (values[:, -1] < kth.squeeze(1))

    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device
    ).unsqueeze(1)
    kept = probs * keep
    # Mass the top-p cut is relative to: the top-k survivors, or the whole row (1).
    norm = torch.where(has_top_k.unsqueeze(1), kept.sum(dim=1, keepdim=True), 1.0)
    before = kept.cumsum(dim=1) - kept
    cut = before >= top_p * norm
    cut[:, 0] = False
    keep &= ~cut
    covered |= cut[:, -1]

    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    threshold = probs[:, :1] * min_p
    keep &= probs >= threshold
    covered |= probs[:, -1] < threshold.squeeze(1)

    pos = _inverse_cdf(probs * keep, u)
    return ids.gather(1, pos.unsqueeze(1)).squeeze(1), covered


def _draw_full(x: torch.Tensor, params: list[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """Truncate (sorting only for top-p) and draw over the whole vocabulary."""
    vocab_size = x.shape[1]
    device = x.device
    top_ks = [min(p.top_k, vocab_size) if p.top_k is not None else vocab_size for p in params]
    use_top_k = any(k < vocab_size for k in top_ks)
    use_top_p = any(p.top_p < 1.0 for p in params)

    if use_top_p:
        sorted_x, order = x.sort(dim=1, descending=True)
        remove = torch.zeros_like(sorted_x, dtype=torch.bool)
        if use_top_k:
            kth = sorted_x.gather(1, torch.tensor(top_ks, device=device).unsqueeze(1) - 1)
            remove |= sorted_x < kth  # ties with the k-th value all stay
            sorted_x = sorted_x.masked_fill(remove, _NEG_INF)
        probs = sorted_x.softmax(dim=1)
        top_p = torch.tensor(
            [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device
        ).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before
        # it already does. The top token always stays.
        cut = probs.cumsum(dim=1) - probs >= top_p
        cut[:, 0] = False
        remove |= cut
        x = x.masked_fill(torch.zeros_like(remove).scatter_(1, order, remove), _NEG_INF)
    elif use_top_k:
        k = torch.tensor(top_ks, device=device).unsqueeze(1)
        kth = x.topk(max(top_ks), dim=1).values.gather(1, k - 1)
        x = x.masked_fill(x < kth, _NEG_INF)

    probs = x.softmax(dim=1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = probs.masked_fill(probs < probs.max(dim=1, keepdim=True).values * min_p, 0.0)
    return _inverse_cdf(probs, u)


# ---------------------------------------------------------------------- logprobs


def _logprobs(
    source: torch.Tensor,
    tokens: torch.Tensor,
    seqs: Sequence[ScheduledSeq],
    failed: dict[str, str],
) -> list[TokenLogprobs | None]:
    rows = [
        i
        for i, s in enumerate(seqs)
        if s.sampling.logprobs is not None and s.request_id not in failed
    ]
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    if not rows:
        return out
    index = torch.tensor(rows, device=source.device)
    logprobs = source.index_select(0, index).log_softmax(dim=1)
    chosen = tokens.index_select(0, index)
    chosen_lp: list[float] = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    chosen_ids: list[int] = chosen.tolist()
    max_n = max(seqs[i].sampling.logprobs or 0 for i in rows)
    top_lp: list[list[float]] = []
    top_ids: list[list[int]] = []
    if max_n > 0:
        top = logprobs.topk(max_n, dim=1)
        top_lp = top.values.tolist()
        top_ids = top.indices.tolist()
    for j, i in enumerate(rows):
        n = seqs[i].sampling.logprobs or 0
        alternatives = tuple(zip(top_ids[j][:n], top_lp[j][:n], strict=True)) if n else ()
        out[i] = TokenLogprobs(token_id=chosen_ids[j], logprob=chosen_lp[j], top=alternatives)
    return out
