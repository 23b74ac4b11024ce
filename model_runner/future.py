"""The previous step's sampled token ids, kept where the model runs (SGLang's FutureMap, vLLM's
``prev_sampled_token_ids``).

When the engine plans step N+1 while step N still runs, the token N samples for a request is
not known on the host: N+1 carries a placeholder for it (``PLACEHOLDER_TOKEN_ID``). The runner
writes it as ``-(j + 1)``, j being the request's row among N's sampled rows; N ends by
``publish``-ing its sampled ids here, and N+1's embedding ``resolve``-s every negative id from
this buffer, on the device, in stream order (or worker order on a CPU step thread). The host
never sees the token on the way.

One buffer, overwritten by every step: N+1 reads N's ids before N+1 itself publishes (both in
the same stream), and a placeholder only ever names the step just before (the engine plans at
most one step ahead), so the buffer cannot wrap under a reader. Its storage never moves, so a
CUDA graph captured over ``resolve`` stays valid; a step sampling more rows than it holds
publishes the first ``capacity`` and the runner refuses placeholders for the rest.
"""

from __future__ import annotations

import torch


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
