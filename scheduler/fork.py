"""n > 1 in one home: the samples of a request, forked from it once its prompt is computed.

The request the client sent is sample 0. It is admitted with seats for all ``n`` samples and
prefilled up to its last prompt token; there the scheduler forks samples ``1 .. n-1``
(``ForkTable.fork``), which share its blocks (copy on write) and, like sample 0, each compute
the last prompt token and sample their own first token::

    sample 0:   | prompt[:-1], computed once | last prompt token | its outputs ...
    sample i:   | shared blocks              | last prompt token | its outputs ...

The parent's first output after the fork names the samples in ``forked_ids``, in index
order. Sample ids are made by ``sample_id`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.request import Request, RequestStatus


def sample_id(request_id: str, index: int) -> str:
    """The id of sample ``index`` of request ``request_id``: the only place it is written."""
    return f"{request_id}#{index}"


@dataclass(slots=True, eq=False)
class ForkGroup:
    """The fork state of one request with ``n > 1`` samples (held by sample 0)."""

    child_ids: tuple[str, ...]  # samples 1 .. n-1, in index order
    forked: bool = False
    holds_seats: bool = False  # running and not forked yet: seats kept for the children

    @classmethod
    def of(cls, request: Request) -> ForkGroup | None:
        """The group of a new request; None for ``n == 1``."""
        n = request.sampling.n
        if n == 1:
            return None
        return cls(tuple(sample_id(request.request_id, i) for i in range(1, n)))

    @property
    def num_unforked(self) -> int:
        """Samples still to fork: each needs a running seat at admission."""
        return 0 if self.forked else len(self.child_ids)


class ForkTable:
    """Every group's claims on the scheduler: the ids of samples not forked yet (no new
    request may take them) and the running seats held for them."""

    __slots__ = ("_reserved_ids", "num_held_seats")

    def __init__(self) -> None:
        self._reserved_ids: set[str] = set()
        self.num_held_seats = 0

    def is_reserved(self, request_id: str) -> bool:
        return request_id in self._reserved_ids

    def reserve(self, group: ForkGroup) -> None:
        """A request with samples was queued: its sample ids are taken."""
        self._reserved_ids.update(group.child_ids)

    def hold_seats(self, group: ForkGroup) -> None:
        """The parent was admitted: keep a running seat for each sample still to fork."""
        if not group.forked and not group.holds_seats:
            group.holds_seats = True
            self.num_held_seats += len(group.child_ids)

    def release_seats(self, group: ForkGroup) -> None:
        """The parent left the running set (preempted, finished) or forked."""
        if group.holds_seats:
            group.holds_seats = False
            self.num_held_seats -= len(group.child_ids)

    def fork(self, group: ForkGroup) -> None:
        """The samples now run as requests of their own: ids and seats are theirs."""
        self._reserved_ids.difference_update(group.child_ids)
        self.release_seats(group)
        group.forked = True

    def close(self, group: ForkGroup) -> None:
        """The parent ended: release what it still claims for samples never forked."""
        self.release_seats(group)
        if not group.forked:
            self._reserved_ids.difference_update(group.child_ids)


def make_sample(parent: Request, index: int, request_id: str) -> Request:
    """Sample ``index`` of ``parent``, forked where the parent stands: all of the prompt but
    the last token computed, decoding. A seeded parent gives sample i the seed + i."""
    sampling = parent.sampling
    seed = None if sampling.seed is None else sampling.seed + index
    child = Request(
        request_id=request_id,
        prompt_token_ids=parent.prompt_token_ids,
        sampling=replace(sampling, n=1, seed=seed),
        eos_token_ids=parent.eos_token_ids,
        priority=parent.priority,
        arrival_time_s=parent.arrival_time_s,
        cache_salt=parent.cache_salt,
        lora=parent.lora,
        tenant=parent.tenant,
        ttft_slo_s=parent.ttft_slo_s,
        itl_slo_s=parent.itl_slo_s,
        num_cached_tokens=parent.num_cached_tokens,
        parent_id=parent.request_id,
    )
    child.num_computed_tokens = parent.num_prompt_tokens - 1
    child.status = RequestStatus.DECODING
    return child
