"""gpu_check: its steps and their order, the budgets, pytest counts, issue 38's targets read
from reports, the summary, a step's timeout, and a whole run over stand-in steps."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.tools.gpu_check import (
    BUDGET_S,
    GREEDY_TESTS,
    KERNEL_TESTS,
    MIN_STEP_S,
    PLATFORMS,
    QUICK_BUDGET_S,
    QUICK_WALL_S,
    WALL_S,
    Step,
    StepResult,
    _run_step,
    download_command,
    format_summary,
    main,
    plan_steps,
    pytest_counts,
    run,
    step_timeout,
    targets,
    triton_cache,
)


def _arg(step: Step, flag: str) -> str:
    return step.argv[step.argv.index(flag) + 1]


def test_a_full_run_checks_correctness_first_then_benchmarks(tmp_path: Path) -> None:
    """Greedy tokens against transformers, then the kernels' tests in one process (no
    xdist), then the kernel benchmark, then the Triton benchmark with every section of issue
    38 (decode, prefill, profile, serving, the server); each benchmark writes its JSON under
    the out dir; the caps come from issue 38's timings and the budget leaves the wheel
    install and the summary inside 7 minutes."""
    steps = plan_steps(tmp_path, python="py")
    assert [s.name for s in steps] == ["greedy", "kernels", "attention", "bench-triton"]
    assert steps[0].argv[:3] == ("py", "-m", "pytest") and steps[0].argv[-1:] == GREEDY_TESTS
    assert steps[1].argv[-len(KERNEL_TESTS) :] == KERNEL_TESTS
    assert all("-n" not in s.argv for s in steps)
    assert "tests/model_runner/test_triton_fusions.py" in KERNEL_TESTS
    assert _arg(steps[2], "--sections") == "probes,attention"
    assert _arg(steps[3], "--sections") == "decode,prefill,profile,serving,server"
    assert _arg(steps[3], "--attention-backend") == "triton"
    outs = [_arg(s, "--out") for s in steps if "--out" in s.argv]
    assert outs == [str(tmp_path / f"bench_{n}.json") for n in ("attention", "triton")]
    caps = {s.name: s.max_s for s in steps}
    assert caps["kernels"] < 180 and caps["attention"] >= 2 * 24
    assert caps["bench-triton"] > 85  # decode + serving alone took 85 s; more sections now
    assert BUDGET_S < WALL_S == 7 * 60 and sum(caps.values()) > BUDGET_S


def test_a_quick_run_is_greedy_then_one_quick_benchmark(tmp_path: Path) -> None:
    """``--quick``: the greedy tests, then ``bench_gpu --quick`` with every headline section
    (the kernel, decode, the profile, serving, the server) in one process; 3 minutes."""
    steps = plan_steps(tmp_path, python="py", quick=True)
    assert [s.name for s in steps] == ["greedy", "bench-quick"]
    bench = steps[1]
    assert "--quick" in bench.argv and _arg(bench, "--attention-backend") == "triton"
    assert _arg(bench, "--sections") == "attention,decode,profile,serving,server"
    assert _arg(bench, "--out") == str(tmp_path / "bench_quick.json")
    assert QUICK_BUDGET_S < QUICK_WALL_S == 3 * 60
    assert sum(s.max_s for s in steps) <= QUICK_BUDGET_S


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


ATTENTION = {
    "attention": [
        {"batch": 256, "keys": 512, "config": "default", "of_copy_bandwidth": 0.94},
        {"batch": 1, "keys": 8192, "config": "default", "of_copy_bandwidth": 0.56},
        {"batch": 1, "keys": 8192, "config": "64/4/2", "of_copy_bandwidth": 0.83},
        {"batch": 1, "keys": 8192, "config": "16/4/2", "error": "OutOfResources"},
    ]
}
TRITON = {
    "decode": [
        {"batch": 1, "step_ms": 6.2, "of_hbm_roofline": 0.83},
        {"batch": 256, "step_ms": 20.0, "of_hbm_roofline": 0.5},
    ],
    "serving": [{"users": 256, "kvserve_tok_s": 11000.0, "gpu_busy": 0.97}],
    "server": [{"users": 256, "tok_s": 8000.0, "of_closed_loop": 8000 / 11000, "failed": 0}],
}


def _table(rows: list[dict[str, Any]]) -> dict[str, tuple[Any, ...]]:
    return {r["name"]: (r["measured"], r["op"], r["target"], r["holds"]) for r in rows}


def test_targets_read_issue_38s_figures_from_the_reports() -> None:
    """Every acceptance figure of issue 38 from a full run's two reports and its steps:
    the run's wall against 7 minutes, greedy failures, decode b1 (ms, roofline), b256
    (roofline), the kernel at 1 x 8192 (default config; the sweep's best in the note),
    serving at 256 users against 256 tokens per b256 step and its busy time, the server
    against the closed loop; each says whether it holds."""
    steps = [StepResult("greedy", "pytest", "ok", 30, 90, {"passed": 6, "skipped": 1}),
             StepResult("bench-triton", "bench", "ok", 150, 200)]  # fmt: skip
    rows = targets([ATTENTION, TRITON, {}], steps, 301.5, WALL_S)
    got = _table(rows)
    ideal = 256 / 0.020  # tokens per second at one b256 step per 256 tokens
    assert got == {
        "every step ok, in s": (301.5, "<=", 420, True),
        "greedy tokens equal transformers' (tests failed)": (0.0, "<=", 0, True),
        "decode b1 at 512 keys: step ms": (6.2, "<=", 6.4, True),
        "decode b1 at 512 keys: of HBM roofline": (0.83, ">=", 0.8, True),
        "decode b256 at 512 keys: of HBM roofline": (0.5, ">=", 0.55, False),
        "attention 1 x 8192 keys: of copy bandwidth": (0.56, ">=", 0.8, False),
        "serving 256 users: of 256 tokens per b256 step": (11000 / ideal, ">=", 0.85, True),
        "serving 256 users: GPU busy": (0.97, ">=", 0.95, True),
        "kvserve serve over HTTP, 256 users: of the closed loop": (8000 / 11000, ">=", 0.8, False),
    }
    notes = {r["name"]: r["note"] for r in rows}
    assert notes["attention 1 x 8192 keys: of copy bandwidth"] == "best config 64/4/2: 0.83"
    assert notes["greedy tokens equal transformers' (tests failed)"] == "6 passed, 1 skipped"


def test_targets_say_what_was_not_measured_and_what_failed() -> None:
    """No reports and no steps: nothing measured, nothing holds or fails. A failed greedy
    test, a step that timed out, and a server that failed requests: each does not hold,
    whatever the figures."""
    assert all(r["measured"] is None and r["holds"] is None for r in targets([], [], 0, 420))
    steps = [StepResult("greedy", "pytest", "failed (rc 1)", 30, 90, {"passed": 5, "failed": 1}),
             StepResult("bench-triton", "bench", "timed out", 200, 200)]  # fmt: skip
    server = {"server": [{"users": 256, "tok_s": 1.0, "of_closed_loop": 0.9, "failed": 3}]}
    got = _table(targets([server], steps, 100.0, 420))
    assert got["every step ok, in s"] == (100.0, "<=", 420, False)
    assert got["greedy tokens equal transformers' (tests failed)"] == (1.0, "<=", 0, False)
    assert got["kvserve serve over HTTP, 256 users: of the closed loop"][3] is False
    quick = {"decode": TRITON["decode"], "serving": TRITON["serving"]}
    got = _table(targets([{}, {}, quick], [], 170.0, QUICK_WALL_S))  # the quick report alone
    assert got["decode b1 at 512 keys: step ms"] == (6.2, "<=", 6.4, True)
    assert got["serving 256 users: GPU busy"] == (0.97, ">=", 0.95, True)


def test_summary_table_lists_steps_and_targets() -> None:
    """One row per step (status, seconds, counts) and per target (measured, comparison and
    target, holds, note)."""
    steps = [StepResult("kernels", "pytest", "ok", 61.2, 180, {"passed": 60})]
    goals = [
        {"name": "t", "measured": 0.81, "op": ">=", "target": 0.8, "holds": True, "note": "n"},
        {"name": "u", "measured": None, "op": "<=", "target": 6.4, "holds": None, "note": ""},
    ]
    text = format_summary(steps, goals)
    assert "| kernels | ok | 61 | 60 passed |" in text
    assert "| t | 0.81 | >= 0.8 | yes | n |" in text
    assert "| u | - | <= 6.4 | - |  |" in text


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


def _writer(name: str, report: dict[str, Any], out: Path, printed: str = "") -> Step:
    """A stand-in step: records the Triton cache it was given and the summary it finds,
    writes ``report`` where the real benchmark would, prints ``printed``."""
    code = (
        "import json, os, shutil; "
        f"open({str(out / (name + '.env'))!r}, 'w').write(os.environ['TRITON_CACHE_DIR']); "
        f"shutil.copy({str(out / 'summary.json')!r}, {str(out / (name + '.summary'))!r}); "
        f"json.dump({report!r}, open({str(out / f'bench_{name}.json')!r}, 'w')); "
        f"print({printed!r})"
    )
    return Step(name, (sys.executable, "-c", code), 30)


def test_a_run_shares_one_triton_cache_and_rewrites_the_summary_after_each_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run over stand-in steps: every step sees the same ``TRITON_CACHE_DIR``;
    summary.json is rewritten after each step with the steps so far and the targets read
    from the reports they wrote; a step the budget cannot hold is skipped and the run
    fails."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("benchmarks.tools.gpu_check.MIN_STEP_S", 2)
    out = tmp_path / "out"
    out.mkdir()
    greedy = Step("greedy", (sys.executable, "-c", "print('4 passed in 1.0s')"), 30)
    slow = Step("slow", (sys.executable, "-c", "import time; time.sleep(5.5)"), 30)
    plan = [greedy, _writer("attention", ATTENTION, out), _writer("triton", TRITON, out), slow,
            Step("late", (sys.executable, "-c", "print('never')"), 30)]  # fmt: skip
    # 7 s: the short steps start with over 2 s left; after the slow one, under 2 s is left.
    assert run(out, 7, tmp_path / "no-wheels", None, plan=plan) == 1
    summary = json.loads((out / "summary.json").read_text())
    names = ["greedy", "attention", "triton", "slow", "late"]
    assert [s["name"] for s in summary["steps"]] == names
    assert [s["status"] for s in summary["steps"]][:4] == ["ok"] * 4
    assert summary["steps"][4]["status"] == "skipped (budget)"
    assert summary["triton_cache"] == str(tmp_path / "cache")
    caches = {(out / f"{n}.env").read_text() for n in ("attention", "triton")}
    assert caches == {str(tmp_path / "cache")}
    seen = json.loads((out / "triton.summary").read_text())  # as the third step started
    assert [s["name"] for s in seen["steps"]] == ["greedy", "attention"]
    assert _table(seen["targets"])["decode b1 at 512 keys: step ms"][0] is None
    got = _table(summary["targets"])
    assert got["decode b1 at 512 keys: step ms"] == (6.2, "<=", 6.4, True)
    assert got["greedy tokens equal transformers' (tests failed)"] == (0.0, "<=", 0, True)
    assert got["every step ok, in s"][3] is False  # a step was skipped
    assert "no wheels in" in summary["installed"]


def test_the_triton_cache_is_the_environment_s_or_one_in_the_temp_dir() -> None:
    """``TRITON_CACHE_DIR`` when set; else one fixed folder, the same for every step."""
    assert triton_cache({"TRITON_CACHE_DIR": "/x"}) == "/x"
    assert triton_cache({}) == triton_cache({}) and triton_cache({}).endswith("kvserve-triton")


def test_run_takes_the_quick_budget_with_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """``run --quick`` plans the quick steps under the 3-minute budget; ``--budget-s``
    overrides it."""
    seen: list[tuple[float, bool]] = []

    def fake_run(out: Path, budget: float, wheels: Path, steps: Any, quick: bool) -> int:
        seen.append((budget, quick))
        return 0

    monkeypatch.setattr("benchmarks.tools.gpu_check.run", fake_run)
    assert main(["run", "--quick", "--out-dir", "/tmp/x"]) == 0
    assert main(["run", "--out-dir", "/tmp/x"]) == 0
    assert main(["run", "--quick", "--budget-s", "99", "--out-dir", "/tmp/x"]) == 0
    assert seen == [(QUICK_BUDGET_S, True), (BUDGET_S, False), (99.0, True)]


def test_wheels_are_binary_for_the_gpu_python_without_dependencies(tmp_path: Path) -> None:
    """``pip download`` for CPython 3.12 wheels on every manylinux x86-64 tag, no deps."""
    cmd = download_command(["gguf==0.19.0"], tmp_path, "3.12")
    assert cmd[1:4] == ["-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(cmd)
    assert cmd[cmd.index("--python-version") + 1] == "3.12"
    assert [cmd[i + 1] for i, a in enumerate(cmd) if a == "--platform"] == list(PLATFORMS)
    assert cmd[-3:] == ["-d", str(tmp_path), "gguf==0.19.0"]
