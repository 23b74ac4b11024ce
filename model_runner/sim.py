"""SimRunner: a roofline cost model of one engine step, on a virtual clock. No torch.

One step (the prefill batch and the decode batch fused into one forward pass) costs::

    time_s = max(flops / peak_flops, memory_s) + step_overhead_s
    memory_s = weight_bytes / mem_bandwidth + kv_bytes / kv_bandwidth

i.e. ``max(FLOPs / peak, bytes / bandwidth) + overhead`` where the two memory streams may run
at different effective bandwidths: on a GPU both are HBM streams (``kv_bandwidth ==
mem_bandwidth``, the plain roofline); on the CPU the KV gather of attention runs far below
the streaming bandwidth of the weights, as measured below.

with, for a model of L layers, hidden size H, intermediate size I, NH query heads and NKV KV
heads of size D, vocabulary V, ``b`` bytes per parameter/KV element:

- ``flops = 2 * P_layers * T + 2 * H * V * S + 4 * L * NH * D * A``
  where ``T`` = tokens computed this step (prefill chunk tokens + one per decode),
  ``S`` = seqs that sample (logits only at their last position), ``P_layers = L * (2*H*NH*D
  + 2*H*NKV*D + 3*H*I)`` the per-token weights of the transformer layers, and ``A`` the
  attention pairs: a chunk of ``n`` tokens after ``s`` already computed ones attends over
  ``n*s + n*(n+1)/2`` (query, key) pairs (causal; a decode is ``n = 1``). The factor 4 is
  QK^T and PV, two FLOPs per multiply-add.
- ``weight_bytes = (P_layers + H * V) * b``: all weights are read once per step whatever
  the batch (what makes batching pay); ``kv_bytes = kv_bytes_per_token * (sum of s + T)``:
  each seq reads the KV of its ``s`` earlier positions and writes the KV of its new tokens.
  Activations are left out (small next to weights and KV at these sizes).

A decode step of a few requests is memory-bound (weights dominate), a long prefill chunk is
compute-bound: that is the asymmetry continuous batching and chunked prefill exploit.

Profiles (``PROFILES``):

- ``h100-llama3-8b-bf16``: Llama-3-8B (32 layers, H 4096, I 14336, 32/8 heads of 128, V
  128256) in bf16 on one H100 SXM. Effective figures, not datasheet peaks: 989 TFLOP/s dense
  bf16 x 0.6 achievable MFU = 593 TFLOP/s; 3.35 TB/s HBM3 x 0.8 = 2.68 TB/s; 1.5 ms per step
  of launch/sampling/scheduling overhead. A batch-1 decode then costs 15.0 GB / 2.68 TB/s +
  1.5 ms = 7.1 ms, in line with published vLLM batch-1 latencies (6-8 ms/token).
- ``cpu-smollm2-135m-fp32``: SmolLM2-135M (30 layers, H 576, I 1536, 9/3 heads of 64, V
  49152) in fp32 on this project's development machine (2 shared vCPUs, torch 2.13 CPU).
  Calibrated from a measurement: a plain torch forward with random weights of exactly that
  shape (per layer: x @ W_qkv, ``F.scaled_dot_product_attention(enable_gqa=True)`` over a
  ``torch.cat`` of a cached K/V of 512 positions and the new ones, x @ W_o, SiLU-gated MLP;
  then lm_head at the last position), under ``torch.inference_mode()``, timed with
  ``time.perf_counter``: minimum of 7 repetitions (5 for the prefill) after a warm-up, with
  ``torch.set_num_threads(1)`` (two threads were 2-10x slower on the shared machine). The
  machine was shared (load average ~7.5 on 2 vCPUs), so these are pessimistic figures::

      decode batch 1, no context       77.9 ms   (538 MB of weights)
      decode batch 1, context 512      97.2 ms
      decode batch 8, context 512     282.3 ms
      decode batch 32, context 512    692.0 ms
      prefill 512 tokens            3007.1 ms   (117.8 GFLOP)

  Fit: peak 117.8 GFLOP / 3.0 s = 39 GFLOP/s (the prefill is compute-bound); overhead 3 ms
  (about 300 framework calls per step); weight bandwidth 538 MB / 75 ms = 7.2 GB/s (batch 1,
  no context, is memory-bound); KV bandwidth from the marginal cost of a sequence with 512
  positions of context (23.6 MB of KV), 19-25 ms, i.e. 1.2 GB/s. The model then predicts
  78 / 97 / 235 / 708 / 3025 ms for the five rows (batch 8 is 17% under).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cache_manager.sizing import ModelShape
from model_runner.base import ModelInfo, NullBlockIO, SyncRunner
from model_runner.fake import FakeRunner
from scheduler.cost_model import StepCostModel, StepShape
from scheduler.output import ModelOutput, SchedulerOutput


@dataclass(frozen=True, slots=True)
class SimModel:
    """The shape of a LLaMA-family model, as far as the cost model needs it."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int
    max_model_len: int

    def __post_init__(self) -> None:
        for attr in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "dtype_bytes",
            "max_model_len",
        ):
            if getattr(self, attr) < 1:
                raise ValueError(f"SimModel.{attr} must be >= 1, got {getattr(self, attr)}")

    @property
    def layer_params(self) -> int:
        """Weights a token passes through in the transformer layers (QKV, O, gate/up/down)."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return self.num_layers * (2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size)

    @property
    def lm_head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        """Bytes read per step: layer weights and the lm_head (embedding rows are negligible)."""
        return (self.layer_params + self.lm_head_params) * self.dtype_bytes

    @property
    def shape(self) -> ModelShape:
        return ModelShape(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype_bytes=self.dtype_bytes,
            name=self.name,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return self.shape.kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class Hardware:
    """Effective (achievable, not datasheet) throughput of one accelerator."""

    name: str
    peak_flops: float  # FLOP/s
    mem_bandwidth_bytes_s: float  # bytes/s
    step_overhead_s: float  # fixed cost of a non-empty step
    memory_bytes: int  # device memory (weights + KV + activations)
    kv_bandwidth_bytes_s: float | None = None  # KV reads/writes; None = mem_bandwidth

    def __post_init__(self) -> None:
        if not (self.peak_flops > 0 and self.mem_bandwidth_bytes_s > 0):
            raise ValueError(
                f"peak_flops and mem_bandwidth_bytes_s must be > 0, got {self.peak_flops}, "
                f"{self.mem_bandwidth_bytes_s}"
            )
        if self.kv_bandwidth_bytes_s is not None and not self.kv_bandwidth_bytes_s > 0:
            raise ValueError(f"kv_bandwidth_bytes_s must be > 0, got {self.kv_bandwidth_bytes_s}")
        if self.step_overhead_s < 0 or self.memory_bytes < 0:
            raise ValueError(
                f"step_overhead_s and memory_bytes must be >= 0, got {self.step_overhead_s}, "
                f"{self.memory_bytes}"
            )


@dataclass(frozen=True, slots=True)
class SimProfile:
    """A model on a piece of hardware, with the KV budget a server would give it."""

    name: str
    model: SimModel
    hardware: Hardware
    kv_budget_bytes: int  # default KV pool size for this pairing

    @property
    def default_num_blocks(self) -> int:
        """KV blocks of 16 tokens that fit the default budget."""
        return self.kv_budget_bytes // (self.model.kv_bytes_per_token * 16)


@dataclass(frozen=True, slots=True)
class StepCost:
    """The cost of one step and its parts."""

    flops: float
    bytes: float  # weight bytes + KV bytes
    compute_s: float  # flops / peak_flops
    memory_s: float  # weight bytes / mem_bandwidth + KV bytes / kv_bandwidth
    time_s: float  # max(compute_s, memory_s) + overhead (0 for an empty step)

    @property
    def is_compute_bound(self) -> bool:
        return self.compute_s > self.memory_s


def estimate_step(
    model: SimModel,
    hardware: Hardware,
    chunks: Sequence[tuple[int, int]],
    num_sampled: int,
) -> StepCost:
    """Cost of one fused forward pass over ``chunks`` = ``(num_new_tokens, num_prior_tokens)``
    per seq (a decode is ``(1, context_len)``), ``num_sampled`` of which compute logits."""
    if not chunks:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
    num_tokens = 0
    attention_pairs = 0
    num_prior = 0
    for n, s in chunks:
        num_tokens += n
        num_prior += s
        attention_pairs += n * s + n * (n + 1) // 2
    flops = (
        2.0 * model.layer_params * num_tokens
        + 2.0 * model.lm_head_params * num_sampled
        + 4.0 * model.num_layers * model.num_heads * model.head_dim * attention_pairs
    )
    weight_bytes = float(model.weight_bytes)
    kv_bytes = float(model.kv_bytes_per_token * (num_prior + num_tokens))
    kv_bandwidth = hardware.kv_bandwidth_bytes_s or hardware.mem_bandwidth_bytes_s
    compute_s = flops / hardware.peak_flops
    memory_s = weight_bytes / hardware.mem_bandwidth_bytes_s + kv_bytes / kv_bandwidth
    num_bytes = weight_bytes + kv_bytes
    time_s = max(compute_s, memory_s) + hardware.step_overhead_s
    return StepCost(flops, num_bytes, compute_s, memory_s, time_s)


def plan_chunks(plan: SchedulerOutput) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """(prefill chunks, decode chunks, number of sampled rows) of a plan; a decode with
    speculative drafts is a chunk of 1 + k tokens, each of which samples."""
    prefill = [(len(s.token_ids), s.start_pos) for s in plan.prefill]
    decode = [(len(s.token_ids), s.start_pos) for s in plan.decode]
    num_sampled = sum(s.do_sample for s in plan.prefill) + sum(
        len(s.token_ids) for s in plan.decode
    )
    return prefill, decode, num_sampled


class VirtualClock:
    """Simulated time in seconds; only ``advance`` moves it."""

    __slots__ = ("now_s",)

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def advance(self, seconds: float) -> None:
        if seconds < 0 or math.isnan(seconds):
            raise ValueError(f"time only moves forward, got {seconds}")
        self.now_s += seconds

    def advance_to(self, when_s: float) -> None:
        """Jump to ``when_s`` if it lies ahead (an idle engine waiting for an arrival)."""
        self.now_s = max(self.now_s, when_s)


class SimRunner(SyncRunner):
    """A runner that costs each step with the roofline model and advances a virtual clock.

    Tokens come from a ``FakeRunner`` (same rule, scripts and failure injection).
    """

    def __init__(
        self,
        profile: SimProfile | str,
        *,
        seed: int = 0,
        script: Mapping[str, Sequence[int]] | None = None,
        clock: VirtualClock | None = None,
    ) -> None:
        self.profile = get_profile(profile) if isinstance(profile, str) else profile
        model = self.profile.model
        self._info = ModelInfo(
            name=model.name,
            vocab_size=model.vocab_size,
            max_model_len=model.max_model_len,
            shape=model.shape,
            eos_token_ids=(),
            dtype={2: "bfloat16", 4: "float32"}.get(model.dtype_bytes, "float32"),
            device=self.profile.hardware.name,
            extra={"simulated": "true", "profile": self.profile.name},
        )
        self.tokens = FakeRunner(self._info, script=script, seed=seed)
        self.clock = clock if clock is not None else VirtualClock()
        self.last_cost = StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
        self.busy_s = 0.0  # simulated time spent computing steps

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def now_s(self) -> float:
        return self.clock.now_s

    @property
    def constraints(self) -> None:
        """No structured outputs: the simulation samples no masks."""
        return None

    @property
    def adapters(self) -> None:
        """No LoRA adapters: the simulation has no weights."""
        return None

    def block_io(self) -> NullBlockIO:
        """No KV bytes: a simulated runner holds none."""
        return NullBlockIO()

    def scrub_blocks(self, block_ids: Sequence[int]) -> None:
        """No KV values to scrub."""

    def execute(
        self, plan: SchedulerOutput, *, padding: Sequence[tuple[int, int]] = ()
    ) -> ModelOutput:
        """Sample like FakeRunner, then advance the clock by the step's simulated time.

        ``padding``: extra decode rows ``(1, context_len)`` the step computes and throws away
        (static batching keeps finished sequences in the batch until the longest ends).
        """
        prefill, decode, num_sampled = plan_chunks(plan)
        model, hardware = self.profile.model, self.profile.hardware
        cost = estimate_step(model, hardware, [*prefill, *decode, *padding], num_sampled)
        prefill_s = estimate_step(
            model, hardware, prefill, sum(s.do_sample for s in plan.prefill)
        ).time_s
        out = self.tokens.execute(plan)
        out.prefill_time_s = min(prefill_s, cost.time_s)
        out.decode_time_s = cost.time_s - out.prefill_time_s
        self.clock.advance(cost.time_s)
        self.busy_s += cost.time_s
        self.last_cost = cost
        return out


# -- profiles --------------------------------------------------------------------------------

LLAMA3_8B = SimModel(
    name="llama-3-8b",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
    dtype_bytes=2,
    max_model_len=8192,
)

SMOLLM2_135M = SimModel(
    name="smollm2-135m",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    dtype_bytes=4,
    max_model_len=8192,
)

H100_SXM = Hardware(
    name="h100-sxm",
    peak_flops=989e12 * 0.6,
    mem_bandwidth_bytes_s=3.35e12 * 0.8,
    step_overhead_s=1.5e-3,
    memory_bytes=80 * 2**30,
)

# Fitted to a measurement on the development machine; see the module docstring.
CPU_DEV = Hardware(
    name="cpu-dev",
    peak_flops=39e9,
    mem_bandwidth_bytes_s=7.2e9,
    step_overhead_s=3e-3,
    memory_bytes=8 * 2**30,
    kv_bandwidth_bytes_s=1.2e9,
)

PROFILES: dict[str, SimProfile] = {
    "h100-llama3-8b-bf16": SimProfile(
        name="h100-llama3-8b-bf16",
        model=LLAMA3_8B,
        hardware=H100_SXM,
        # 90% of 80 GiB, minus 15 GB of weights and ~4 GiB of activations/workspace.
        kv_budget_bytes=int(0.9 * 80 * 2**30) - LLAMA3_8B.weight_bytes - 4 * 2**30,
    ),
    "cpu-smollm2-135m-fp32": SimProfile(
        name="cpu-smollm2-135m-fp32",
        model=SMOLLM2_135M,
        hardware=CPU_DEV,
        kv_budget_bytes=1 * 2**30,
    ),
}


def get_profile(name: str) -> SimProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown simulation profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None


def roofline_cost_model(profile: SimProfile | str, **kwargs: float) -> StepCostModel:
    """A step-cost model whose prior is this profile's roofline, fitted by least squares over
    a grid of step shapes (decode batches over short and long contexts, prefill chunks after
    short and long prefixes, and mixes): the ``slo`` policy's prior for a named device."""
    profile = get_profile(profile) if isinstance(profile, str) else profile
    samples = []
    for num_decodes in (0, 1, 8, 32, 128):
        for context in (128, 2048):
            for chunk, start in ((0, 0), (64, 0), (512, 0), (512, 2048), (2048, 0)):
                if num_decodes == 0 and chunk == 0:
                    continue
                prefill = [(chunk, start)] if chunk else []
                decodes = [(1, context)] * num_decodes
                cost = estimate_step(
                    profile.model, profile.hardware, prefill + decodes, num_decodes + bool(chunk)
                )
                shape = StepShape.of(prefill, (context for _ in range(num_decodes)))
                samples.append((shape, cost.time_s))
    return StepCostModel.fit(samples, **kwargs)
