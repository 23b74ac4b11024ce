"""M = 1 at the real models' shapes, from DRAM, against the machine's own read bandwidth (the
``kernels`` section's second table; issue 48's yardstick).

    python -m benchmarks.bench_shapes                    # every shape, 1 and 2 threads
    python -m benchmarks.bench_shapes --only 1B --seconds 2

test-backend-ops times one shape (4096 x 14336, about 33 MB in Q4_K), and its weight is read
call after call, so on a machine with a large LLC it is partly cache-resident. A decode step
reads each of the model's matrices once, from DRAM, at the model's row lengths. So here each
matrix of kvserve's fused layout (``qkv``, ``o``, ``gate_up``, ``down``, the LM head) is
timed at n = 1 with its weight rotated over copies that add up to ``8 x`` the LLC (at least
512 MiB, at most 4 GiB), so every call reads its bytes from memory. Beside each figure, the
read bandwidth of the same process over as many bytes (``kv_stream_read``: each thread a
contiguous slice, as the kernels read), the two interleaved (best of each: the machine is
shared).

ggml has no figure at these shapes: test-backend-ops runs only its own perf shapes. Its
whole-model peer is llama-bench's tg in the ``models`` section. ``--whole-rows`` adds, beside
each row, the same records held as whole rows (the layout before panels: interleave.py),
interleaved in the same passes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks.bench_kernels import llc_bytes, random_weight

# (model, matrix, format, rows m, columns k) of kvserve's fused matrices, Q4_K_M as llama.cpp
# quantizes it (Q4_K matrices, a Q6_K LM head; some layers' down and v are Q6_K there too).
SHAPES = (
    ("1B", "qkv", "Q4_K", 3072, 2048),  # Llama-3.2-1B: hidden 2048, 32 / 8 heads of 64
    ("1B", "o", "Q4_K", 2048, 2048),
    ("1B", "gate_up", "Q4_K", 16384, 2048),
    ("1B", "down", "Q4_K", 2048, 8192),
    ("1B", "lm_head", "Q6_K", 128256, 2048),
    ("3B", "qkv", "Q4_K", 5120, 3072),  # Llama-3.2-3B: hidden 3072, 24 / 8 heads of 128
    ("3B", "o", "Q4_K", 3072, 3072),
    ("3B", "gate_up", "Q4_K", 16384, 3072),
    ("3B", "down", "Q4_K", 3072, 8192),
    ("3B", "lm_head", "Q6_K", 128256, 3072),
    ("8B", "qkv", "Q4_K", 6144, 4096),  # Llama-3.1-8B: hidden 4096, 32 / 8 heads of 128
    ("8B", "gate_up", "Q4_K", 28672, 4096),
    ("8B", "down", "Q4_K", 4096, 14336),
)
QUICK_SHAPES = (("1B", "o", "Q4_K", 2048, 2048),)
MIN_BYTES, MAX_BYTES = 512 << 20, 4 << 30
LLC_MULTIPLE = 8


@dataclass(slots=True)
class ShapeRow:
    model: str
    matrix: str
    fmt: str
    m: int
    k: int
    threads: int
    weight_bytes: int
    copies: int
    us: float
    kernel_gb_s: float
    read_gb_s: float
    load_avg: float  # the 1-minute load average when the row was taken
    layout: str = "panels"  # as the model loads it, or "whole rows" (--whole-rows)

    @property
    def fraction(self) -> float:
        return self.kernel_gb_s / self.read_gb_s


def rotation_bytes(quick: bool = False) -> int:
    """The bytes a shape's copies add up to: 8 x the LLC within [512 MiB, 4 GiB]."""
    if quick:
        return 32 << 20
    return min(MAX_BYTES, max(MIN_BYTES, LLC_MULTIPLE * llc_bytes()))


