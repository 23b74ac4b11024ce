"""The tokens of the step in flight, where the model runs (SGLang's FutureMap, vLLM's
``prev_sampled_token_ids``): ``Placeholders``, the one owner of the placeholder token inside
a runner, and the device buffer it publishes into, ``FutureTokens``.

When the engine plans step N+1 while step N still runs, the token N samples for a request is
not known on the host: N+1 carries a placeholder for it (``PLACEHOLDER_TOKEN_ID``). The runner
asks ``Placeholders`` at every phase of a step::

    prepare N   advance(N's sampled seqs)      request -> j, its row among N's sampled rows
    prepare N+1 substitute(seq)                the placeholder becomes -(j + 1) in N+1's row
                history_id(seq)                the same id in the sampler's penalty history
    run N       publish(N's sampled ids)       row j's token at index j of ``FutureTokens``
    run N+1     resolve(ids)                   the embedding and the penalties read -(j + 1)
                                               as row j's token, on the device

``resolve`` runs in stream order (or worker order on a CPU step thread), so the host never
sees the token on the way. One buffer, overwritten by every step: N+1 reads N's ids before
N+1 itself publishes (both in the same stream), and a placeholder only ever names the step
just before (the engine plans at most one step ahead), so the buffer cannot wrap under a
reader. Its storage never moves, so a CUDA graph captured over ``resolve`` stays valid; a step
sampling more rows than it holds publishes the first ``capacity`` and ``substitute`` refuses
placeholders for the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from scheduler.output import ScheduledSeq


class FutureTokens:
    """A fixed device buffer of the last step's sampled token ids; see the module docstring."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.ids = torch.zeros(capacity, dtype=torch.int64, device=device)

    def publish(self, token_ids: torch.Tensor) -> None:
        """This step's sampled ids (row j at index j), for the step after it."""
        n = min(token_ids.shape[0], self.capacity)
        self.ids[:n].copy_(token_ids[:n], non_blocking=True)

    def resolve(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids`` with every ``-(j + 1)`` replaced by the published id of row j."""
        index = (-token_ids - 1).clamp_(0, self.capacity - 1)
        return torch.where(token_ids < 0, self.ids[index], token_ids)

    @staticmethod
    def encode(row: int) -> int:
        """The id that stands for row ``row`` of the previous step's sampled ids."""
        return -(row + 1)


class Placeholders:
    """The request -> row map of the step in flight and everything a runner does with a
    placeholder token (see the module docstring). One per runner; the host side runs on the
    thread that prepares steps, ``publish`` and ``resolve`` in the device's order."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        """``capacity``: the most sampled rows a step publishes (``FutureTokens``)."""
        self.future = FutureTokens(capacity, device)
        self._rows: dict[str, int] = {}  # request id -> row among the in-flight step's samples

    def substitute(self, seq: ScheduledSeq, is_decode: bool) -> tuple[ScheduledSeq, str | None]:
        """``seq`` as its rows run, and why it cannot (or None): a placeholder token becomes
        the id of its request's row in the step in flight. A seq without one comes back as
        it is (the same object); its other tokens are ``StepLimits``' to check."""
        if not seq.has_placeholder:
            return seq, None
        if not is_decode or len(seq.token_ids) != 1:
            return seq, "a placeholder token outside a one-token decode"
        row = self._rows.get(seq.request_id)
        if row is None:
            return seq, "a placeholder token, but the step before sampled none for it"
        return dataclasses.replace(seq, token_ids=[FutureTokens.encode(row)]), None

    @staticmethod
    def history_id(seq: ScheduledSeq) -> int | None:
        """The id that stands for ``seq``'s input token in its penalty history when that
        token is in flight (``seq`` as ``substitute`` gave it), else None."""
        return seq.token_ids[-1] if seq.has_placeholder else None

    def advance(self, sampled: Sequence[ScheduledSeq] | None) -> bool:
        """The step just prepared is the one in flight now: the next step's placeholders
        name its sampled rows (``sampled``, one per seq; the first ``capacity``), or none
        (None: a step that computes nothing, or whose seqs sample several rows each, drafts,
        publishes nothing). Whether it publishes."""
        if sampled is None:
            self._rows = {}
            return False
        num = min(len(sampled), self.future.capacity)
        self._rows = {sampled[j].request_id: j for j in range(num)}
        return True

    def publish(self, token_ids: torch.Tensor) -> None:
        """The sampled ids of a step ``advance`` said publishes, row j at index j."""
        self.future.publish(token_ids)

    def resolve(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``token_ids`` with every substituted placeholder replaced by its token."""
        return self.future.resolve(token_ids)
