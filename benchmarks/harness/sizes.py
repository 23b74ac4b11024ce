"""How big each section runs: the one size table of the CPU sections (``make bench``) and the
GPU sections (``bench_gpu``). A section reads its counts from ``Context.sizes``.

- ``FULL`` (the defaults below): ``make bench`` and ``bench_gpu``, the figures the README and
  docs/gpu.md quote and the targets are judged on;
- ``QUICK``: ``make bench BENCH_QUICK=1`` (every CPU section with tiny counts, to check the
  wiring) and ``bench_gpu --quick`` (every headline GPU figure with fewer cases and steps);
- ``DRY``: ``bench_gpu --dry-run``, the GPU sections' code on CPU at tiny shapes (CI). The CPU
  sections have nothing smaller than ``QUICK``: ``DRY`` keeps its counts.

Plain data (no torch): dtypes are torch's names (``"bfloat16"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.bench_models import MODELS

# The GPU sections' model: Llama-3-8B-SHAPED with random weights (transformers' config keys).
LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
TINY: dict[str, Any] = {
    **LLAMA3_8B,
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


@dataclass(frozen=True, slots=True)
class AttentionCases:
    """What the GPU ``attention`` section times: every (batch, keys) at the kernel's default
    configuration, then each ``(block_n, num_warps, num_stages)`` of ``configs`` at the
    ``sweep`` shapes."""

    batches: tuple[int, ...] = (1, 32, 256)
    keys: tuple[int, ...] = (512, 8192)
    configs: tuple[tuple[int, int, int], ...] = (
        (16, 4, 2), (32, 4, 2), (32, 4, 3), (32, 8, 2),
        (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3),
    )  # fmt: skip
    sweep: tuple[tuple[int, int], ...] = ((256, 512), (1, 8192))  # (batch, keys)
    block_size: int = 16
    dtype: str = "bfloat16"
    repeats: int = 5


@dataclass(frozen=True, slots=True)
class Sizes:
    """Every section's counts; the defaults are the full run's."""

    # ---- CPU sections (make bench): chat128, policy, slo, prefix, paged, spec
    chat_levels: tuple[tuple[int, int], ...] = ((1, 4), (8, 16), (32, 64))  # (users, requests)
    chat_output_tokens: int = 128
    hf_serial_requests: int = 4
    policy_requests: int = 32
    policy_users: int = 8
    policy_long_len: int = 1024
    policy_long_fraction: float = 0.25
    policy_output_tokens: int = 64
    policy_step_tokens: int = 512  # max_num_batched_tokens (and the largest chunk), both policies
    slo_requests: int = 64
    slo_users: int = 8
    slo_loose_requests: int = 16  # the loose-target case: chat128, two waves of slo_users
    slo_rounds: int = 2  # stall-free and slo alternate (ABBA) this many rounds each
    prefix_requests: int = 24
    prefix_users: int = 2
    prefix_num_prefixes: int = 4
    prefix_len: int = 512
    prefix_output_tokens: int = 16
    paged_requests: int = 64
    paged_budget_tokens: int = 16_384
    paged_max_model_len: int = 2048
    spec_requests: int = 4  # per round and configuration
    spec_rounds: int = 2
    spec_output_tokens: int = 128
    run_duration_s: float = 900.0
    # kvcache, sinks
    kvcache_lengths: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096)
    kvcache_tokens: int = 4  # measured tokens per length and strategy
    sinks_tokens: int = 4096  # tokens of the text scored
    sinks_cache: int = 256  # visible keys per query (sinks + window, or window alone)
    # models: which GGUF files (bench_models.MODELS), chat128 levels and output tokens.
    models: tuple[str, ...] = MODELS
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

    # ---- GPU sections (bench_gpu): probes, attention, decode, prefill, profile, serving, server
    model: dict[str, Any] = field(default_factory=lambda: LLAMA3_8B)
    dtype: str = "bfloat16"
    copy_bytes: int = 2 << 30
    matmul_n: int = 8192
    decode_batches: tuple[int, ...] = (1, 32, 128, 256)
    decode_context: int = 512
    decode_steps: int = 20
    prefill_seqs: int = 4
    prefill_len: int = 2048
    users: tuple[int, ...] = (1, 32, 256)
    prompt_len: int = 128
    output_len: int = 128
    requests_per_user: int = 2
    kv_budget_bytes: int = 24 << 30
    attention: AttentionCases = AttentionCases()
    profile_batches: tuple[int, ...] = (1, 256)
    profile_steps: int = 5
    transformers: bool = False  # serving also measures transformers' static batches
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    repeats: int = 5


FULL = Sizes()
QUICK = replace(
    FULL,
    # CPU: every section with tiny counts (wiring, not figures).
    chat_levels=((1, 1), (2, 2)),
    chat_output_tokens=8,
    hf_serial_requests=1,
    policy_requests=4,
    policy_users=2,
    policy_long_len=256,
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
    # The smoke's bound on one load run: a bound, not a target (a quiet run takes seconds);
    # two test suites side by side once cut the slo section's 1,024-token prefill at 300 s.
    run_duration_s=900.0,
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
    # GPU: every headline figure of issue 38 in a few minutes: batch 1 and 256 only, fewer
    # steps and configurations, serving and the server at 256 users.
    decode_batches=(1, 256),
    decode_steps=10,
    users=(256,),
    attention=replace(
        FULL.attention,
        batches=(1, 256),
        configs=((16, 4, 2), (32, 4, 2), (64, 4, 2), (64, 8, 2)),
        sweep=((1, 8192),),
    ),
    profile_steps=3,
    repeats=3,
)
DRY = replace(
    QUICK,
    # GPU: a 2-layer model in fp32 on CPU, tiny shapes (the figures mean nothing).
    model=TINY,
    dtype="float32",
    copy_bytes=8 << 20,
    matmul_n=128,
    decode_batches=(1, 32, 128, 256),
    decode_context=16,
    decode_steps=2,
    prefill_seqs=2,
    prefill_len=32,
    users=(1, 4, 8),
    prompt_len=16,
    output_len=4,
    requests_per_user=1,
    kv_budget_bytes=64 << 20,
    attention=AttentionCases(
        batches=(1, 3),
        keys=(20, 40),
        configs=((16, 4, 2), (32, 4, 2)),
        sweep=((3, 20),),
        dtype="float32",
        repeats=2,
    ),
    profile_batches=(1, 8),
    profile_steps=1,
    transformers=True,
    max_num_batched_tokens=512,
    repeats=2,
)
SIZES = {"full": FULL, "quick": QUICK, "dry": DRY}
