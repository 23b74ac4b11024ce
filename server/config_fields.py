"""The field table's machinery: how one ``ServerConfig`` field is one flag, one environment
variable and one file key, and the fields generated from the components' own configs.

    option(help, choices=, group=, repeat=)  a field's metadata: its flag's help, choices and
                                             --help group; repeat: a flag given many times
    with_component_fields(cls)               one field per SchedulerConfig / KVCacheConfig
                                             field (type and default from the component, help
                                             from HELP, choices from the packages' registries)

The server derives the ``DERIVED`` component fields itself (``server.config``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import field
from typing import Any, TypeVar

from cache_manager.config import EVICTION_POLICIES, KVCacheConfig
from cache_manager.strategy import KV_STRATEGIES
from scheduler.config import (
    MEMORY_MODES,
    POLICIES,
    PREEMPTION_RULES,
    QUEUE_ORDERS,
    SPECULATIVE_MODES,
    SchedulerConfig,
)

# Choices of the component fields, from the registries of the packages that implement them.
CHOICES: dict[str, tuple[str, ...]] = {
    "policy": POLICIES,
    "queue_order": QUEUE_ORDERS,
    "preemption": PREEMPTION_RULES,
    "memory_mode": MEMORY_MODES,
    "speculative": SPECULATIVE_MODES,
    "eviction_policy": EVICTION_POLICIES,
    "kv_strategy": KV_STRATEGIES,
}
# Flag help of the component fields (their meaning is documented on the component config).
HELP = {
    "max_num_seqs": "requests running at once",
    "max_num_batched_tokens": "token budget of one step",
    "long_prefill_token_threshold": (
        "largest prefill chunk one request gets per step (0 = the step budget)"
    ),
    "policy": "batch formation",
    "max_decode_starvation_steps": "prefill-first: most steps in a row without decodes",
    "queue_order": "waiting queue order",
    "aging_steps": "priority order: steps per one level of aging (0 = no aging)",
    "preemption": "preemption victim rule",
    "max_waiting_requests": "waiting-queue bound; over it: RESOURCE_EXHAUSTED",
    "max_waiting_tokens": "waiting prompt-token bound",
    "max_waiting_requests_per_tenant": (
        "waiting-queue bound of one API key (or peer without keys); over it: RESOURCE_EXHAUSTED "
        "for that tenant only"
    ),
    "max_waiting_tokens_per_tenant": "waiting prompt-token bound of one API key (or peer)",
    "memory_mode": "optimistic (preempt when full) | reserve (admit at full length)",
    "itl_slo_ms": "ITL target: slo policy steps stay under it; goodput metrics judge by it",
    "ttft_slo_ms": "TTFT target: slo policy admits by arrival + it; goodput metrics judge by it",
    "slo_preempt_margin": "slo: preempt decodes only when they alone exceed ITL x this",
    "slo_max_stretch": (
        "slo: a step may run up to ITL x this for prompts waiting for their first token, "
        "within the decodes' TPOT slack (1 = never)"
    ),
    "speculative": "speculative decoding: off | ngram (drafts by prompt lookup)",
    "max_loras": (
        "LoRA adapters in one step (among the running requests); a request whose adapter "
        "would pass it waits"
    ),
    "num_speculative_tokens": "speculative: draft tokens verified per decode step",
    "ngram_max": "speculative ngram: longest suffix matched in the request's own tokens",
    "ngram_min": "speculative ngram: shortest suffix that may draft",
    "block_size": "tokens per KV block",
    "enable_prefix_caching": "reuse KV of shared prompt prefixes",
    "eviction_policy": "which cached block to evict first",
    "attention_sinks": (
        "StreamingLLM: keep the first N tokens with the --sliding-window; a request may then "
        "generate past the context (0 = off)"
    ),
    "kv_strategy": (
        "always: keep KV; disabled: recompute the whole sequence every step; "
        "long-sequence-only: recompute below --kv-strategy-threshold; adaptive: under memory "
        "pressure window the longest requests before preempting"
    ),
    "kv_strategy_threshold": (
        "tokens: long-sequence-only keeps KV from this length; adaptive keeps at least the "
        "last this many"
    ),
}
# Component fields the server derives instead: the context from the model (or
# --max-model-len), the pool size from a budget (or --num-blocks), the window from the model
# (or --sliding-window), the bytes per block from the model's shape, tier 2 from --kv-disk-dir.
DERIVED = frozenset({"max_model_len", "num_blocks", "sliding_window", "block_bytes", "kv_tier"})
COMPONENTS = {"scheduler": SchedulerConfig, "kv cache": KVCacheConfig}


def option(
    help_text: str,
    *,
    choices: Sequence[str | int] | None = None,
    group: str = "server",
    repeat: bool = False,
) -> Any:
    """A field's metadata (typed ``Any`` so that it passes as a dataclass field's)."""
    return {"help": help_text, "choices": choices, "group": group, "repeat": repeat}


T = TypeVar("T")


def with_component_fields(cls: type[T]) -> type[T]:
    """Add one field per scheduler / KV-cache setting to ``cls`` (before ``@dataclass``):
    the component's type and default, help from ``HELP``, choices from ``CHOICES``."""
    for group, component in COMPONENTS.items():
        for f in dataclasses.fields(component):
            if f.name in DERIVED:
                continue
            help_text = HELP.get(f.name, f"see {component.__name__}.{f.name}")
            cls.__annotations__[f.name] = f.type
            meta = option(help_text, choices=CHOICES.get(f.name), group=group)
            setattr(cls, f.name, field(default=f.default, metadata=meta))
    return cls


def component_names(component: type) -> list[str]:
    """The fields of ``component`` that are ``ServerConfig`` fields (all but ``DERIVED``)."""
    return [f.name for f in dataclasses.fields(component) if f.name not in DERIVED]
