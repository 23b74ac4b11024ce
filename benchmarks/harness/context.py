"""What every section may read, CPU and GPU alike: the sizes, the run's settings, the report
so far (a section reads an earlier one's figures there), and where its lines go."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from benchmarks.bench_llama_cpp import LlamaCpp
from benchmarks.harness.report import Report
from benchmarks.harness.sizes import Sizes
from loadtest.workload import CHAT128_PROMPTS

if TYPE_CHECKING:
    from benchmarks.gpu.models import GpuModels

Target = Literal["cpu", "gpu"]
Size = Literal["full", "quick", "dry"]


def say(message: str) -> None:
    """A progress line, on stderr (stdout holds the tables)."""
    print(message, file=sys.stderr, flush=True)


def emit_line(line: str) -> None:
    """A table's line, on stdout as soon as it is measured."""
    print(line, flush=True)


@dataclass(slots=True)
class Context:
    """One run: its target and size, the sizes, the settings every section may read."""

    target: Target
    size: Size
    sizes: Sizes
    out_dir: Path | None = None
    stamp: str = ""  # names this run's files
    report: Report = field(default_factory=Report)
    emit: Callable[[str], None] = emit_line
    save: Callable[[Report], None] | None = None  # the report so far, after each section
    # CPU sections
    threads: int = 2  # torch threads, both sides of a comparison
    kv_threads: int = 1  # torch threads of kvcache and sinks
    progress: bool = True
    workload_file: Path = CHAT128_PROMPTS  # chat128's prompts
    llama_cpp: LlamaCpp = field(default_factory=lambda: LlamaCpp(None, "not looked for"))
    llama_cpp_mode: str = "build"  # --llama-cpp: build, cached or off
    # GPU sections
    device: str = "cuda"
    attention_backend: str = "auto"
    gpu: GpuModels | None = None  # the model and runner, built when a section first needs them

    @property
    def quick(self) -> bool:
        """Any size smaller than the full one."""
        return self.size != "full"

    @property
    def full(self) -> bool:
        """The full sizes: only then are the issues' targets judged."""
        return self.size == "full"

    def saved(self) -> None:
        """Hand the report so far to ``save`` (a run cut short keeps what came before)."""
        if self.save is not None:
            self.save(self.report)
