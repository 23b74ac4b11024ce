"""Run a codegen module (``sm90_codegen``, ``fusions_codegen``) in a process of its own and
read its JSON: Triton must compile there, not interpret (``TRITON_INTERPRET`` is dropped),
and a Triton without ptxas for sm_90 skips the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest


def compiled_counts(module: str) -> dict[str, Any]:
    """``python -m module``'s last line of output, parsed as JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without a warning
    proc = subprocess.run(
        [sys.executable, "-m", module],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr:
        pytest.skip("this Triton has no ptxas for sm_90")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
