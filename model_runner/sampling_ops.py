"""The sampler's tensor operations: every one runs where the logits live, reads only tensors and
fixed shapes, and never waits for the device.

Nothing here calls ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero``, boolean-mask indexing,
``torch.multinomial`` or a per-request ``torch.Generator``: each of those makes the host wait
for the GPU (or, for the generators, forces a loop over rows). Data the host knows before the
step (which rows sample, their parameters, their uniforms, the (row, token) pairs of the
penalties) arrives as small tensors; everything that depends on the logits stays on the device.

- ``inverse_cdf``: the draw. One uniform per row (the host derives it from the request's seed
  and output position, so a seeded row draws the same whatever its batch); the token is the
  first whose cumulative weight exceeds ``u * total``. O(V) per row, no sort, no random number
  per vocabulary entry.
- ``top_p_keep``: top-p without a sort. The kept set is every token whose strictly larger
  tokens hold less than ``top_p`` of the mass. Its threshold is found by radix selection over
  the float bits (three passes of 2,048 bins), exactly, in O(V) per row; ties at the cut stay.
- ``top_k_keep``: ``topk`` of the largest ``top_k`` in the batch (a number the host knows), each
  row keeping the values at or above its own k-th (ties at the k-th stay).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")

# Radix selection over 32-bit keys: the digit widths, most significant first.
_RADIX_BITS = (11, 11, 10)


def to_device(
    values: list[int] | list[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``values`` as a tensor on ``device`` without making the host wait: on CUDA through
    fresh pinned memory and a non-blocking copy (an unpinned ``.to(cuda)`` synchronises; a
    pinned buffer reused while its copy is pending would race)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor if device.type == "cpu" else tensor.to(device)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit whose bit in ``bitmask`` [R, ceil(V / 32)] int32 is
    clear (bit ``t % 32`` of word ``t // 32`` for token ``t``; ``model_runner.constraints``).
    Columns past the mask's ``32 * words`` are cleared too. A host ``bitmask`` is moved as
    its packed words (pinned, non-blocking) and expanded on the logits' device."""
    num_rows, vocab_size = logits.shape
    if bitmask.device != logits.device:
        if logits.device.type == "cuda":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        else:
            bitmask = bitmask.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(num_rows, -1)
    if allowed.shape[1] < vocab_size:
        logits[:, allowed.shape[1] :] = NEG_INF
        vocab_size = allowed.shape[1]
    logits[:, :vocab_size].masked_fill_(~allowed[:, :vocab_size], NEG_INF)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, chunk: int = 256) -> torch.Tensor:
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


def top_k_keep(x: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Rows keep their ``top_k`` largest values, ties with the k-th included. ``top_k`` [S]
    int64 in 1..``max_k``; a row with ``top_k == x.shape[1]`` keeps everything."""
    kth = x.topk(max_k, dim=1).values.gather(1, (top_k - 1).unsqueeze(1))
    return x >= kth


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) that order like the float32 values of ``x`` (the radix-sort
    mapping: negative floats flipped, positive ones above them; -0 sorts just below +0)."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 1 << 31, 0xFFFFFFFF - bits, bits + (1 << 31))


def top_p_keep(x: torch.Tensor, weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p (nucleus) over ``weights`` [P, V] (a row's probabilities, zero for what an earlier
    stage removed), ordered by ``x`` (the logits they come from): a token stays when the
    tokens strictly above it hold less than ``top_p`` of the row's weight. So the most likely
    token always stays, the smallest set reaching ``top_p`` is kept, and tokens tied with the
    last one kept all stay.

    Sort-free: the smallest key k with ``weight(keys > k) < top_p * total`` is found digit by
    digit (``_RADIX_BITS``), each pass summing the weights of the keys left in play into bins.
    For a digit d of the current prefix, ``S(d)`` is the weight above the prefix plus the
    weight in the bins above d; the threshold lies in the lowest bin with ``S(d) < target``
    (every key below that bin's range has at least ``S`` above it).
    """
    keys = ordered_keys(x)
    w = weights.double()
    target = top_p.double() * w.sum(dim=1)
    num_rows = x.shape[0]
    prefix = torch.zeros(num_rows, dtype=torch.int64, device=x.device)
    above = torch.zeros(num_rows, dtype=torch.float64, device=x.device)
    shift = 32
    for bits in _RADIX_BITS:
        shift -= bits
        width = 1 << bits
        digit = (keys >> shift) & (width - 1)
        in_play = (keys >> (shift + bits)) == prefix.unsqueeze(1)
        bins = torch.zeros(num_rows, width, dtype=torch.float64, device=x.device)
        bins.scatter_add_(1, digit, w * in_play)
        cdf = bins.cumsum(dim=1)
        total = cdf[:, -1]
        # S(d) = above + total - cdf(d) < target  <=>  cdf(d) > above + total - target.
        bound = (above + total - target).unsqueeze(1)
        d = torch.searchsorted(cdf, bound, right=True).squeeze(1).clamp_(max=width - 1)
        above = above + total - cdf.gather(1, d.unsqueeze(1)).squeeze(1)
        prefix = (prefix << bits) | d
    return keys >= prefix.unsqueeze(1)


def penalise_repetition(
    logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, penalty: torch.Tensor
) -> None:
    """HF semantics: a seen token's logit is divided by its row's ``penalty`` when positive,
    multiplied when negative, once however often it was seen (repeated (row, token) pairs
    write the same value)."""
    values = logits[rows, cols]
    factor = penalty[rows]
    logits[rows, cols] = torch.where(values > 0, values / factor, values * factor)


def penalise_presence_frequency(
    logits: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """OpenAI semantics over output tokens: ``logit -= frequency * count + presence *
    (count > 0)``; one (row, token) pair per occurrence."""
    logits.index_put_((rows, cols), -frequency[rows], accumulate=True)  # once per occurrence
    logits[rows, cols] = logits[rows, cols] - presence[rows]  # repeated pairs: same value
