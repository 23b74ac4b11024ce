"""Admission checks: whether a request can ever run, whether the waiting queue has room, and
how an admission may use the prefix cache.

Pure functions of the request, the scheduler's config and the cache manager's geometry;
``Scheduler.add_request`` raises what they raise (``ValueError``: never, with the numbers;
``OverloadError``: not now, retry later). ``Scheduler._try_admit`` asks ``may_fit`` and
``max_hit_tokens`` before it looks up a prompt's prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.entry import Entry
from scheduler.errors import OverloadError
from scheduler.fork import ForkGroup
from scheduler.queue import WaitingQueue
from scheduler.request import Request


def check_can_ever_run(
    request: Request,
    config: SchedulerConfig,
    kv: KVCacheManager,
    id_in_use: Callable[[str], bool],
) -> ForkGroup | None:
    """Raise ``ValueError`` when ``request`` can never run: an empty prompt, prompt +
    max_tokens beyond max_model_len or beyond the whole KV pool, n beyond the seats or a
    sample id in use. Returns its fork group (n > 1) or None."""
    rid = request.request_id
    sampling = request.sampling
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise ValueError(f"request {rid!r} has an empty prompt")
    max_model_len = config.max_model_len  # the scheduler's one check of the limit
    num_total = num_prompt + sampling.max_tokens
    if num_prompt > max_model_len or (num_total > max_model_len and not kv.streams_past_context):
        raise ValueError(
            f"request {rid!r}: prompt ({num_prompt} tokens) + max_tokens "
            f"({sampling.max_tokens}) = {num_total} tokens exceeds max_model_len "
            f"({max_model_len})"
        )
    n = sampling.n
    if n > 1 and config.memory_mode == "reserve":
        raise ValueError(f"request {rid!r}: n={n} > 1 is not supported in reserve memory mode")
    if n > config.max_num_seqs:
        raise ValueError(
            f"request {rid!r}: n={n} samples exceed max_num_seqs ({config.max_num_seqs})"
        )
    num_blocks = max_blocks_needed(config, kv, num_prompt, num_total, n)
    usable = kv.num_usable_blocks
    if num_blocks > usable:
        raise ValueError(
            f"request {rid!r}: {num_total} tokens x {n} sample(s) need {num_blocks} KV "
            f"blocks of {kv.block_size} tokens, but the whole pool has {usable}"
        )
    group = ForkGroup.of(request)
    for cid in () if group is None else group.child_ids:
        if id_in_use(cid):
            raise ValueError(f"request {rid!r}: the id of its sample {cid!r} is in use")
    return group


def max_blocks_needed(
    config: SchedulerConfig, kv: KVCacheManager, num_prompt: int, num_total: int, n: int
) -> int:
    """Blocks a request holds at its longest: n samples share the prompt's full blocks."""
    if kv.sliding_window is not None and config.memory_mode != "reserve":
        # Only the window (plus the chunk being written) stays resident; reserve mode
        # reserves every block.
        return n * kv.max_resident_blocks(num_total, config.max_chunk_tokens)
    # Samples fork at num_prompt - 1: a last prompt block still partial then is copied.
    shared = (num_prompt - 1) // kv.block_size if n > 1 else 0
    return shared + n * (kv.num_blocks_for(num_total) - shared)


def check_not_overloaded(
    config: SchedulerConfig, waiting: WaitingQueue[Any], request: Request
) -> None:
    """Raise ``OverloadError`` when queueing ``request`` would pass the waiting queue's
    bounds (requests or prompt tokens), overall or its tenant's."""
    if waiting.num_requests + 1 > config.max_waiting_requests:
        raise OverloadError(
            f"waiting queue is full: {waiting.num_requests} requests waiting "
            f"(max_waiting_requests={config.max_waiting_requests})"
        )
    num_tokens = waiting.num_tokens + request.num_prompt_tokens
    if num_tokens > config.max_waiting_tokens:
        raise OverloadError(
            f"waiting queue is full: {waiting.num_tokens} prompt tokens waiting + "
            f"{request.num_prompt_tokens} new > max_waiting_tokens={config.max_waiting_tokens}"
        )
    if not request.tenant:
        return
    num_requests, num_tokens = waiting.tenant_counts(request.tenant)
    if num_requests + 1 > config.max_waiting_requests_per_tenant:
        raise OverloadError(
            f"this client's share of the waiting queue is full: {num_requests} of its requests "
            f"waiting (max_waiting_requests_per_tenant={config.max_waiting_requests_per_tenant})"
        )
    if num_tokens + request.num_prompt_tokens > config.max_waiting_tokens_per_tenant:
        raise OverloadError(
            f"this client's share of the waiting queue is full: {num_tokens} of its prompt "
            f"tokens waiting + {request.num_prompt_tokens} new > "
            f"max_waiting_tokens_per_tenant={config.max_waiting_tokens_per_tenant}"
        )


def max_hit_tokens(entry: Entry, kv: KVCacheManager, max_chunk: int, budget: int) -> int | None:
    """The longest prefix hit an admission may use (None: no limit): 0 while the prompt is
    to be scored (a cached prefix has no logits). Under a sliding window hit blocks are taken
    whole, even those the window left behind (released after admission): the hit must leave
    the hit + first chunk within the per-request window bound, or the pool may not hold it."""
    if entry.wants_prompt_logprobs:
        return 0
    if kv.sliding_window is None:
        return None
    bound = kv.max_resident_blocks(entry.prefill_target, max_chunk)
    if kv.num_blocks_for(entry.prefill_target) <= bound:
        return None
    return max(0, bound * kv.block_size - min(max_chunk, budget))


def may_fit(entry: Entry, kv: KVCacheManager, may_preempt: bool) -> bool:
    """Whether an admission attempt is worth a prefix lookup (hashing the prompt). Every
    admission needs at least one fresh block, and one that failed for memory cannot succeed
    before the free list grows: skip the lookup until then. ``may_preempt`` (priority order,
    not reserve mode): an attempt may preempt, so it is always made."""
    if may_preempt:
        return True
    num_free = kv.num_free_blocks
    blocked_at = entry.blocked_at_num_free
    return num_free > 0 and (blocked_at is None or num_free > blocked_at)
