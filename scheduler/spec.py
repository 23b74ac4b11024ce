"""Speculative decoding's drafter: n-gram (prompt-lookup) drafting. Pure Python, no model.

A request that repeats itself, or copies from its prompt (an edit, a quote, code), is
predictable from its own tokens: find the last ``n`` tokens earlier in the sequence, and
propose the tokens that followed them there::

    tokens:  ... a b c d e f ... x y | a b c            (last n = 3 tokens: "a b c")
                       ^^^^^ draft                        the earlier "a b c" was followed
                                                          by "d e f": draft [d, e, f, ...]

The longest suffix (``ngram_max`` down to ``ngram_min`` tokens) that occurs earlier wins;
among its occurrences, the most recent. The scheduler verifies the draft in one forward pass
(the request's last token plus the draft, k + 1 positions) and keeps the longest prefix the
model agrees with (``append_verified``); see ``Scheduler`` and
``ScheduledSeq.num_draft_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.entry import Entry
from scheduler.output import ScheduledSeq
from scheduler.request import RequestStatus, stop_status


class NgramDrafter:
    """Proposes up to ``num_speculative_tokens`` draft tokens from a request's own tokens.

    Stateless: ``propose`` reads the token list it is given. Cost is one scan of the tokens
    for the last token (at C speed, ``list.index``) plus a short comparison per occurrence.
    """

    __slots__ = ("ngram_max", "ngram_min", "num_speculative_tokens")

    def __init__(self, num_speculative_tokens: int, ngram_max: int, ngram_min: int = 1) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.num_speculative_tokens = num_speculative_tokens
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, token_ids: Sequence[int], max_num_tokens: int | None = None) -> list[int]:
        """The draft that follows the latest, longest earlier match of the last n tokens
        (``ngram_max >= n >= ngram_min``), at most ``max_num_tokens`` (default
        ``num_speculative_tokens``) tokens; empty when nothing matches."""
        limit = self.num_speculative_tokens
        if max_num_tokens is not None:
            limit = min(limit, max_num_tokens)
        num_tokens = len(token_ids)
        if limit < 1 or num_tokens < self.ngram_min + 1:
            return []
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        last = tokens[-1]
        max_n = min(self.ngram_max, num_tokens - 1)
        best_len = 0
        best_end = -1  # index of the match's last token
        end = -1
        index = tokens.index
        while True:
            # Occurrences of the last token, except the last token itself.
            try:
                end = index(last, end + 1, num_tokens - 1)
            except ValueError:
                break
            # Match length backwards from (end, num_tokens - 1), at most max_n.
            length = 1
            while length < max_n and end - length >= 0:
                if tokens[end - length] != tokens[num_tokens - 1 - length]:
                    break
                length += 1
            if length >= best_len:  # >=: the latest of equally long matches
                best_len = length
                best_end = end
        if best_len < self.ngram_min:
            return []
        return tokens[best_end + 1 : best_end + 1 + limit]


def append_verified(
    entry: Entry, seq: ScheduledSeq, num_accepted: int, sampled: int
) -> tuple[list[int], RequestStatus | None]:
    """Append to the request the first ``num_accepted`` drafts of its verified decode ``seq``
    and the token sampled after them, each checked for a stop like any token. Returns the
    tokens appended (up to the one that stopped it) and its finished status, or None."""
    req = entry.request
    new_token_ids: list[int] = []
    for token in [*seq.token_ids[1 : 1 + num_accepted], sampled]:
        req.append_output_token(token)
        new_token_ids.append(token)
        if token in entry.stop_ids or req.num_tokens >= entry.max_num_tokens:
            status = stop_status(req, token, entry.max_num_tokens)
            if status is not None:
                return new_token_ids, status
    return new_token_ids, None
