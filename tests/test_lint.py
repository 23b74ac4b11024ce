"""Quality gates CI enforces: ruff lint + format on the tree, mypy --strict on the pure core."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, check=False
    )


def test_ruff_check_is_clean() -> None:
    """`ruff check .` reports nothing."""
    proc = _run("ruff", "check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_is_clean() -> None:
    """`ruff format --check .` would change no file."""
    proc = _run("ruff", "format", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict_on_pure_core() -> None:
    """`mypy --strict` on the pure packages and modules, on the runner's plain-data
    modules (its options, the tokens in flight, what the fronts know of adapters) and on its
    typed torch modules (weight preparation, environment, step records, adapter targets,
    plans, backends and layout) -- the Makefile's ``lint`` list -- reports no error."""
    pure = ("scheduler", "cache_manager", "kv_store", "model_runner/base.py")
    plain = ("model_runner/config.py", "model_runner/future.py", "model_runner/lora/info.py")
    typed = (
        "model_runner/weights.py",
        "model_runner/environment.py",
        "model_runner/step_record.py",
        "model_runner/lora/plan.py",
        "model_runner/lora/targets.py",
        "model_runner/lora/updates.py",
        "model_runner/lora/backend.py",
        "model_runner/lora/layout.py",
    )
    proc = _run("mypy", "--strict", *pure, "model_runner/step.py", *plain, *typed)
    assert proc.returncode == 0, proc.stdout + proc.stderr
