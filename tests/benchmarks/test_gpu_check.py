"""gpu_check: its steps, budget, pytest counts, targets and summary, and a step's timeout."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.gpu_check import (
    MIN_STEP_S,
    PLATFORMS,
    Step,
    StepResult,
    _run_step,
    download_command,
    format_summary,
    plan_steps,
    pytest_counts,
    step_timeout,
    targets,
)


def test_steps_run_kernels_first_and_write_their_reports_under_the_out_dir(tmp_path: Path) -> None:
    """Kernel tests, the kernel benchmark, the Triton benchmark, the CUDA tests, the torch
    benchmark; each benchmark writes its JSON under the out dir; xdist spreads the tests."""
    steps = plan_steps(tmp_path, python="py", xdist=True)
    assert [s.name for s in steps] == [
        "kernels", "attention", "bench-triton", "cuda-tests", "bench-torch",
    ]  # fmt: skip
    assert steps[0].argv[:3] == ("py", "-m", "pytest") and "-n" in steps[0].argv
    assert "-n" not in plan_steps(tmp_path, python="py")[0].argv
    outs = [s.argv[s.argv.index("--out") + 1] for s in steps if "--out" in s.argv]
    assert outs == [str(tmp_path / f"bench_{n}.json") for n in ("attention", "triton", "torch")]
    assert steps[1].argv[steps[1].argv.index("--sections") + 1] == "probes,attention"
    assert sum(s.max_s for s in steps) > 450  # the budget, not the caps, bounds the run


def test_a_step_gets_its_cap_or_the_budget_left_or_is_skipped() -> None:
    """Its own cap while the budget allows, then what is left; under MIN_STEP_S, None."""
    step = Step("x", ("true",), 100)
    assert step_timeout(step, elapsed_s=0, budget_s=450) == 100
    assert step_timeout(step, elapsed_s=400, budget_s=450) == 50
    assert step_timeout(step, elapsed_s=450 - MIN_STEP_S + 1, budget_s=450) is None


def test_pytest_counts_read_the_closing_line() -> None:
    """The last summary line's counts; errors named alike; {} without one."""
    out = "x.py ..F\nFAILED x.py::t - boom\n36 passed, 1 failed, 3 skipped, 2 errors in 9.10s\n"
    assert pytest_counts(out) == {"passed": 36, "failed": 1, "skipped": 3, "errors": 2}
    assert pytest_counts("=== 1 error in 0.5s ===") == {"errors": 1}
    assert pytest_counts("Traceback: no tests ran") == {}


def test_targets_read_the_reports_and_say_what_is_missing() -> None:
    """Kernel shares at the two shapes (default and best of the sweep), decode shares at
    batch 1 and 256, serving at 256 users, each against its goal; absent figures are None."""
    attention = {
        "attention": [
            {"batch": 256, "keys": 512, "config": "default", "of_copy_bandwidth": 0.75},
            {"batch": 256, "keys": 512, "config": "64/4/2", "of_copy_bandwidth": 0.8},
            {"batch": 1, "keys": 8192, "config": "default", "of_copy_bandwidth": 0.5},
            {"batch": 1, "keys": 8192, "config": "16/4/2", "error": "OutOfResources"},
        ]
    }
    triton = {
        "decode": [{"batch": 1, "of_hbm_roofline": 0.72}, {"batch": 256, "of_hbm_roofline": 0.4}],
        "serving": [],
    }
    got = {t["target"]: (t["value"], t["goal"], t["met"]) for t in targets(attention, triton)}
    assert got == {
        "kernel b256 x 512: of copy bandwidth": (0.75, 0.7, True),
        "kernel b256 x 512: best config (64/4/2)": (0.8, 0.7, True),
        "kernel b1 x 8192: of copy bandwidth": (0.5, 0.7, False),
        "kernel b1 x 8192: best config (default)": (0.5, 0.7, False),
        "decode step b1: of HBM roofline": (0.72, 0.7, True),
        "decode step b256: of HBM roofline": (0.4, 0.5, False),
        "serving 256 users / transformers static": (None, 3.5, None),
    }
    assert all(t["value"] is None for t in targets({}, {}))


def test_summary_table_lists_steps_and_targets() -> None:
    """One row per step (status, seconds, counts) and per target (value, goal, met)."""
    steps = [StepResult("kernels", "pytest", "ok", 61.2, 180, {"passed": 60})]
    goals = [{"target": "t", "value": 0.81, "goal": 0.7, "met": True}]
    text = format_summary(steps, goals)
    assert "| kernels | ok | 61 | 60 passed |" in text
    assert "| t | 0.81 | 0.70 | yes |" in text


def test_a_step_is_logged_and_killed_at_its_timeout(tmp_path: Path) -> None:
    """A step's output is appended to the log under its command line; one past its
    timeout is killed with its children and reported as timed out."""
    ok = Step("ok", (sys.executable, "-c", "print('3 passed in 0.1s')"), 10)
    result = _run_step(ok, 10, {}, tmp_path / "ok.log")
    assert (result.status, result.tests) == ("ok", {"passed": 3})
    log = (tmp_path / "ok.log").read_text()
    assert log == f"=== ok: {' '.join(ok.argv)}\n3 passed in 0.1s\n"
    code = "import subprocess, sys; subprocess.run(['sleep', '30']); print('late')"
    slow = Step("slow", (sys.executable, "-c", code), 10)
    result = _run_step(slow, 1.0, {}, tmp_path / "slow.log")
    assert result.status == "timed out" and result.seconds < 10
    fail = Step("fail", (sys.executable, "-c", "raise SystemExit(3)"), 10)
    assert _run_step(fail, 10, {}, tmp_path / "f.log").status == "failed (rc 3)"


def test_wheels_are_binary_for_the_gpu_python_without_dependencies(tmp_path: Path) -> None:
    """``pip download`` for CPython 3.12 wheels on every manylinux x86-64 tag, no deps."""
    cmd = download_command(["gguf==0.19.0"], tmp_path, "3.12")
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"] == list(PLATFORMS)
    assert cmd[-3:] == ["-d", str(tmp_path), "gguf==0.19.0"]
