"""One command for a GPU machine: install what it lacks, run the CUDA tests and ``bench_gpu``,
write the figures and issue 38's targets as JSON; 7 minutes at most (``--quick``: 3).

    python -m benchmarks.tools.gpu_check wheels             # here, with PyPI: fills .gpu-wheels/
    python -m benchmarks.tools.gpu_check run [--quick] [--out-dir DIR]  # there, the repo root
    make gpu-wheels / make gpu-check                        # the same two

The GPU machine this is made for has torch, triton, transformers and pytest but no network
and none of kvserve's other pure-Python dependencies. ``wheels`` downloads those (the versions
installed here, for CPython 3.12 on manylinux x86-64, without their dependencies, which the
machine has) into the git-ignored ``.gpu-wheels/``; a tool that copies the working tree to the
machine must be told to carry that folder. ``run`` installs them into a temporary folder on
``PYTHONPATH`` when the folder is there, then runs the steps below in order, each under a
timeout cut from one time budget (a step that would get under ``MIN_STEP_S`` is skipped), and
rewrites ``summary.json`` after each step, so a run cut short keeps what came before. Every
step shares one Triton cache (``TRITON_CACHE_DIR``, set once): the kernels a step compiles
are not compiled again by the next. Correctness first, then the benchmarks:

1. ``greedy``: greedy tokens against transformers per backend (fp32 equal, bf16 within
   logprobs), ``test_gpu_correctness.py``;
2. ``kernels`` (not in ``--quick``): the attention backends' and the layer fusions' tests
   with the Triton kernels compiled, CUDA-graph replay, the sampler's host copies; one
   process (no xdist: workers would each compile the same kernels);
3. ``attention``: ``bench_gpu --sections probes,attention`` (the decode kernel alone, GB/s);
4. ``bench-triton``: decode, prefill, the decode step's profile, closed-loop serving with
   the GPU's busy time, and ``kvserve serve`` over HTTP, on the Triton backend.

``--quick`` runs ``greedy`` and one ``bench_gpu --quick`` (every headline figure). The step
caps come from the H100 run of issue 38 (kernels timed out at 180 s with 8 xdist workers,
attention took 24 s, decode + serving 85 s) with the server added.

``summary.json`` holds each step's exit status, time and test counts, and ``targets``: issue
38's acceptance figures, each with ``measured``, ``target`` and ``holds`` (None where the
figure was not measured), read from the reports beside it; ``steps.log`` every step's output.
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

ROOT = Path(__file__).resolve().parents[2]
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
WALL_S, QUICK_WALL_S = 420, 180  # the whole run, wheel install included: 7 and 3 minutes
BUDGET_S, QUICK_BUDGET_S = 400, 170  # the steps' share of it
MIN_STEP_S = 30
GREEDY_TESTS = ("tests/model_runner/test_gpu_correctness.py",)
KERNEL_TESTS = (
    "tests/model_runner/attention_backends",
    "tests/model_runner/test_triton_fusions.py",
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


def plan_steps(out_dir: Path, python: str = sys.executable, quick: bool = False) -> list[Step]:
    """The run's steps in order (see the module docstring), each with its cap."""
    pytest = (python, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider")
    bench = (python, "-m", "benchmarks.bench_gpu")

    def report(name: str) -> tuple[str, str]:
        return ("--out", str(out_dir / f"bench_{name}.json"))

    triton = ("--attention-backend", "triton")
    if quick:
        sections = "attention,decode,profile,serving,server"
        return [
            Step("greedy", (*pytest, *GREEDY_TESTS), 45),
            Step("bench-quick", (*bench, "--quick", *triton, "--sections", sections,
                                 *report("quick")), 120),
        ]  # fmt: skip
    sections = "decode,prefill,profile,serving,server"
    return [
        Step("greedy", (*pytest, *GREEDY_TESTS), 90),
        Step("kernels", (*pytest, *KERNEL_TESTS), 150),
        Step("attention", (*bench, "--sections", "probes,attention", *report("attention")), 60),
        Step("bench-triton", (*bench, *triton, "--sections", sections, *report("triton")), 200),
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


def _merged(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first non-empty value of each key over ``reports`` (a full run's attention and
    triton reports, or the quick run's one)."""
    out: dict[str, Any] = {}
    for r in reports:
        for key, value in r.items():
            if value and not out.get(key):
                out[key] = value
    return out


def targets(
    reports: Sequence[dict[str, Any]],
    steps: Sequence[StepResult],
    wall_s: float,
    max_wall_s: float,
) -> list[dict[str, Any]]:
    """Issue 38's acceptance figures from the ``bench_gpu`` reports ({} where a step did not
    run), the steps and the run's wall time: each with ``measured``, ``op`` and ``target``,
    ``holds`` (None: not measured) and a note."""
    bench = _merged(reports)
    decode = {d["batch"]: d for d in bench.get("decode", [])}
    serving = {s["users"]: s for s in bench.get("serving", [])}
    server = {s["users"]: s for s in bench.get("server", [])}
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, op: str, goal: float, note: str = "",
            ok: bool = True) -> None:  # fmt: skip
        holds = None if value is None else ok and (value <= goal if op == "<=" else value >= goal)
        rows.append({"name": name, "measured": value, "op": op, "target": goal,
                     "holds": holds, "note": note})  # fmt: skip

    bad = [s.name for s in steps if s.status != "ok"]
    note = f"not ok: {', '.join(bad)}" if bad else f"{len(steps)} steps ok"
    add("every step ok, in s", wall_s if steps else None, "<=", max_wall_s, note, ok=not bad)

    greedy = next((s for s in steps if s.name == "greedy"), None)
    counts = greedy.tests if greedy is not None else {}
    failed = counts.get("failed", 0) + counts.get("errors", 0)
    add("greedy tokens equal transformers' (tests failed)",
        float(failed) if counts.get("passed") or failed else None, "<=", 0,
        ", ".join(f"{n} {k}" for k, n in counts.items()))  # fmt: skip

    b1, b256 = decode.get(1), decode.get(256)
    add("decode b1 at 512 keys: step ms", b1 and b1["step_ms"], "<=", 6.4)
    add("decode b1 at 512 keys: of HBM roofline", b1 and b1["of_hbm_roofline"], ">=", 0.80)
    add("decode b256 at 512 keys: of HBM roofline", b256 and b256["of_hbm_roofline"], ">=", 0.55)

    cases = [r for r in bench.get("attention", []) if "error" not in r]
    cases = [r for r in cases if (r["batch"], r["keys"]) == (1, 8192)]
    default = next((r["of_copy_bandwidth"] for r in cases if r["config"] == "default"), None)
    best = max(cases, key=lambda r: r["of_copy_bandwidth"], default=None)
    note = "" if best is None else f"best config {best['config']}: {best['of_copy_bandwidth']:.2f}"
    add("attention 1 x 8192 keys: of copy bandwidth", default, ">=", 0.80, note)

    loop = serving.get(256)
    ideal = None if b256 is None else 256 / (b256["step_ms"] / 1e3)
    share = None if loop is None or ideal is None else loop["kvserve_tok_s"] / ideal
    note = "" if share is None else f"{loop['kvserve_tok_s']:.0f} of {ideal:.0f} tok/s"
    add("serving 256 users: of 256 tokens per b256 step", share, ">=", 0.85, note)
    add("serving 256 users: GPU busy", loop and loop["gpu_busy"], ">=", 0.95)

    http = server.get(256)
    note = "" if http is None else f"{http['tok_s']:.0f} tok/s, {http['failed']} failed"
    add("kvserve serve over HTTP, 256 users: of the closed loop",
        http and http["of_closed_loop"], ">=", 0.8, note,
        ok=http is None or http["failed"] == 0)  # fmt: skip
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
    lines += ["", "| target | measured | target | holds | |", "|---|---|---|---|---|"]
    for g in goals:
        value = "-" if g["measured"] is None else f"{g['measured']:.2f}"
        holds = {True: "yes", False: "NO", None: "-"}[g["holds"]]
        lines.append(
            f"| {g['name']} | {value} | {g['op']} {g['target']:g} | {holds} | {g['note']} |"
        )
    return "\n".join(lines)


def triton_cache(env: dict[str, str]) -> str:
    """The one Triton cache every step uses: ``TRITON_CACHE_DIR`` if set, else a folder in
    the temp dir (kept between runs on the same machine)."""
    return env.get("TRITON_CACHE_DIR") or str(Path(tempfile.gettempdir()) / "kvserve-triton")


def run(
    out_dir: Path,
    budget_s: float,
    wheel_dir: Path,
    steps: Sequence[str] | None,
    quick: bool = False,
    plan: Sequence[Step] | None = None,
) -> int:
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
    env["TRITON_CACHE_DIR"] = triton_cache(env)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    if plan is None:
        plan = plan_steps(out_dir, quick=quick)
    results: list[StepResult] = []
    summary: dict[str, Any] = {
        "installed": installed, "budget_s": budget_s, "quick": quick,
        "triton_cache": env["TRITON_CACHE_DIR"],
    }  # fmt: skip
    names = ("attention", "triton", "quick")
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
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        reports = [_load(out_dir / f"bench_{n}.json") for n in names]
        max_wall = QUICK_WALL_S if quick else WALL_S
        summary["targets"] = targets(reports, results, summary["wall_s"], max_wall)
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
    r.add_argument("--quick", action="store_true", help="every headline figure in 3 minutes")
    r.add_argument("--budget-s", type=float, default=None,
                   help=f"default: {BUDGET_S:g} ({QUICK_BUDGET_S:g} with --quick)")  # fmt: skip
    r.add_argument("--wheels", type=Path, default=WHEEL_DIR)
    r.add_argument("--steps", default=None, help="comma-separated step names (default: all)")
    args = parser.parse_args(argv)
    if args.command == "wheels":
        return wheels(args.dir, args.python_version)
    steps = None if args.steps is None else args.steps.split(",")
    budget = args.budget_s or (QUICK_BUDGET_S if args.quick else BUDGET_S)
    return run(args.out_dir, budget, args.wheels, steps, quick=args.quick)


if __name__ == "__main__":
    raise SystemExit(main())
