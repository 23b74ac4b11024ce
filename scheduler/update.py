"""A step's result applied to its requests: the per-token half of the scheduler.

``Scheduler.update`` hands each batch of its plan, with the runner's ``ModelOutput``, to
``ResultApplier.apply``: progress advances to the chunk's end (newly full blocks get their
prefix-cache key, blocks behind a sliding window are released), the sampled token is
appended and checked for a stop, and the request's output is made. A request that ends goes
through the scheduler's ``finish`` (the one place that frees blocks); a parent of n > 1
samples forks through its ``fork``. A decode with drafts appends the accepted ones and the
token sampled after them, and ``kv.rollback_slots`` drops the KV of the rejected ones::

    | computed ........ | last | draft 0 | draft 1 | draft 2 |     scheduled: 1 + k tokens
    | computed ...................... | accepted | rejected  |     + the sampled token
                                      ^ num_computed_tokens: slots past it are rolled back
"""

from __future__ import annotations

from collections.abc import Callable

from cache_manager import KVCacheManager
from scheduler.entry import Counters, Entry, make_output
from scheduler.output import ModelOutput, RequestOutput, ScheduledSeq, TokenLogprobs
from scheduler.request import Request, RequestStatus, stop_status
from scheduler.spec import append_verified

_PREFILLING = RequestStatus.PREFILLING
_DECODING = RequestStatus.DECODING
_FINISHED_ERROR = RequestStatus.FINISHED_ERROR


# ``Scheduler._finish(entry, status, new_token_ids, new_logprobs, error)``: end a request
# (freeing its blocks once) and return its final output.
Finish = Callable[
    [Entry, RequestStatus, list[int] | None, list[TokenLogprobs] | None, str | None],
    RequestOutput,
]


