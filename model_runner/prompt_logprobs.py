"""Prompt logprobs: the prefill rows a plan scores (``ScheduledSeq.num_prompt_logprobs``),
their log-softmax, and the logprob of the prompt token after each with the top n.

Only the scored rows go through the LM head here, a bounded number at a time, so a step's
other rows never have the full vocabulary's logits materialised (the sampler still sees
only its own rows). The logprobs are the model's raw distribution (no temperature,
penalties or masks), as vLLM's prompt logprobs are::

    rows   | chunk a: p .. p+T-1 | chunk b | decodes |
    scored | p .. p+n-1 |                           n = a.num_prompt_logprobs
    target | prompt[p+1] .. prompt[p+n] |
"""

from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

import torch

from model_runner.sampling_ops import to_device
from model_runner.step import StepRows
from scheduler.output import TokenLogprobs

# Rows through the LM head at once: bounds the fp32 logits to ROWS x vocab.
_ROWS_PER_PIECE = 256


@dataclass(slots=True)
class PromptScores:
    """One step's prompt scores on the device, until ``to_host`` reads them: per scored row
    the target's logprob and rank [N], the top n logprobs and ids [N, n] (n = the largest
    asked)."""

    request_ids: list[str]  # per scored seq, in row order
    counts: list[int]  # scored rows of each
    top_ns: list[int]  # top n each asked for
    target_logprobs: torch.Tensor
    target_ranks: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor
    target_ids: list[int]

    def to_host(self, skip: Container[str]) -> dict[str, list[TokenLogprobs]]:
        """The scores per request (those in ``skip`` left out), one per scored row."""
        target_lp: list[float] = self.target_logprobs.tolist()
        ranks: list[int] = self.target_ranks.tolist()
        top_lp: list[list[float]] = self.top_logprobs.tolist()
        top_ids: list[list[int]] = self.top_ids.tolist()
        out: dict[str, list[TokenLogprobs]] = {}
        row = 0
        for rid, count, top_n in zip(self.request_ids, self.counts, self.top_ns, strict=True):
            if rid not in skip:
                out[rid] = [
                    TokenLogprobs(
                        self.target_ids[r],
                        target_lp[r],
                        tuple(zip(top_ids[r][:top_n], top_lp[r][:top_n], strict=True)),
                        ranks[r],
                    )
                    for r in range(row, row + count)
                ]
            row += count
        return out


def scored_rows(rows: StepRows) -> tuple[list[int], list[int]]:
    """The rows of ``rows`` to score and the prompt token each scores, in row order."""
    row_ids: list[int] = []
    target_ids: list[int] = []
    row = 0
    for seq in rows.prefill:
        n = seq.num_prompt_logprobs
        if n:
            row_ids.extend(range(row, row + n))
            target_ids.extend(seq.all_token_ids[seq.start_pos + 1 : seq.start_pos + 1 + n])
        row += seq.num_tokens
    return row_ids, target_ids


def score_prompts(
    rows: StepRows, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> PromptScores | None:
    """Score the rows ``rows`` asks for, from ``hidden`` [rows, hidden] (before the final
    norm); ``compute_logits`` is the model's final norm + LM head. None when none asks."""
    row_ids, target_ids = scored_rows(rows)
    if not row_ids:
        return None
    seqs = [s for s in rows.prefill if s.num_prompt_logprobs]
    top_ns = [s.sampling.prompt_logprobs or 0 for s in seqs]
    max_top = max(top_ns)
    device = hidden.device
    index = to_device(row_ids, torch.int64, device)
    targets = to_device(target_ids, torch.int64, device)
    target_lp: list[torch.Tensor] = []
    ranks: list[torch.Tensor] = []
    top_lp: list[torch.Tensor] = []
    top_ids: list[torch.Tensor] = []
    for start in range(0, len(row_ids), _ROWS_PER_PIECE):
        piece = slice(start, start + _ROWS_PER_PIECE)
        logprobs = compute_logits(hidden.index_select(0, index[piece])).log_softmax(dim=-1)
        chosen = logprobs.gather(1, targets[piece].unsqueeze(1))
        target_lp.append(chosen.squeeze(1))
        ranks.append((logprobs > chosen).sum(dim=1) + 1)
        top = logprobs.topk(max_top, dim=1)
        top_lp.append(top.values)
        top_ids.append(top.indices)
    return PromptScores(
        [s.request_id for s in seqs],
        [s.num_prompt_logprobs for s in seqs],
        top_ns,
        torch.cat(target_lp),
        torch.cat(ranks),
        torch.cat(top_lp),
        torch.cat(top_ids),
        target_ids,
    )
