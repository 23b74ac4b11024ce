"""The one reader of the environment (STYLE rule 8), read when asked, never at import.

Two kinds of ``KVSERVE_*`` variable:

- **settings**: every ``ServerConfig`` field (``KVSERVE_MAX_NUM_SEQS``), merged by
  ``server.config.build_config`` between the config file and the flags;
- **process switches** (``SWITCHES``): what the layers under the server read when they start,
  for every caller (the server, tests, benchmarks), and what a settings check must not call
  unknown.

Besides them, the kernels' build reads ``XDG_CACHE_HOME`` and ``CXX`` as compilers do
(``build_environment``). The cluster's Ray plumbing (``cluster.app``, ``cluster.edge``)
passes its settings to Ray's processes through the environment; it reads and writes its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PREFIX = "KVSERVE_"

# Process switches: name (prefix stripped, lower case) -> what it does.
SWITCHES = {
    "kernels": "the quantized CPU kernels: auto (default), portable, or 0 / off (fp32 weights)",
    "isa": "the kernels' ISA family: auto (the best the CPU has) or one of kernels.ISAS",
    "kernel_tuning": "the kernels' speed knobs: auto (the table by CPU, default), default, or "
    "name=value pairs (model_runner/kernels/cpu_tuning.py)",
    "kernel_dir": "one folder for the kernels' libraries (default: beside the source, then "
    "$XDG_CACHE_HOME/kvserve/kernels)",
    "fusions": "0 turns off the Triton layer fusions on CUDA",
}


def kvserve_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``KVSERVE_*`` variables of ``environ`` (default: this process's), prefix stripped,
    lower case."""
    env = os.environ if environ is None else environ
    return {
        key[len(PREFIX) :].lower(): value for key, value in env.items() if key.startswith(PREFIX)
    }


def switch(name: str, default: str = "") -> str:
    """The process switch ``KVSERVE_<NAME>`` now (``default`` when unset or empty)."""
    if name not in SWITCHES:
        raise KeyError(f"{name!r} is not a process switch: {', '.join(SWITCHES)}")
    return os.environ.get(PREFIX + name.upper()) or default


@dataclass(frozen=True, slots=True)
class BuildEnvironment:
    """What the kernels' build takes from the environment: ``kernel_dir``
    (``KVSERVE_KERNEL_DIR``, or None), the user cache root and the compiler (``CXX``, or None:
    the build looks on PATH)."""

    kernel_dir: Path | None
    cache_home: Path
    compiler: str | None


def build_environment() -> BuildEnvironment:
    kernel_dir = switch("kernel_dir")
    return BuildEnvironment(
        kernel_dir=Path(kernel_dir) if kernel_dir else None,
        cache_home=Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"),
        compiler=os.environ.get("CXX") or None,
    )