class ResultApplier:
    """Applies steps' results to the scheduler's ``running`` requests (the scheduler's own
    dict and counters, shared); ``finish`` and ``fork_children`` are the scheduler's."""

    def __init__(
        self,
        running: dict[str, Entry],
        kv: KVCacheManager,
        counters: Counters,
        finish: Finish,
        fork_children: Callable[[Entry], None],
    ) -> None:
        self._running = running
        self.kv = kv
        self._block_size = kv.block_size
        self._releases = kv.releases_out_of_window
        self._counters = counters
        self._finish = finish
        self._fork_children = fork_children

    def apply(
        self,
        batch: list[ScheduledSeq],
        result: ModelOutput,
        outputs: list[RequestOutput],
        *,
        prefill: bool,
    ) -> None:
        """Apply one batch's result. The per-token hot path: 1,024 decodes a step must cost
        well under a millisecond here, so what a plain decode never needs is branched off
        under ``slow``: prefill chunks (a middle one samples nothing, the one that reaches
        the fork forks; a sampling one turns the request DECODING), failures, a sliding
        window, logprobs, prompt logprobs. The end of a request branches off at its token."""
        running = self._running
        block_size = self._block_size
        kv = self.kv
        window = self._releases
        drop = not kv.strategy.always_retains  # the strategy may drop KV after a token
        sampled = result.sampled_token_ids
        failed = result.failed
        logprobs = result.logprobs
        slow = prefill or window or bool(failed) or bool(logprobs) or drop
        append = outputs.append
        num_outputs_before = len(outputs)
        num_uncounted = 0  # outputs not of one generated token: failures, verified drafts
        for seq in batch:
            rid = seq.request_id
            try:  # dict lookups in try: no method call per token
                entry = running[rid]
            except KeyError:  # ended (aborted, failed) after it was planned
                continue
            if not entry.take_applied(seq):
                continue  # planned before a preemption or a KV drop reset it: stale
            req = entry.request
            if seq.num_draft_tokens:
                append(self._apply_verified(entry, seq, result))
                num_uncounted += 1
                continue
            # The chunk's end; a decode is one token.
            num_computed = seq.start_pos + (len(seq.token_ids) if prefill else 1)
            req.num_computed_tokens = num_computed
            if slow and rid in failed:
                append(self._finish(entry, _FINISHED_ERROR, None, None, failed[rid]))
                num_uncounted += 1
                continue
            new_logprobs: list[TokenLogprobs] = []
            if slow:
                self._after_tokens(req, seq.start_pos)
                if seq.num_prompt_logprobs:
                    scored = result.prompt_logprobs.get(rid, [])
                    entry.keep_prompt_logprobs(seq.start_pos, scored)
                if not seq.do_sample:
                    if entry.group is not None and num_computed == entry.prefill_target:
                        self._fork_children(entry)
                    continue
                req.status = _DECODING
                if rid in logprobs:
                    new_logprobs.append(logprobs[rid])
            elif num_computed // block_size > seq.start_pos // block_size:
                kv.cache_full_blocks(req)  # _after_tokens, inline on the hot path
            try:
                token = sampled[rid]
            except KeyError:
                raise _no_token(rid) from None
            req.append_output_token(token)
            # The guard keeps the full check off the usual token (num_computed is one short
            # of the tokens now: this chunk ended at the last one).
            if token in entry.stop_ids or num_computed >= entry.max_num_tokens - 1:
                status = stop_status(req, token, entry.max_num_tokens)
                if status is not None:
                    append(self._finish(entry, status, [token], new_logprobs, None))
                    if slow and entry.prompt_logprobs is not None:
                        outputs[-1].prompt_logprobs = _take_prompt_logprobs(entry)
                    continue
            append(make_output(entry, [token], new_logprobs, None))
            if slow and entry.prompt_logprobs is not None:
                outputs[-1].prompt_logprobs = _take_prompt_logprobs(entry)
            if drop and not kv.keeps_kv(req):
                self._recompute_next_step(entry)
        # Every output since the batch began carries one new token, but those uncounted.
        self._counters.num_generation_tokens += len(outputs) - num_outputs_before - num_uncounted

    def _apply_verified(
        self, entry: Entry, seq: ScheduledSeq, result: ModelOutput
    ) -> RequestOutput:
        """A decode with drafts: append the accepted drafts and the token sampled after them
        (each checked for a stop like any token), advance to the tokens whose KV is now
        computed, and roll back the KV slots of the rejected drafts."""
        req = entry.request
        rid = req.request_id
        if rid in result.failed:
            return self._finish(entry, _FINISHED_ERROR, None, None, result.failed[rid])
        num_drafts = seq.num_draft_tokens
        num_accepted = result.num_accepted_drafts.get(rid, 0)
        if not 0 <= num_accepted <= num_drafts:
            msg = f"runner accepted {num_accepted} of {num_drafts} drafts for {rid!r}"
            raise RuntimeError(msg)
        try:
            sampled = result.sampled_token_ids[rid]
        except KeyError:
            raise _no_token(rid) from None
        new_token_ids, status = append_verified(entry, seq, num_accepted, sampled)
        counters = self._counters
        counters.num_spec_draft_tokens += num_drafts
        counters.num_spec_accepted_tokens += num_accepted
        counters.num_generation_tokens += len(new_token_ids)
        # KV is computed for the scheduled token and the accepted drafts: every new token
        # but the last.
        req.num_computed_tokens = seq.start_pos + len(new_token_ids)
        if status is not None:
            return self._finish(entry, status, new_token_ids, None, None)
        kv = self.kv
        kv.rollback_slots(req)
        self._after_tokens(req, seq.start_pos)
        if not kv.strategy.always_retains and not kv.keeps_kv(req):
            self._recompute_next_step(entry)
        return make_output(entry, new_token_ids, [], None)

    def _recompute_next_step(self, entry: Entry) -> None:
        """The KV strategy keeps no KV for this request between steps: free its blocks now,
        and the next step prefills its whole sequence again (the full-recompute baseline)."""
        req = entry.request
        self.kv.drop_kv(req.request_id)
        entry.drop_pending()  # a step in flight computes for it in vain
        req.num_computed_tokens = 0
        req.status = _PREFILLING

    def _after_tokens(self, req: Request, start_pos: int) -> None:
        """KV upkeep once a step advanced ``req`` from ``start_pos``: newly full blocks get
        their prefix-cache key, and blocks the sliding window left behind are released."""
        if req.num_computed_tokens // self._block_size > start_pos // self._block_size:
            self.kv.cache_full_blocks(req)
        if self._releases:
            self.kv.release_out_of_window(req)


def _take_prompt_logprobs(entry: Entry) -> list[TokenLogprobs]:
    """The prompt's scores, for its first output; none are kept after (a recompute after a
    preemption scores nothing again)."""
    scored = entry.prompt_logprobs or []
    entry.prompt_logprobs = None
    return scored


def _no_token(request_id: str) -> RuntimeError:
    return RuntimeError(f"runner returned no token for {request_id!r}, which was to sample")
