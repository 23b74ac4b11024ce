"""kvserve's quantized matmul against ggml's, op by op, in one run (the `kernels` section).

    python -m benchmarks.bench_kernels                    # every type, ggml's perf shapes
    python -m benchmarks.bench_kernels --types q4_K --ns 1,8 --seconds 0.5
    python -m benchmarks.bench_kernels --quick --ggml off  # a smoke run (wiring, not figures)

1. **Op level, ggml's own shapes.** ggml: ``test-backend-ops perf -b CPU -o MUL_MAT`` from the
   llama.cpp build that makes ``llama-server`` (``benchmarks/bench_llama_cpp.py``:
   ``-DLLAMA_BUILD_TESTS=ON``, target ``test-backend-ops``), at its perf shape, m = 4096 weight
   rows, k = 14336, n tokens in 1, 2, 3, 4, 5, 8, 512, f32 activations. It runs
   ``max(1, hardware_concurrency / 2)`` threads (no flag), so kvserve runs the same count here,
   and the table says which. kvserve: ``QLinear`` on a weight of the same type and shape (random
   blocks with valid scales: the kernels' speed does not depend on the values), fp32 in and
   out, timed like ggml's (warm-up, then repeated for at least ``--seconds``), with both
   activation precisions: 16 bits (int8 + residual byte, the default) and int8 (ggml's
   precision). Per type, ggml's cases and kvserve's run back to back.
2. **M = 1 on a matrix larger than the last-level cache**, at 1 and 2 threads: the weight bytes
   read per second against the read bandwidth measured in the same process
   (``kv_stream_read``: each thread streams a contiguous slice, as the kernels do), the two
   measurements interleaved.

Both sides read the same weights call after call (ggml duplicates the op over one weight), so
at small n a matrix that fits the cache measures the core, not memory: at 4096 x 14336 only
Q4_0 / Q4_K (about 33 MB) come near the 32 MB L3 of the machines here.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# ggml's perf shape (make_test_cases_perf in tests/test-backend-ops.cpp).
M_ROWS, K_COLS = 4096, 14336
NS = (1, 2, 3, 4, 5, 8, 512)
# The formats, by ggml's type names.
TYPES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K")
TARGETS = {1: 1.2, 8: 1.5, 512: 1.2}  # kvserve / ggml, issue 31
TARGET_READ_FRACTION = 0.85  # M = 1 at 2 threads, of the read bandwidth


def kvserve_format(ggml_type: str) -> str:
    return ggml_type.upper()


def ggml_threads() -> int:
    """test-backend-ops' thread count: max(1, hardware_concurrency / 2)."""
    return max(1, (os.cpu_count() or 1) // 2)


# ------------------------------------------------------------------ ggml


_LINE = re.compile(
    r"MUL_MAT\(type_a=(?P<type>\w+),type_b=f32,m=(?P<m>\d+),n=(?P<n>\d+),k=(?P<k>\d+),.*?\):"
    r"\s+(?P<runs>\d+) runs -\s+(?P<us>[\d.]+) us/run"
)


def parse_ggml(text: str) -> dict[tuple[str, int], float]:
    """``test-backend-ops perf`` console lines -> {(type, n): microseconds per run} (MUL_MAT at
    the perf shape only)."""
    out: dict[tuple[str, int], float] = {}
    for match in _LINE.finditer(text):
        if int(match["m"]) == M_ROWS and int(match["k"]) == K_COLS:
            out[(match["type"], int(match["n"]))] = float(match["us"])
    return out


def run_ggml(
    binary: Path, ggml_type: str, ns: tuple[int, ...], timeout_s: float
) -> dict[int, float]:
    """ggml's microseconds per MUL_MAT of ``ggml_type`` at each n (only the shapes asked)."""
    pattern = f"type_a={ggml_type},type_b=f32,m={M_ROWS},n=({'|'.join(map(str, ns))}),k={K_COLS},"
    cmd = [str(binary), "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", pattern]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"test-backend-ops exited {done.returncode}: {' | '.join(tail)}")
    found = parse_ggml(done.stdout)
    return {n: found[(ggml_type, n)] for n in ns if (ggml_type, n) in found}


