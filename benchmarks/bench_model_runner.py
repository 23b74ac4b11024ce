"""Model runner vs Hugging Face transformers, side by side in one run (SmolLM2-135M, fp32).

    python -m benchmarks.bench_model_runner [--threads 2] [--steps 8] [--batches 1,8,32,64]

Measures, on the same weights:
- decode step time at several batch sizes, every request with a ~128-token context
  (ours: one ``TorchRunner.execute`` of a decode plan, sampling included; transformers: one
  ``model(next_tokens, past_key_values=...)`` call with a DynamicCache, plus argmax — no
  ``generate()`` overhead, so the baseline is if anything flattered);
- prefill throughput of one 512-token prompt (transformers with ``logits_to_keep=1``);
- fused vs separate prefill + decode: one step with a 32-request decode batch and a 16- or
  128-token prefill chunk, run as one forward pass or as two;
- KV cache precision: the decode step of the same runner with its KV pool in float32,
  float16 and int8 (``--kv-dtypes``), timed interleaved (one step of each in turn), with
  ratios against float32.

The tables above the KV one run the KV cache in float32 (as transformers does).

Weights: the embedded SmolLM2-135M-Instruct GGUF through ``model_runner.gguf_loader`` when both
exist, else random weights of the same shapes (timing does not depend on the values); the
table says which. Prints a table; asserts nothing. Each figure is the minimum of ``--steps``
timed steps after two warm-up steps (``--stat median`` for medians). Timings on a shared
machine are noisy.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from benchmarks.tools.reference import build_hf_model
from model_runner.config import ModelConfig, RunnerOptions
from model_runner.device import resolve_kv_dtype
from model_runner.kv_pool import KVPool
from model_runner.paths import EagerPath, ForwardPaths
from model_runner.runner import TorchRunner
from scheduler.output import ScheduledSeq, SchedulerOutput
from scheduler.request import SamplingParams

SMOLLM2_135M = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
    name="SmolLM2-135M (random weights)",
)
GREEDY = SamplingParams(temperature=0.0)
BLOCK_SIZE = 16


def load_weights(force_random: bool) -> tuple[ModelConfig, dict[str, torch.Tensor], str]:
    """The real GGUF weights when the loader and the file exist, else random ones."""
    reason = "--random-weights"
    if not force_random:
        try:
            from model_runner.gguf_loader import default_model_path, load_gguf

            path = default_model_path()
            config, state = load_gguf(path, torch.float32)
            return config, dict(state), f"real weights ({path.name}, dequantized to fp32)"
        except (ImportError, RuntimeError, OSError) as exc:
            reason = f"real weights unavailable: {exc}"
    g = torch.Generator().manual_seed(0)
    c = SMOLLM2_135M
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    state = {
        "model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
        "model.norm.weight": torch.ones(c.hidden_size),
    }
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": rand(q_out, c.hidden_size),
            p + "self_attn.k_proj.weight": rand(kv_out, c.hidden_size),
            p + "self_attn.v_proj.weight": rand(kv_out, c.hidden_size),
            p + "self_attn.o_proj.weight": rand(c.hidden_size, q_out),
            p + "mlp.gate_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": rand(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": rand(c.hidden_size, c.intermediate_size),
            p + "input_layernorm.weight": torch.ones(c.hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(c.hidden_size),
        }
    return c, state, f"random weights of SmolLM2-135M's shapes ({reason})"


def quantized_runner(options: RunnerOptions, force_random: bool) -> tuple[TorchRunner | None, str]:
    """The runner serving uses by default: the GGUF's own Q4_1 / Q8_0 weights on kvserve's
    kernels, with the fused step (``options.fused_step=False``: without) and the default KV
    dtype; None (and why) when the file or kernels are missing."""
    if force_random:
        return None, "not measured (--random-weights)"
    try:
        from model_runner import kernels
        from model_runner.loader import load_model

        if not kernels.available():
            return None, f"not measured: {kernels.unavailable_reason()}"
        loaded = load_model(None, weights="native")
    except (ImportError, RuntimeError, OSError) as exc:
        return None, f"not measured: {exc}"
    runner = TorchRunner(loaded.config, loaded.state_dict, replace(options, kv_dtype=None))
    return runner, (
        f"{loaded.name} as stored ({runner.info.weights}, "
        f"{runner.info.weight_bytes / 2**20:.0f} MiB), "
        f"{runner.info.linear_backend} kernels, fused step "
        f"{runner.info.extra['fused_step']}, KV {runner.info.kv_dtype}"
    )


STAT = {"min": min, "median": statistics.median}
_stat = min


def step_ms(fn: Callable[[], object], steps: int) -> float:
    """Time of one call in ms: 2 warm-up calls, then ``--stat`` (default: min, timeit's
    convention: on a shared machine the least-disturbed run is the best estimate) of
    ``steps`` timed calls."""
    fn()
    fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _stat(times) * 1e3


class OursDecode:
    """B requests with ``context`` tokens each, prefilled once; then repeated decode steps
    at a fixed position (re-writing the same slot each time keeps the context constant)."""

    def __init__(self, runner: TorchRunner, batch: int, context: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(batch)
        blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
        self.runner = runner
        self.seqs: list[ScheduledSeq] = []
        for b in range(batch):
            ids = torch.randint(0, vocab, (context,), generator=g).tolist()
            table = list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq))
            pre = ScheduledSeq(f"r{b}", ids, 0, table, GREEDY, True)
            runner.execute(SchedulerOutput(0, prefill=[pre]))
            self.seqs.append(ScheduledSeq(f"r{b}", [ids[-1]], context, table, GREEDY, True))

    def step(self) -> None:
        self.runner.execute(SchedulerOutput(1, decode=self.seqs))


def with_kv_dtype(runner: TorchRunner, kv_dtype: str) -> TorchRunner:
    """The same model (weights shared, not copied) over a fresh pool in ``kv_dtype``, on
    the eager path (the float runner's only one)."""
    assert runner.paths.fused is None and runner.paths.graphs is None
    other = copy.copy(runner)
    other.pool = KVPool.from_config(
        runner.config,
        runner.num_blocks,
        runner.block_size,
        resolve_kv_dtype(kv_dtype, runner.dtype, runner.device),
        runner.device,
        runner.dtype,
    )
    other.paths = ForwardPaths(EagerPath(runner.model, other.pool, runner.paths.eager.lora))
    return other


def interleaved_ms(fns: dict[str, Callable[[], object]], steps: int) -> dict[str, float]:
    """Like ``step_ms`` for several functions, timed in turn (one call of each per round) so
    that a noisy neighbour slows them alike."""
    for fn in fns.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: _stat(t) * 1e3 for name, t in times.items()}


