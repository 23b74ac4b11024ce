"""The CUDA path measured: decode and prefill against rooflines measured in the same run, where
a decode step's time goes, serving in process with the GPU's busy time, and the real server
over HTTP.

    python -m benchmarks.bench_gpu                 # any CUDA machine with kvserve installed
    python -m benchmarks.bench_gpu --quick         # every headline figure, smaller counts
    python -m benchmarks.bench_gpu --sections probes,attention --out gpu.json
    python -m benchmarks.bench_gpu --dry-run       # the same code on CPU, tiny shapes (CI)

The model is Llama-3-8B-SHAPED with RANDOM weights in bf16 (32 layers, hidden 4096, 32 / 8
heads of 128, MLP 14336, vocab 128256): timings depend on shapes, not on values, and no
checkpoint download is needed. Generation is greedy with ``ignore_eos``, so every request
produces exactly its output length. Each section prints its table as soon as it is measured
and ``--out`` is rewritten after each, so a run cut short keeps what came before; ``--sections``
picks some (the probes always run: the others are measured against them). Sections:

1. **probes**: device copy bandwidth (``dst.copy_(src)`` of a large buffer, read + write
   bytes) and matmul peak (a square GEMM in the model's dtype), best of a few runs.
2. **attention**: the Triton paged decode kernel alone (no model), at batch 1 / 32 / 256 x
   512 and 8,192 keys on scattered pages: GB/s of KV read against the copy bandwidth, each
   timed as CUDA-graph replays over enough page sets to overflow the L2 cache, checked
   against a torch reference; then a sweep of tile and launch configurations at the two
   shapes the targets name (batch 256 x 512, batch 1 x 8,192).
3. **decode**: step time at batch 1 / 32 / 128 / 256 with every request at the same
   context, against the HBM roofline (weights + KV read once per step / copy bandwidth) and,
   for the compute-bound batches, against the matmul peak (linear and attention FLOPs).
4. **prefill**: one step of several fresh prompts, FLOPs / time against the matmul peak.
5. **profile**: torch.profiler over a few decode steps at batch 1 and 256: the kernels that
   took the most GPU time, each with its share of the step (``gpu/step.py``: ``profile_decode``).
6. **serving**: chat128-like traffic (128-token prompts, 128 output tokens) from 1 / 32 / 256
   closed-loop users through the engine's three-call step (``schedule``, ``execute``,
   ``update``, in process): output tok/s, and the GPU's busy fraction (each step's forward
   timed by CUDA events, over the wall); with ``--transformers`` also transformers'
   ``generate()`` on static batches of the same size on the same prompts, same GPU, same run.
7. **server**: the same traffic through ``kvserve serve --device cuda`` over HTTP, driven by
   the load tester (``gpu/server.py``): output tok/s against the closed loop's.

``--quick`` keeps every headline figure (the decode kernel at 1 x 8,192 keys, decode at batch
1 and 256, the profile, serving and the server at 256 users) with fewer cases and steps.
``--dry-run`` shrinks every shape (a 2-layer model in fp32 on CPU, the attention kernel in
Triton's interpreter, the server on CPU) and runs the same code, so CI proves the program
runs; its figures mean nothing. The sections are ``benchmarks/gpu/sections.py``, in the one
registry with the CPU ones (``benchmarks.harness.registry``); their sizes are
``benchmarks.harness.sizes`` (``FULL``, ``QUICK``, ``DRY``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Sequence

import torch

from benchmarks.harness import registry
from benchmarks.harness.context import Context
from benchmarks.harness.report import Report
from benchmarks.harness.sizes import SIZES
from model_runner.config import ATTENTION_BACKEND_CHOICES

SECTIONS = registry.names("gpu")  # in the order they run


def parse_sections(text: str) -> list[str]:
    """``--sections``: comma-separated names of ``SECTIONS`` (``all``: every one)."""
    try:
        return registry.parse_names(text, "gpu")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (CI)")
    parser.add_argument(
        "--quick", action="store_true", help="every headline figure, fewer cases and steps"
    )
    parser.add_argument(
        "--transformers", action="store_true",
        help="serving also runs transformers' static batches (always in the dry run)",
    )  # fmt: skip
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --dry-run)")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES)
    parser.add_argument(
        "--sections", type=parse_sections, default=list(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all)",
    )  # fmt: skip
    parser.add_argument("--out", default=None, help="write the report as JSON here (per section)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    if device.type != "cuda" and "attention" in args.sections:
        # Triton runs off CUDA only in its interpreter; read when its kernels are decorated.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    def save(report: Report) -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report.as_json(), f, indent=2)

    size = "dry" if args.dry_run else "quick" if args.quick else "full"
    sizes = SIZES[size]
    if args.transformers:
        sizes = dataclasses.replace(sizes, transformers=True)
    ctx = Context("gpu", size, sizes, save=save, device=str(device),
                  attention_backend=args.attention_backend)  # fmt: skip
    ctx.report.header = {"device": str(device), "dtype": sizes.dtype,
                         "attention_backend": args.attention_backend}  # fmt: skip
    ctx.emit(f"device {device}, {sizes.dtype}")
    registry.run(ctx, args.sections)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