def find_test_backend_ops(mode: str) -> tuple[Path | None, str]:
    """The binary beside the cached llama-server (``mode``: build, cached, off), or None and
    why not."""
    from benchmarks import bench_llama_cpp

    if mode == "off":
        return None, "--ggml off"
    cache_dir = bench_llama_cpp.default_cache_dir(os.environ)
    tools = bench_llama_cpp.ensure_tools(cache_dir, build=mode == "build")
    path = tools.get("test-backend-ops")
    if path is None:
        return None, f"no test-backend-ops in {cache_dir / 'bin'}"
    return path, ""


# ------------------------------------------------------------------ kvserve


# Byte offsets of each format's fp16 scales in a block, and a range of values that makes
# finite, ordinary weights (the mins of Q4_1 / Q5_1 negative, as real files have them).
_SCALES = {
    "Q4_0": ((0, 0.002, 0.02),), "Q4_1": ((0, 0.002, 0.02), (2, -0.1, -0.01)),
    "Q5_0": ((0, 0.002, 0.02),), "Q5_1": ((0, 0.002, 0.02), (2, -0.1, -0.01)),
    "Q8_0": ((0, 0.002, 0.02),), "Q4_K": ((0, 0.002, 0.02), (2, 0.002, 0.02)),
    "Q5_K": ((0, 0.002, 0.02), (2, 0.002, 0.02)), "Q6_K": ((208, 0.002, 0.02),),
}  # fmt: skip


def random_weight(fmt: str, n: int, k: int, seed: int = 0) -> object:
    """A ``QuantWeight`` of random blocks of ``fmt`` with valid fp16 scales."""
    from model_runner import quant

    spec = quant.FORMATS[fmt]
    rng = np.random.default_rng(seed)
    nb = k // spec.block
    raw = rng.integers(0, 256, (n, nb, spec.block_bytes), dtype=np.uint8)
    for lo, a, b in _SCALES[fmt]:
        raw[..., lo : lo + 2] = rng.uniform(a, b, (n, nb, 1)).astype(np.float16).view(np.uint8)
    return quant.QuantWeight.from_blocks(raw.reshape(n, -1), fmt, (n, k))


def time_call(fn: object, seconds: float, windows: int = 3) -> float:
    """Microseconds per call: one warm-up call, then ``windows`` windows of calls for at
    least ``seconds / windows`` each (at least 2 calls), the best window's mean (on a shared
    machine the best window is the one another process disturbed least)."""
    fn()  # type: ignore[operator]
    best = math.inf
    for _ in range(windows):
        reps, start = 0, time.perf_counter()
        while True:
            fn()  # type: ignore[operator]
            reps += 1
            elapsed = time.perf_counter() - start
            if elapsed >= seconds / windows and reps >= 2:
                break
        best = min(best, elapsed / reps * 1e6)
    return best


def run_kvserve(
    fmt: str, ns: tuple[int, ...], bits: int, threads: int, seconds: float, weight: object
) -> dict[int, float]:
    """kvserve's microseconds per matmul at each n."""
    import torch

    from model_runner.quant import QLinear

    torch.set_num_threads(threads)
    lin = QLinear(weight, None, bits)  # type: ignore[arg-type]
    out: dict[int, float] = {}
    for n in ns:
        x = torch.randn(n, K_COLS, generator=torch.Generator().manual_seed(n))
        out[n] = time_call(lambda x=x: lin(x), seconds)
    return out


# ------------------------------------------------------------------ bandwidth