def rotated_linears(
    fmt: str, m: int, k: int, total: int, whole_rows: bool = False
) -> tuple[int, list[object]]:
    """(bytes of one copy, a ``QLinear`` per copy): one random ``fmt`` weight and clones of its
    records, as many as add up to ``total`` bytes (at least 2), so that calling them in turn
    reads every weight from DRAM; ``whole_rows``: held as whole rows, not in panels."""
    from model_runner.quant import QLinear, QuantWeight

    first = random_weight(fmt, m, k, seed=m + k)
    nbytes = first.nbytes  # type: ignore[attr-defined]
    records = first.grouped() if whole_rows else first.records  # type: ignore[attr-defined]
    copies = max(2, -(-total // nbytes))
    weights = [QuantWeight(fmt, records.clone(), m, k, fmt) for _ in range(copies)]
    return nbytes, [QLinear(w, None) for w in weights]


def _best_pass_s(fn: object, passes: int) -> float:
    """The fastest of ``passes`` calls of ``fn`` (after one warm-up), in seconds."""
    fn()  # type: ignore[operator]
    best = math.inf
    for _ in range(passes):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def run(
    shapes: tuple[tuple[str, str, str, int, int], ...] = SHAPES,
    threads: tuple[int, ...] = (1, 2),
    passes: int = 3,
    quick: bool = False,
    say: object = print,
    whole_rows: bool = False,
) -> dict[str, object]:
    """Every shape at each thread count; a JSON-able dict."""
    from model_runner import kernels

    if kernels.load() is None:
        return {"error": f"kernels unavailable ({kernels.unavailable_reason()})", "rows": []}
    threads = tuple(t for t in threads if t <= (os.cpu_count() or 1))
    total = rotation_bytes(quick)
    buf = np.ones(total // 64 * 64 // 8, dtype=np.uint64)
    rows: list[ShapeRow] = []
    for shape in shapes:
        rows += _measure(shape, total, threads, passes, buf, say, whole_rows)
    from loadtest.launch import cpu_model

    return {
        "cpu": cpu_model(),
        "tuning": kernels.tuning(),
        "tuning_source": kernels.tuning_source(),
        "llc_bytes": llc_bytes(),
        "rotation_bytes": total,
        "rows": [asdict(r) | {"fraction": r.fraction} for r in rows],
    }


def _measure(
    shape: tuple[str, str, str, int, int],
    total: int,
    threads: tuple[int, ...],
    passes: int,
    buf: np.ndarray,
    say: object,
    whole_rows: bool = False,
) -> list[ShapeRow]:
    """One shape's rows: its copies built, then at each thread count the rotation (and the
    whole-rows one) and the read probe interleaved ``passes`` times."""
    import torch

    from model_runner import kernels

    lib = kernels.load()
    assert lib is not None
    model, matrix, fmt, m, k = shape
    nbytes, lins = rotated_linears(fmt, m, k, total)
    layouts = {"panels": lins} | (
        {"whole rows": rotated_linears(fmt, m, k, total, True)[1]} if whole_rows else {}
    )
    copies = len(lins)
    say(f"[kernels] {model} {matrix} {fmt} {m} x {k}: {copies} x {nbytes / 1e6:.1f} MB")  # type: ignore[operator]
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k))
    span = nbytes * copies
    read_bytes = min(buf.nbytes, span // 64 * 64)
    ptr = buf.ctypes.data_as(ctypes.c_void_p)

    def rotation(lins: list[object]) -> object:
        def rotate() -> None:
            for lin in lins:
                lin(x)  # type: ignore[operator]

        return rotate

    rows = []
    for th in threads:
        torch.set_num_threads(th)

        def read(th: int = th) -> None:
            lib.kv_stream_read(ptr, read_bytes, th)

        kernel_s = dict.fromkeys(layouts, math.inf)
        read_s = math.inf
        for _ in range(passes):  # interleaved: one pass of each, best of each
            for name, held in layouts.items():
                kernel_s[name] = min(kernel_s[name], _best_pass_s(rotation(held), 1))
            read_s = min(read_s, _best_pass_s(read, 1))
        for name, best in kernel_s.items():
            rows.append(ShapeRow(model, matrix, fmt, m, k, th, nbytes, copies,
                                 best / copies * 1e6, span / best / 1e9,
                                 read_bytes / read_s / 1e9, round(os.getloadavg()[0], 2),
                                 name))  # fmt: skip
    return rows


def format_table(report: dict[str, object]) -> str:
    if report.get("error"):
        return f"Real shapes: not measured ({report['error']})."
    lines = [
        f"M = 1 at the real models' shapes, kvserve (16-bit activations), each weight rotated "
        f"over copies adding up to {report['rotation_bytes'] / 2**20:.0f} MiB (LLC "  # type: ignore[operator]
        f"{report['llc_bytes'] / 2**20:.0f} MiB), against kv_stream_read over as many bytes "  # type: ignore[operator]
        "at the same threads, interleaved, best of each; ggml: no figure at these shapes "
        f"(test-backend-ops runs its own); CPU: {report.get('cpu', 'unknown')}; kernel tuning: "
        f"{report.get('tuning')} ({report.get('tuning_source')}); load: the "
        "1-minute load average as each row was taken (the run's own threads count):",
        "",
        "| model | matrix | type | m x k | MB | layout | threads | us | kvserve GB/s "
        "| read GB/s | fraction | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:  # type: ignore[attr-defined]
        lines.append(
            f"| {r['model']} | {r['matrix']} | {r['fmt']} | {r['m']} x {r['k']} | "
            f"{r['weight_bytes'] / 1e6:.1f} | {r.get('layout', 'panels')} | {r['threads']} | "
            f"{r['us']:.0f} | "
            f"{r['kernel_gb_s']:.1f} | {r['read_gb_s']:.1f} | {r['fraction']:.0%} | "
            f"{r['load_avg']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_shapes", description=__doc__.splitlines()[0]
    )
    p.add_argument("--only", default="", help="models to run (1B,3B,8B); default all")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--passes", type=int, default=3, help="interleaved passes (best of each)")
    p.add_argument("--quick", action="store_true", help="one small shape, 32 MiB (wiring)")
    p.add_argument("--whole-rows", action="store_true",
                   help="each shape also as whole rows (before panels), interleaved")  # fmt: skip
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.only:
        shapes = tuple(s for s in shapes if s[0] in args.only.split(","))
    report = run(shapes, tuple(int(t) for t in args.threads.split(",")), args.passes,
                 args.quick, say=lambda m: print(m, file=sys.stderr, flush=True),
                 whole_rows=args.whole_rows)  # fmt: skip
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
