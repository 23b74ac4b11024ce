"""One command for a GPU machine: install what it lacks, run the CUDA tests and ``bench_gpu``,
write the figures as JSON, in about 8 minutes.

    python -m benchmarks.gpu_check wheels               # here, with PyPI: fills .gpu-wheels/
    python -m benchmarks.gpu_check run --out-dir DIR    # there, from the repository root
    make gpu-wheels / make gpu-check                    # the same two

The GPU machine this is made for has torch, triton, transformers and pytest but no network
and none of kvserve's other pure-Python dependencies. ``wheels`` downloads those (the versions
installed here, for CPython 3.12 on manylinux x86-64, without their dependencies, which the
machine has) into the git-ignored ``.gpu-wheels/``; a tool that copies the working tree to the
machine must be told to carry that folder. ``run`` installs them into a temporary folder on
``PYTHONPATH`` when the folder is there, then runs the steps below in order, each under a
timeout cut from one time budget (a step that would get under ``MIN_STEP_S`` is skipped), and
rewrites ``summary.json`` after each step, so a run cut short keeps what came before:

1. ``kernels``: the attention backends' tests, the Triton kernels compiled (not interpreted);
2. ``attention``: ``bench_gpu --sections probes,attention`` (the decode kernel alone, GB/s);
3. ``bench-triton``: decode, prefill and serving on the Triton backend (CUDA graphs);
4. ``cuda-tests``: greedy tokens against transformers per backend, graph replay, sampler sync;
5. ``bench-torch``: decode and prefill on the torch reference backend, for the comparison.

``summary.json`` holds each step's exit status, time and test counts, and the targets of issue
32 (``targets``) read from the benchmark reports beside it; ``steps.log`` every step's output.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEEL_DIR = ROOT / ".gpu-wheels"
# kvserve's dependencies that the GPU image lacks (read off its package list, 2026-11).
GPU_WHEELS = (
    "gguf",
    "lmdb",
    "llguidance",
    "starlette",
    "uvicorn",
    "pytest-asyncio",
    "grpcio-health-checking",
    "grpcio-reflection",
)
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
BUDGET_S = 450
MIN_STEP_S = 30
KERNEL_TESTS = ("tests/model_runner/attention_backends",)
CUDA_TESTS = (
    "tests/model_runner/test_gpu_correctness.py",
    "tests/model_runner/test_cuda_graphs.py",
    "tests/model_runner/test_sampler_sync.py",
)


# ---------------------------------------------------------------------------- wheels (here)


def pinned_requirements(names: Sequence[str] = GPU_WHEELS) -> list[str]:
    """``name==version`` of each package as installed in this environment."""
    return [f"{name}=={importlib.metadata.version(name)}" for name in names]


def download_command(requirements: Sequence[str], dest: Path, python_version: str) -> list[str]:
    """``pip download`` of ``requirements`` as binary wheels for CPython ``python_version`` on
    manylinux x86-64, without dependencies."""
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, "-d", str(dest), *requirements]


def wheels(dest: Path, python_version: str) -> int:
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.glob("*.whl"):  # one version of each: two would stop the install there
        old.unlink()
    requirements = pinned_requirements()
    subprocess.run(download_command(requirements, dest, python_version), check=True)
    found = sorted(p.name for p in dest.glob("*.whl"))
    size = sum(p.stat().st_size for p in dest.glob("*.whl"))
    print(f"{len(found)} wheels, {size / 2**20:.1f} MiB in {dest}:", *found, sep="\n  ")
    return 0


# ---------------------------------------------------------------------------- the run (there)


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    argv: tuple[str, ...]
    max_s: int  # its own cap; the budget left may cut it shorter


@dataclass(slots=True)
class StepResult:
    name: str
    command: str
    status: str  # "ok", "failed (rc N)", "timed out", "skipped (budget)"
    seconds: float = 0.0
    timeout_s: float = 0.0
    tests: dict[str, int] = field(default_factory=dict)


def plan_steps(out_dir: Path, python: str = sys.executable, xdist: bool = False) -> list[Step]:
    """The run's steps in order (see the module docstring)."""
    pytest = (python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider")
    if xdist:  # Triton compiles each kernel variant once per process: spread them
        pytest += ("-n", "8")
    bench = (python, "-m", "benchmarks.bench_gpu")

    def report(name: str) -> tuple[str, str]:
        return ("--out", str(out_dir / f"bench_{name}.json"))

    triton = ("--attention-backend", "triton", "--sections", "decode,prefill,serving")
    torch = ("--attention-backend", "torch", "--sections", "decode,prefill")
    return [
        Step("kernels", (*pytest, *KERNEL_TESTS), 180),
        Step(
            "attention",
            (*bench, "--sections", "probes,attention", *report("attention")),
            150,
        ),
        Step("bench-triton", (*bench, *triton, *report("triton")), 240),
        Step("cuda-tests", (*pytest, *CUDA_TESTS), 180),
        Step("bench-torch", (*bench, *torch, *report("torch")), 150),
    ]


def step_timeout(step: Step, elapsed_s: float, budget_s: float) -> float | None:
    """Seconds ``step`` may run: its cap, or what is left of the budget; None (skip it) when
    that is under ``MIN_STEP_S``."""
    left = min(step.max_s, budget_s - elapsed_s)
    return None if left < MIN_STEP_S else left


_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def pytest_counts(output: str) -> dict[str, int]:
    """pytest's closing counts (``3 passed, 1 failed in 9.1s``) from its output; {} if none."""
    for line in reversed(output.splitlines()):
        found = _COUNTS.findall(line)
        if found and (" in " in line or line.startswith("=")):
            return {("errors" if k.startswith("error") else k): int(n) for n, k in found}
    return {}


def _load(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def targets(attention: dict[str, Any], triton: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 32's goals against the reports (``bench_gpu`` JSON; {} where a step did not
    run): the decode kernel's share of the copy bandwidth at batch 256 x 512 and 1 x 8,192
    keys (its default configuration, and the best of the sweep), the decode step's share of
    the HBM roofline at batch 1 and 256, serving 256 users against transformers."""
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, goal: float) -> None:
        met = None if value is None else value >= goal
        rows.append({"target": name, "value": value, "goal": goal, "met": met})

    kernel = [r for r in attention.get("attention", []) if "error" not in r]
    for batch, keys in ((256, 512), (1, 8192)):
        cases = [r for r in kernel if (r["batch"], r["keys"]) == (batch, keys)]
        default = [r["of_copy_bandwidth"] for r in cases if r["config"] == "default"]
        add(f"kernel b{batch} x {keys}: of copy bandwidth", default[0] if default else None, 0.7)
        best = max(cases, key=lambda r: r["of_copy_bandwidth"], default=None)
        add(
            f"kernel b{batch} x {keys}: best config ({best['config'] if best else '-'})",
            best["of_copy_bandwidth"] if best else None,
            0.7,
        )
    decode = {d["batch"]: d["of_hbm_roofline"] for d in triton.get("decode", [])}
    add("decode step b1: of HBM roofline", decode.get(1), 0.7)
    add("decode step b256: of HBM roofline", decode.get(256), 0.5)
    serving = {s["users"]: s["ratio"] for s in triton.get("serving", [])}
    add("serving 256 users / transformers static", serving.get(256), 3.5)
    return rows


def install_wheels(wheel_dir: Path, site: Path) -> str:
    """Install every wheel of ``wheel_dir`` into ``site`` (no index, no deps); a line saying
    what happened."""
    found = sorted(wheel_dir.glob("*.whl"))
    if not found:
        return f"no wheels in {wheel_dir}: using what the machine has"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site)]
    subprocess.run([*cmd, *map(str, found)], check=True)
    return f"installed {len(found)} wheels from {wheel_dir} into {site}"


def _run_step(step: Step, timeout_s: float, env: dict[str, str], log: Path) -> StepResult:
    """Run ``step``, its output appended to ``log`` and to stdout line by line; past
    ``timeout_s`` kill its whole process group."""
    result = StepResult(step.name, " ".join(step.argv), "ok", timeout_s=round(timeout_s))
    t0 = time.monotonic()
    output: list[str] = []
    with open(log, "a") as f:
        f.write(f"=== {step.name}: {result.command}\n")
        proc = subprocess.Popen(
            step.argv, cwd=ROOT, env=env or None, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                output.append(line)
                f.write(line)
                f.flush()
                sys.stdout.write(line)
                sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            result.status = "timed out"
        reader.join(timeout=5)
    result.seconds = round(time.monotonic() - t0, 1)
    if result.status == "ok" and proc.returncode != 0:
        result.status = f"failed (rc {proc.returncode})"
    result.tests = pytest_counts("".join(output))
    return result


def format_summary(steps: Sequence[StepResult], goals: Sequence[dict[str, Any]]) -> str:
    lines = ["", "| step | status | s | tests |", "|---|---|---|---|"]
    for s in steps:
        tests = ", ".join(f"{n} {k}" for k, n in s.tests.items())
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {tests} |")
    lines += ["", "| target | value | goal | met |", "|---|---|---|---|"]
    for g in goals:
        value = "-" if g["value"] is None else f"{g['value']:.2f}"
        met = {True: "yes", False: "NO", None: "-"}[g["met"]]
        lines.append(f"| {g['target']} | {value} | {g['goal']:.2f} | {met} |")
    return "\n".join(lines)


def run(out_dir: Path, budget_s: float, wheel_dir: Path, steps: Sequence[str] | None) -> int:
    t0 = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="kvserve-site-"))
    installed = install_wheels(wheel_dir, site)
    print(installed, flush=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    env["PYTHONUNBUFFERED"] = "1"
    probe = subprocess.run(
        [sys.executable, "-c", "import xdist"], env=env, capture_output=True, check=False
    )
    plan = plan_steps(out_dir, xdist=probe.returncode == 0)
    results: list[StepResult] = []
    summary: dict[str, Any] = {"installed": installed, "budget_s": budget_s}
    for step in plan:
        if steps is not None and step.name not in steps:
            continue
        timeout = step_timeout(step, time.monotonic() - t0, budget_s)
        if timeout is None:
            results.append(StepResult(step.name, " ".join(step.argv), "skipped (budget)"))
        else:
            print(f"\n=== {step.name} (up to {timeout:.0f} s): {' '.join(step.argv)}", flush=True)
            results.append(_run_step(step, timeout, env, out_dir / "steps.log"))
        summary["steps"] = [asdict(r) for r in results]
        summary["targets"] = targets(
            _load(out_dir / "bench_attention.json"), _load(out_dir / "bench_triton.json")
        )
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(results, summary.get("targets", [])), flush=True)
    return 0 if all(r.status == "ok" for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("wheels", help="download the wheels the GPU machine lacks (needs PyPI)")
    w.add_argument("--dir", type=Path, default=WHEEL_DIR)
    w.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    r = sub.add_parser("run", help="on the GPU machine: install, test, benchmark")
    default_out = os.environ.get("OUT") or str(ROOT / "gpu-check")
    r.add_argument("--out-dir", type=Path, default=Path(default_out), help="default: $OUT")
    r.add_argument("--budget-s", type=float, default=BUDGET_S)
    r.add_argument("--wheels", type=Path, default=WHEEL_DIR)
    r.add_argument("--steps", default=None, help="comma-separated step names (default: all)")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        return wheels(args.dir, args.python_version)
    steps = None if args.steps is None else args.steps.split(",")
    return run(args.out_dir, args.budget_s, args.wheels, steps)


if __name__ == "__main__":
    raise SystemExit(main())