def hf_decode(model: torch.nn.Module, batch: int, context: int, vocab: int) -> Callable[[], None]:
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, context), generator=g)
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    pos = torch.full((batch, 1), context)

    def step() -> None:
        with torch.inference_mode():
            logits = model(nxt, past_key_values=cache, position_ids=pos, use_cache=True).logits
            logits[:, -1].argmax(-1)
            cache.crop(-1)  # keep the context constant across timed steps

    return step


def linear_weight_bytes(config: ModelConfig) -> int:
    """fp32 bytes of every matrix a decode step streams (all layers + LM head)."""
    c = config
    per_layer = c.hidden_size * (
        (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim + 3 * c.intermediate_size
    )
    return 4 * (c.num_layers * per_layer + c.vocab_size * c.hidden_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--stat", choices=sorted(STAT), default="min")
    parser.add_argument("--kv-dtypes", default="float32,float16,int8")
    parser.add_argument("--only-kv", action="store_true", help="only the KV cache precision table")
    args = parser.parse_args()
    global _stat
    _stat = STAT[args.stat]
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    steps = args.steps

    config, state, source = load_weights(args.random_weights)
    hf = None if args.no_hf else build_hf_model(config, state)
    max_batch = max([*batches, 32])
    # Decode requests use blocks [0, max_batch * per_seq); prompts use the blocks after them.
    prompt_base = max_batch * (-(-(args.context + 1) // BLOCK_SIZE))
    num_blocks = prompt_base + -(-max(args.prefill_len, 128) // BLOCK_SIZE)
    options = RunnerOptions(
        num_blocks, BLOCK_SIZE, dtype=torch.float32, device="cpu", kv_dtype="float32"
    )
    ours = TorchRunner(config, state, options)
    vocab = config.vocab_size
    kv_dtypes = args.kv_dtypes.split(",")
    if args.only_kv:
        del state
        kv_table(ours, kv_dtypes, batches, args.context, steps, source)
        return
    quant, quant_source = quantized_runner(options, args.random_weights)
    plain = TorchRunner(config, state, replace(options, use_onednn=False))
    del state

    print(
        f"# kvserve TorchRunner vs transformers {_hf_version()}: {config.name or 'model'}, fp32, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"# weights: {source}")
    print(
        f"# kvserve: linear layers via {ours.info.linear_backend}; "
        "'kvserve F.linear' = same runner with plain torch F.linear (ablation)"
    )
    print(
        f"# decode: {args.context}-token contexts; every figure is the {args.stat} of {steps} "
        "timed steps after 2 warm-up steps; a shared machine makes figures noisy\n"
    )
    print(f"# kvserve q4: {quant_source}")
    print(
        f"| {'measurement':<30} | {'kvserve':>9} | {'kvserve q4':>10} | {'q4 / fp32':>9} | "
        f"{'kvserve F.linear':>16} | {'transformers':>12} | {'kvserve / HF':>12} |"
    )
    print(f"|{'-' * 32}|{'-' * 11}|{'-' * 12}|{'-' * 11}|{'-' * 18}|{'-' * 14}|{'-' * 14}|")

    def row(name: str, a: float, q: float | None, b: float, c: float | None, higher: bool) -> None:
        hf_s = f"{c:12.1f}" if c is not None else f"{'-':>12}"
        ratio = "-" if c is None else f"{(a / c if higher else c / a):.2f}x"
        q_s = f"{q:10.1f}" if q is not None else f"{'-':>10}"
        q_ratio = f"{q / a:.2f}x" if q is not None else "-"
        print(
            f"| {name:<30} | {a:9.1f} | {q_s} | {q_ratio:>9} | {b:16.1f} | {hf_s} | {ratio:>12} |",
            flush=True,
        )

    decode_ms: dict[int, float] = {}
    quant_ms: dict[int, float] = {}
    for batch in batches:
        ms_ours = step_ms(OursDecode(ours, batch, args.context, vocab).step, steps)
        ms_quant = None
        if quant is not None:
            ms_quant = step_ms(OursDecode(quant, batch, args.context, vocab).step, steps)
            quant_ms[batch] = ms_quant
        ms_plain = step_ms(OursDecode(plain, batch, args.context, vocab).step, steps)
        ms_hf = None
        if hf is not None:
            ms_hf = step_ms(hf_decode(hf, batch, args.context, vocab), steps)
        decode_ms[batch] = ms_ours
        row(f"decode step, batch {batch} (ms)", ms_ours, ms_quant, ms_plain, ms_hf, False)
        tok_hf = batch * 1e3 / ms_hf if ms_hf else None
        row(
            f"decode, batch {batch} (tok/s)",
            batch * 1e3 / ms_ours,
            batch * 1e3 / ms_quant if ms_quant else None,
            batch * 1e3 / ms_plain,
            tok_hf,
            True,
        )

    g = torch.Generator().manual_seed(7)
    n = args.prefill_len
    prompt = torch.randint(0, vocab, (n,), generator=g).tolist()
    table = list(range(prompt_base, prompt_base + -(-n // BLOCK_SIZE)))
    plan = SchedulerOutput(0, prefill=[ScheduledSeq("p", prompt, 0, table, GREEDY, True)])
    pre_steps = max(3, steps // 2)
    ms_prefill = step_ms(lambda: ours.execute(plan), pre_steps)
    ms_quant_prefill = step_ms(lambda: quant.execute(plan), pre_steps) if quant else None
    ms_plain = step_ms(lambda: plain.execute(plan), pre_steps)
    ms_hf = None
    if hf is not None:
        ids = torch.tensor([prompt])

        def hf_prefill() -> None:
            with torch.inference_mode():
                hf(ids, use_cache=True, logits_to_keep=1).logits.argmax(-1)

        ms_hf = step_ms(hf_prefill, pre_steps)
    row(
        f"prefill {n} tokens (tok/s)",
        n * 1e3 / ms_prefill,
        n * 1e3 / ms_quant_prefill if ms_quant_prefill else None,
        n * 1e3 / ms_plain,
        n * 1e3 / ms_hf if ms_hf else None,
        True,
    )

    # Fused vs separate: a 32-request decode batch plus one prefill chunk in the same step.
    dec = OursDecode(ours, 32, args.context, vocab)
    print("\n| mixed step (32 decodes + chunk) | fused (ms) | separate (ms) | fused / separate |")
    print(f"|{'-' * 33}|{'-' * 12}|{'-' * 15}|{'-' * 18}|")
    for chunk_len in (16, 128):
        chunk_table = list(range(prompt_base, prompt_base + -(-chunk_len // BLOCK_SIZE)))
        chunk = ScheduledSeq("c", prompt[:chunk_len], 0, chunk_table, GREEDY, True)
        mixed = SchedulerOutput(2, prefill=[chunk], decode=dec.seqs)
        times = {}
        for fused in (True, False):
            ours.fuse_batches = fused
            times[fused] = step_ms(lambda: ours.execute(mixed), steps)  # noqa: B023
        ours.fuse_batches = True
        print(
            f"| {chunk_len:>3}-token chunk{'':<16} | {times[True]:10.1f} | {times[False]:13.1f} "
            f"| {times[True] / times[False]:16.2f} |"
        )

    if quant is not None:
        no_fused = replace(options, fused_step=False)
        torch_path, _ = quantized_runner(no_fused, args.random_weights)
        assert torch_path is not None
        mixed_step_table(quant, torch_path, prompt, prompt_base, args.context, steps)

    if 1 in quant_ms:
        ratio = quant_ms[1] / decode_ms[1]
        print(
            f"\n# batch-1 decode step, q4 / fp32 in this run: {ratio:.2f}x "
            f"(issue 10's target <= 0.35x: {'met' if ratio <= 0.35 else 'MISSED'})"
        )
    weights = linear_weight_bytes(config)
    kv_token = config.kv_shape("float32").kv_bytes_per_token
    flops_token = 2 * weights // 4 - 2 * vocab * config.hidden_size  # LM head: last row only
    print("\n# what bounds it")
    if 1 in decode_ms:
        print(
            f"# batch 1: {weights / 1e6:.0f} MB of fp32 matrices streamed per step in "
            f"{decode_ms[1]:.1f} ms = {weights / decode_ms[1] / 1e6:.1f} GB/s effective"
        )
    for batch, ms in decode_ms.items():
        kv = kv_token * (args.context + 1) * batch
        print(
            f"# batch {batch}: weights {weights / 1e6:.0f} MB + KV read {kv / 1e6:.0f} MB "
            f"per step -> {(weights + kv) / ms / 1e6:.1f} GB/s effective"
        )
    print(
        f"# prefill: {flops_token * n / 1e9:.0f} GFLOP of matmuls (+ attention) in "
        f"{ms_prefill:.0f} ms = {flops_token * n / ms_prefill / 1e6:.0f} GFLOP/s"
    )
    print()
    kv_table(ours, kv_dtypes, batches, args.context, steps, source)


def mixed_step_table(
    runner: TorchRunner,
    torch_path: TorchRunner,
    prompt: list[int],
    prompt_base: int,
    context: int,
    steps: int,
) -> None:
    """The cost of holding a prefill chunk beside decodes, on the quantized weights: 8
    decodes, a 64-token chunk alone, and both in one step, through the fused step (``runner``:
    every row in one kernel call) and through the torch path (``torch_path``, built with
    ``fused_step=False``: what a step with a prefill chunk did before). ``extra`` = mixed -
    (decodes + chunk): the fixed cost of mixing; ``ratio`` = mixed / (decodes + chunk), the
    issue's bound is 1.3."""
    dec = OursDecode(runner, 8, context, runner.model.vocab_size)
    table = list(range(prompt_base, prompt_base + -(-64 // BLOCK_SIZE)))
    chunk = ScheduledSeq("c", prompt[:64], 0, table, GREEDY, True)
    plans = {
        "decodes": SchedulerOutput(2, decode=dec.seqs),
        "chunk": SchedulerOutput(2, prefill=[chunk]),
        "mixed": SchedulerOutput(2, prefill=[chunk], decode=dec.seqs),
    }
    print("\n| quantized step (ms) | 8 decodes | 64-token chunk | chunk + 8 decodes "
          "| extra | mixed / (decodes + chunk) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for label, ours in (("fused step", runner), ("torch path (before)", torch_path)):
        run = ours.execute
        t = interleaved_ms({k: lambda p=p: run(p) for k, p in plans.items()}, steps)  # noqa: B023
        extra = t["mixed"] - t["decodes"] - t["chunk"]
        ratio = t["mixed"] / (t["decodes"] + t["chunk"])
        print(f"| {label} | {t['decodes']:.1f} | {t['chunk']:.1f} | {t['mixed']:.1f} "
              f"| {extra:+.1f} | {ratio:.2f} |")  # fmt: skip


def kv_table(
    runner: TorchRunner,
    kv_dtypes: list[str],
    batches: list[int],
    context: int,
    steps: int,
    source: str,
) -> None:
    """Decode step time per KV cache precision, same weights, same run."""
    runners = {name: with_kv_dtype(runner, name) for name in kv_dtypes}
    vocab = runner.model.vocab_size
    print(
        f"# KV cache precision: decode step (ms) with {context}-token contexts, "
        f"{torch.get_num_threads()} threads; {source}; steps timed in turn, {_stat.__name__}"
    )
    base = kv_dtypes[0]
    head = " | ".join(f"{n:>8}" for n in kv_dtypes)
    ratios = " | ".join(f"{n + ' / ' + base:>16}" for n in kv_dtypes[1:])
    print(f"| {'batch':>5} | {head} | {ratios} | KV read per step (float32) |")
    print(f"|{'-' * 7}|" + "|".join("-" * 10 for _ in kv_dtypes) + "|"
          + "|".join("-" * 18 for _ in kv_dtypes[1:]) + f"|{'-' * 28}|")  # fmt: skip
    kv_token = runner.config.kv_shape("float32").kv_bytes_per_token
    for batch in batches:
        decoders = {n: OursDecode(r, batch, context, vocab) for n, r in runners.items()}
        ms = interleaved_ms({n: d.step for n, d in decoders.items()}, steps)
        cells = " | ".join(f"{ms[n]:8.2f}" for n in kv_dtypes)
        rel = " | ".join(f"{ms[n] / ms[base]:15.2f}x" for n in kv_dtypes[1:])
        kv_mb = kv_token * (context + 1) * batch / 1e6
        print(f"| {batch:>5} | {cells} | {rel} | {kv_mb:23.1f} MB |", flush=True)


def _hf_version() -> str:
    try:
        import transformers
    except ImportError:
        return "(not installed)"
    return str(transformers.__version__)


if __name__ == "__main__":
    main()
