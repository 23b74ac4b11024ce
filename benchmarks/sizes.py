"""How big each section of the benchmark suite runs: ``FULL`` (``make bench``, the figures the
README quotes and the targets are judged on) and ``QUICK`` (``BENCH_QUICK=1``: every section
with tiny counts, to check the wiring). A section reads its counts from ``Context.sizes``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Sizes:
    chat_levels: tuple[tuple[int, int], ...]  # (users, requests)
    chat_output_tokens: int
    hf_serial_requests: int
    policy_requests: int
    policy_users: int
    policy_long_len: int
    policy_long_fraction: float
    policy_output_tokens: int
    policy_step_tokens: int  # max_num_batched_tokens (and the largest chunk), both policies
    slo_requests: int
    slo_users: int
    slo_loose_requests: int  # the loose-target case: chat128, two waves of slo_users
    slo_rounds: int  # stall-free and slo alternate (ABBA) this many rounds each
    prefix_requests: int
    prefix_users: int
    prefix_num_prefixes: int
    prefix_len: int
    prefix_output_tokens: int
    paged_requests: int
    paged_budget_tokens: int
    paged_max_model_len: int
    spec_requests: int  # per round and configuration
    spec_rounds: int
    spec_output_tokens: int
    run_duration_s: float
    kvcache_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    kvcache_tokens: int = 4  # measured tokens per length and strategy
    sinks_tokens: int = 4096  # tokens of the text scored
    sinks_cache: int = 256  # visible keys per query (sinks + window, or window alone)
    # models: which GGUF files (bench_models.MODELS), chat128 levels and output tokens.
    models: tuple[str, ...] = ("embedded", "embedded-q4km", "random-1b-q4km")
    models_levels: tuple[tuple[int, int], ...] = ((1, 4), (8, 16), (32, 64))
    models_output_tokens: int = 128
    # kvtier: which models, and the multi-turn workload's size (bench_kv_tier_served).
    kvtier_models: tuple[str, ...] = ("embedded", "random-1b-q4km")
    kvtier_quick: bool = False
    kvtier_users: int = 2
    # lora: the model, one adapter against llama.cpp at these levels, 8 adapters mixed at
    # (users, requests), output tokens, adapter rank and interleaved rounds (bench_lora).
    lora_model: str = "random-1b-q4km"
    lora_levels: tuple[tuple[int, int], ...] = ((1, 4), (8, 16))
    lora_mixed: tuple[int, int] = (8, 16)
    lora_output_tokens: int = 128
    lora_rank: int = 16
    lora_rounds: int = 1


FULL = Sizes(
    chat_levels=((1, 4), (8, 16), (32, 64)),
    chat_output_tokens=128,
    hf_serial_requests=4,
    policy_requests=32,
    policy_users=8,
    policy_long_len=1024,
    policy_long_fraction=0.25,
    policy_output_tokens=64,
    policy_step_tokens=512,
    slo_requests=64,
    slo_users=8,
    slo_loose_requests=16,
    slo_rounds=2,
    prefix_requests=24,
    prefix_users=2,
    prefix_num_prefixes=4,
    prefix_len=512,
    prefix_output_tokens=16,
    paged_requests=64,
    paged_budget_tokens=16_384,
    paged_max_model_len=2048,
    spec_requests=4,
    spec_rounds=2,
    spec_output_tokens=128,
    run_duration_s=900.0,
)
QUICK = Sizes(
    chat_levels=((1, 1), (2, 2)),
    chat_output_tokens=8,
    hf_serial_requests=1,
    policy_requests=4,
    policy_users=2,
    policy_long_len=256,
    policy_long_fraction=0.25,
    policy_output_tokens=8,
    policy_step_tokens=256,
    slo_requests=4,
    slo_users=2,
    slo_loose_requests=4,
    slo_rounds=1,
    prefix_requests=4,
    prefix_users=1,
    prefix_num_prefixes=2,
    prefix_len=64,
    prefix_output_tokens=4,
    paged_requests=16,
    paged_budget_tokens=4096,
    paged_max_model_len=1024,
    spec_requests=1,
    spec_rounds=1,
    spec_output_tokens=8,
    run_duration_s=300.0,
    kvcache_lengths=(64, 128, 256),
    kvcache_tokens=2,
    sinks_tokens=512,
    sinks_cache=128,
    models=("embedded",),
    models_levels=((1, 1), (2, 2)),
    models_output_tokens=8,
    kvtier_models=("embedded",),
    kvtier_quick=True,
    lora_model="embedded",
    lora_levels=((1, 1),),
    lora_mixed=(2, 2),
    lora_output_tokens=8,
    lora_rank=4,
)