def llc_bytes() -> int:
    """The last-level cache's size (sysfs), or 32 MiB when it cannot be read."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best or 32 << 20


@dataclass(slots=True)
class Bandwidth:
    fmt: str
    threads: int
    weight_bytes: int
    kernel_gb_s: float
    read_gb_s: float

    @property
    def fraction(self) -> float:
        return self.kernel_gb_s / self.read_gb_s


def measure_bandwidth(fmt: str, threads: int, seconds: float, rounds: int = 3) -> Bandwidth:
    """M = 1 over a weight of about 3x the LLC, against kv_stream_read on as many bytes,
    interleaved ``rounds`` times (best of each: the machine is shared)."""
    import torch

    from model_runner import kernels
    from model_runner.quant import QLinear

    lib = kernels.load()
    assert lib is not None
    from model_runner.quant import FORMATS

    spec = FORMATS[fmt]
    row_bytes = K_COLS // spec.block * spec.block_bytes
    weight = random_weight(fmt, -(-3 * llc_bytes() // row_bytes + 7) // 8 * 8, K_COLS, seed=7)
    nbytes = weight.nbytes  # type: ignore[attr-defined]
    buf = np.ones(nbytes // 64 * 64 // 8, dtype=np.uint64)
    torch.set_num_threads(threads)
    lin = QLinear(weight, None)  # type: ignore[arg-type]
    x = torch.randn(1, K_COLS)
    ptr = buf.ctypes.data_as(ctypes.c_void_p)
    best_kernel = best_read = math.inf
    for _ in range(rounds):
        best_kernel = min(best_kernel, time_call(lambda: lin(x), seconds / rounds, 1))
        read = time_call(lambda: lib.kv_stream_read(ptr, buf.nbytes, threads), seconds / rounds, 1)
        best_read = min(best_read, read)
    return Bandwidth(fmt, threads, nbytes, nbytes / best_kernel / 1e3, buf.nbytes / best_read / 1e3)


# ------------------------------------------------------------------ the run


@dataclass(slots=True)
class TypeResult:
    type: str
    threads: int
    ggml_us: dict[int, float] = field(default_factory=dict)
    kv16_us: dict[int, float] = field(default_factory=dict)
    kv8_us: dict[int, float] = field(default_factory=dict)
    ggml_error: str = ""


def gflops(n: int, us: float) -> float:
    return 2.0 * M_ROWS * K_COLS * n / us / 1e3


def _best(into: dict[int, float], new: dict[int, float]) -> None:
    for n, us in new.items():
        into[n] = min(into.get(n, math.inf), us)


def run(
    types: tuple[str, ...] = TYPES,
    ns: tuple[int, ...] = NS,
    seconds: float = 1.0,
    ggml: str = "cached",
    bandwidth: bool = True,
    rounds: int = 2,
    say: object = print,
) -> dict[str, object]:
    """Every type's cases on both sides, ``rounds`` times in turn (ggml, kvserve 16-bit,
    kvserve int8; the best of each: the machine is shared), then the bandwidth rows; a
    JSON-able dict."""
    threads = ggml_threads()
    binary, why = find_test_backend_ops(ggml)
    results: list[TypeResult] = []
    for t in types:
        fmt = kvserve_format(t)
        res = TypeResult(t, threads, ggml_error=why)
        weight = random_weight(fmt, M_ROWS, K_COLS)
        for r in range(rounds):
            if binary is not None and not (r and res.ggml_error):
                say(f"[kernels] round {r + 1}: ggml {t}, n = {', '.join(map(str, ns))}")  # type: ignore[operator]
                try:
                    _best(res.ggml_us, run_ggml(binary, t, ns, timeout_s=120 + 30 * len(ns)))
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                    res.ggml_error = str(e)
            say(f"[kernels] round {r + 1}: kvserve {fmt}")  # type: ignore[operator]
            _best(res.kv16_us, run_kvserve(fmt, ns, 16, threads, seconds, weight))
            _best(res.kv8_us, run_kvserve(fmt, ns, 8, threads, seconds, weight))
        results.append(res)
    rows: list[Bandwidth] = []
    if bandwidth:
        for fmt in ("Q4_K", "Q4_0"):
            for th in sorted({1, 2} & set(range(1, (os.cpu_count() or 1) + 1))):
                say(f"[kernels] M = 1 bandwidth, {fmt}, {th} threads")  # type: ignore[operator]
                rows.append(measure_bandwidth(fmt, th, 3 * seconds))
    return {
        "threads": threads,
        "shape": {"m": M_ROWS, "k": K_COLS},
        "ggml": str(binary) if binary else f"not measured ({why})",
        "types": [asdict(r) for r in results],
        "bandwidth": [asdict(b) | {"fraction": b.fraction} for b in rows],
    }


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def format_tables(report: dict[str, object]) -> str:
    """A table per type (GFLOPS at each n, kvserve / ggml) and the bandwidth rows."""
    lines = [
        f"Quantized matmul, m = {M_ROWS}, k = {K_COLS}, {report['threads']} thread(s) on both "
        f"sides (test-backend-ops takes hardware_concurrency / 2); ggml: {report['ggml']}.",
        "GFLOPS; kv16 = kvserve with 16-bit activations (int8 + residual byte, the default), "
        "kv8 = kvserve with int8 activations (ggml's precision).",
        "",
        "| type | n | ggml | kv16 | kv8 | kv16 / ggml | kv8 / ggml | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["types"]:  # type: ignore[attr-defined]
        for n_key in r["kv16_us"]:
            n = int(n_key)
            g = r["ggml_us"].get(n_key) if r["ggml_us"] else None
            cells = [
                gflops(n, us) if us else None
                for us in (g, r["kv16_us"][n_key], r["kv8_us"].get(n_key))
            ]
            shown = [f"{c:.1f}" if c else "–" for c in cells]
            target = f">= {TARGETS[n]}x" if n in TARGETS else ""
            lines.append(
                f"| {r['type']} | {n} | {shown[0]} | {shown[1]} | {shown[2]} | "
                f"{_ratio(cells[1], cells[0])} | {_ratio(cells[2], cells[0])} | {target} |"
            )
        if r["ggml_error"]:
            lines.append(f"| {r['type']} | | ggml not measured: {r['ggml_error']} | | | | | |")
    if report["bandwidth"]:
        lines += [
            "",
            "M = 1 over a weight of ~3x the LLC (kvserve, 16-bit activations) against the read "
            "bandwidth of the same process (kv_stream_read), best of 3 interleaved rounds:",
            "",
            "| type | threads | weight MB | kvserve GB/s | read GB/s | fraction | target |",
            "|---|---|---|---|---|---|---|",
        ]
        for b in report["bandwidth"]:  # type: ignore[attr-defined]
            target = f">= {TARGET_READ_FRACTION:.0%}" if b["threads"] == 2 else ""
            lines.append(
                f"| {b['fmt']} | {b['threads']} | {b['weight_bytes'] / 1e6:.0f} | "
                f"{b['kernel_gb_s']:.1f} | {b['read_gb_s']:.1f} | {b['fraction']:.0%} | {target} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_kernels", description=__doc__.splitlines()[0]
    )
    p.add_argument("--types", default=",".join(TYPES), help="ggml type names, comma-separated")
    p.add_argument("--ns", default=",".join(map(str, NS)), help="token counts n")
    p.add_argument("--seconds", type=float, default=1.0, help="kvserve's time per case")
    p.add_argument("--ggml", choices=("build", "cached", "off"), default="cached")
    p.add_argument("--rounds", type=int, default=2, help="turns per type (best of each side)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the M = 1 bandwidth rows")
    p.add_argument("--quick", action="store_true", help="q4_0 and q4_K at n = 1, 8; 0.05 s")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    types = tuple(args.types.split(","))
    ns = tuple(int(v) for v in args.ns.split(","))
    seconds = args.seconds
    rounds = args.rounds
    if args.quick:
        types, ns, seconds, rounds = ("q4_0", "q4_K"), (1, 8), 0.05, 1
    unknown = [t for t in types if t not in TYPES]
    if unknown:
        p.error(f"unknown types {unknown}: use {', '.join(TYPES)}")
    report = run(types, ns, seconds, args.ggml, not args.no_bandwidth and not args.quick, rounds,
                 say=lambda m: print(m, file=sys.stderr, flush=True))  # fmt: skip
    print(format_tables(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
