"""The kernels' tuning knobs on this machine: each candidate setting timed at the real models'
shapes from DRAM, side by side (the ``kernels`` section's third table; issue 48 item 6).

    python -m benchmarks.bench_tuning                 # 1 and 2 threads, M = 1, 2, 4
    python -m benchmarks.bench_tuning --rows 1 --threads 1

The knobs (model_runner/kernels/cpu_tuning.py) change no result, only the speed, and which
values win depends on the machine: so this times the candidates below (the built-in defaults,
the CPU table's choice for this machine, and the two ways to differ from the defaults) at
rows of 2,048 to 14,336 values, each weight rotated over copies adding up to 8 x the LLC as
``bench_shapes`` does, the candidates interleaved pass by pass (best of each). The last
column names the fastest; where it is not the table's choice on most rows, the table wants a
row for this CPU (``CPU_TABLE``), or ``KVSERVE_KERNEL_TUNING`` can set it meanwhile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks.bench_shapes import rotated_linears, rotation_bytes

# (model, matrix, format, rows, columns): one of each row length, short to long.
SHAPES = (
    ("1B", "o", "Q4_K", 2048, 2048),
    ("1B", "lm_head/4", "Q6_K", 32064, 2048),  # a quarter of the head: the same rows, 54 MB
    ("3B", "o", "Q4_K", 3072, 3072),
    ("8B", "qkv", "Q4_K", 6144, 4096),
    ("1B", "down", "Q4_K", 2048, 8192),
    ("8B", "down", "Q4_K", 4096, 14336),
)
QUICK_SHAPES = (("1B", "o", "Q4_K", 2048, 2048),)


def candidates() -> dict[str, dict[str, int]]:
    """name -> knobs: the defaults, this CPU's table row, and one knob group off each."""
    from model_runner.kernels import cpu_tuning

    base = dict(cpu_tuning.DEFAULTS)
    table, _ = cpu_tuning.for_cpu(cpu_tuning.read_cpu())
    return {
        "defaults": base,
        "table": table,
        "one group, no prefetch": base
        | {"pair_min_mk": 1 << 40, "prefetch_ahead": 0, "prefetch_head": 0},
        "pairs, no prefetch": base | {"prefetch_ahead": 0, "prefetch_head": 0},
    }


def run(
    shapes: tuple[tuple[str, str, str, int, int], ...] = SHAPES,
    threads: tuple[int, ...] = (1, 2),
    rows: tuple[int, ...] = (1, 2, 4),
    passes: int = 3,
    quick: bool = False,
    say: object = print,
) -> dict[str, object]:
    """Each shape x threads x M, every candidate: a JSON-able dict."""
    import torch

    from loadtest.launch import cpu_model
    from model_runner import kernels

    if kernels.load() is None:
        return {"error": f"kernels unavailable ({kernels.unavailable_reason()})", "rows": []}
    threads = tuple(t for t in threads if t <= (os.cpu_count() or 1))
    cands = candidates()
    total = rotation_bytes(quick)
    before, before_threads = kernels.tuning(), torch.get_num_threads()
    out: list[dict[str, object]] = []
    try:
        for model, matrix, fmt, m, k in shapes:
            _, lins = rotated_linears(fmt, m, k, total)
            copies = len(lins)
            say(f"[tuning] {model} {matrix} {fmt} {m} x {k}: {copies} copies")  # type: ignore[operator]
            for th in threads:
                torch.set_num_threads(th)
                for n in rows:
                    x = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
                    best = {name: math.inf for name in cands}
                    for _ in range(passes):  # interleaved: one rotation of each, best of each
                        for name, knobs in cands.items():
                            kernels.tune(**knobs)
                            lins[0](x)
                            start = time.perf_counter()
                            for lin in lins:
                                lin(x)
                            best[name] = min(best[name], (time.perf_counter() - start) / copies)
                    out.append({
                        "model": model, "matrix": matrix, "fmt": fmt, "m": m, "k": k,
                        "threads": th, "rows": n, "load_avg": round(os.getloadavg()[0], 2),
                        "us": {name: s * 1e6 for name, s in best.items()},
                    })  # fmt: skip
    finally:
        kernels.tune(**before)
        torch.set_num_threads(before_threads)
    return {
        "cpu": cpu_model(),
        "candidates": cands,
        "table_source": kernels.tuning_source(),
        "rotation_bytes": total,
        "rows": out,
    }


def format_table(report: dict[str, object]) -> str:
    if report.get("error"):
        return f"Kernel tuning: not measured ({report['error']})."
    names = list(report["candidates"])  # type: ignore[call-overload]
    lines = [
        "Kernel tuning on this machine: microseconds per call from DRAM (weights rotated over "
        f"{report['rotation_bytes'] / 2**20:.0f} MiB), each candidate interleaved, best of "  # type: ignore[operator]
        f"each; CPU: {report['cpu']}; the table's choice here: {report['table_source']}. "
        "Candidates: "
        + "; ".join(f"{n}: {json.dumps(report['candidates'][n])}" for n in names)  # type: ignore[index]
        + ":",
        "",
        "| shape | m x k | threads | M | " + " | ".join(names) + " | fastest | load |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|",
    ]
    for r in report["rows"]:  # type: ignore[attr-defined]
        us = r["us"]
        fastest = min(us, key=us.get)
        cells = " | ".join(f"{us[n]:.0f}" for n in names)
        lines.append(
            f"| {r['model']} {r['matrix']} {r['fmt']} | {r['m']} x {r['k']} | {r['threads']} | "
            f"{r['rows']} | {cells} | {fastest} | {r['load_avg']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_tuning", description=__doc__.splitlines()[0]
    )
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", default="1,2,4", help="activation rows M")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one small shape, 32 MiB (wiring)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    report = run(
        QUICK_SHAPES if args.quick else SHAPES,
        tuple(int(t) for t in args.threads.split(",")),
        tuple(int(n) for n in args.rows.split(",")),
        args.passes,
        args.quick,
        say=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(format_table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
