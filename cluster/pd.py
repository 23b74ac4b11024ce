"""Prefill and decode on separate replicas, through the KV tier 2 they share.

    client -> decode replica (the application's ingress; the router picks it)
                 | its prompt is not in its RAM: PrefillHandoff.before(request)
                 v
              prefill replica (its own deployment; the router picks it by prefix and load)
                 prefill_request: the prompt, 1 token, greedy; its freed full blocks are
                 spilled to the shared store; returns once they are written
                 |
              decode replica admits the request: tier 2's reader finds the blocks (a tier-2
              hit), the pool restores them, the last (partial) block and token are computed
              here, and the tokens stream from here

A decode replica never runs a long prefill beside its decodes, so its inter-token latency no
longer waits for one (Splitwise, DistServe; Mooncake, vLLM's KV connectors, SGLang's PD
disaggregation and llm-d do it across machines).

Faults cost no request: a prefill call that fails (the replica died, it refused the request)
or runs past ``timeout_s`` is counted and the decode replica computes the prompt itself; a
block that does not verify, or that a full store dropped, is a tier-2 miss and is recomputed
there (``server.kv_tier``). Tokens do not change: restored KV is the KV the decode replica
would have computed (a row's numbers never depend on its batch).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from cache_manager import prefix_block_keys
from metrics.records import MetricsSink
from scheduler.request import Request, SamplingParams

Role = Literal["both", "prefill", "decode"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode")
PREFILL_METHOD = "prefill_request"
PEER_MAX_AGE_S = 300.0  # a prefill replica not heard from this long is not listed
# Prompts needing fewer new tokens are computed on the decode replica. As vLLM's and SGLang's
# disaggregated serving do, everything else goes to a prefill replica, so decodes never wait
# for a prefill chunk. Raising it trades inter-token latency for time to first token: on
# this 2-core machine, handing off only prompts of 256+ new tokens kept output tok/s at 0.94x
# two mixed replicas', but ITL p99 at 0.78x (0.10-0.15x handing off all; docs/cluster.md).
DEFAULT_MIN_TRANSFER_TOKENS = 32


def num_cached_tokens(request: Request, block_size: int, is_cached: Callable[[bytes], bool]) -> int:
    """Prompt tokens of ``request`` whose full blocks ``is_cached`` (a chain: the first
    miss ends it)."""
    tokens = request.prompt_token_ids
    n = 0
    for key in prefix_block_keys(tokens[: len(tokens) - 1], block_size, request.cache_salt):
        if not is_cached(key):
            break
        n += 1
    return n * block_size


def prefill_job(request: Request) -> Request:
    """The prefill replica's request for ``request``'s prompt: one greedy token (discarded),
    the same owner, salt, adapter and priority, an id of its own."""
    return Request(
        request_id=f"prefill/{uuid.uuid4().hex}",
        prompt_token_ids=list(request.prompt_token_ids),
        sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        eos_token_ids=request.eos_token_ids,
        priority=request.priority,
        arrival_time_s=time.monotonic(),
        cache_salt=request.cache_salt,
        lora=request.lora,  # KV made with the adapter, as the salt says
        tenant=request.tenant,
    )


@dataclass(slots=True)
class PrefillHandoff:
    """A decode replica's side: hand a prompt that its RAM lacks to a prefill replica and
    wait until its KV is in the shared store.

    ``prefill``: the prefill deployment's handle; ``is_cached``: whether a prefix-cache key
    is in this replica's pool now; ``min_tokens``: prompts needing fewer new tokens than this
    are computed here (a transfer costs more than it saves).
    """

    prefill: Any
    is_cached: Callable[[bytes], bool]
    block_size: int
    block_bytes: int
    sink: MetricsSink
    timeout_s: float = 60.0
    min_tokens: int = DEFAULT_MIN_TRANSFER_TOKENS
    # The metrics addresses of the prefill replicas that answered, and when they last did.
    _peers: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefill = self.prefill.options(method_name=PREFILL_METHOD)
        if self.timeout_s <= 0 or self.min_tokens < 1:
            raise ValueError(
                f"timeout_s must be > 0 and min_tokens >= 1, got {self.timeout_s} and "
                f"{self.min_tokens}"
            )

    def wants(self, request: Request) -> bool:
        new = request.num_prompt_tokens - num_cached_tokens(
            request, self.block_size, self.is_cached
        )
        return new >= self.min_tokens

    async def before(self, request: Request) -> str | None:
        """Have a prefill replica publish ``request``'s KV when it should; the outcome
        ("ok", "prefill_failed", "timeout"; None: not handed off). Never raises but a
        cancellation: whatever happens, the request is admitted here next."""
        if not self.wants(request):
            return None
        t0 = time.perf_counter()
        call = self.prefill.remote(request)
        blocks = 0
        try:
            answer = await asyncio.wait_for(call, self.timeout_s)
            blocks = int(answer["blocks"])
            if answer.get("metrics_url"):
                self._peers[str(answer["metrics_url"])] = time.monotonic()
            outcome = "ok"
        except TimeoutError:
            outcome = "timeout"
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception:
            outcome = "prefill_failed"
        if outcome != "ok":
            call.cancel()
        self.sink.on_kv_transfer(
            outcome, blocks, blocks * self.block_bytes, time.perf_counter() - t0
        )
        return outcome

    def peer_metrics_urls(self, max_age_s: float = PEER_MAX_AGE_S) -> list[str]:
        """The prefill replicas' metrics addresses (for the router's ``/targets``): those
        that answered within ``max_age_s``."""
        now = time.monotonic()
        for url in [u for u, seen in self._peers.items() if now - seen > max_age_s]:
            del self._peers[url]
        return sorted(self._peers)
