"""kvserve through gRPC: a real ``kvserve serve --runner torch`` subprocess on loopback, driven
by the load generator (``loadtest``) in closed loop. ``run_load`` also drives llama.cpp's server
through the OpenAI backend (``benchmarks/bench_llama_cpp.py``).

Every configuration gets a fresh server (so no run inherits another run's prefix cache), a
warm-up of two short requests (random tokens: they share no block with the measured prompts),
then the measured run. Figures are the load generator's report (``loadtest.report``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NotRequired, Protocol, TypedDict, Unpack

from loadtest.generator import LoadConfig, LoadGenerator
from loadtest.launch import ServerProcess
from loadtest.report import build_report
from loadtest.stats import SLO
from loadtest.workload import Workload

WARM_UP = Workload.from_dict(
    {
        "name": "warm-up",
        "seed": 12345,
        "num_requests": 2,
        "prompt": {"source": "random", "len": 24},
        "output": {"len": 4, "ignore_eos": True},
        "sampling": {"temperature": 0.0},
    }
)


def chat128_workload(path: Path, num_requests: int, output_tokens: int) -> Workload:
    """The reference workload: request i uses prompts[i % 64], greedy, exactly N tokens."""
    return Workload.from_dict(
        {
            "name": "chat128",
            "num_requests": num_requests,
            "prompt": {"source": "file", "path": str(path), "order": "cycle"},
            "output": {"len": output_tokens, "ignore_eos": True},
            "sampling": {"temperature": 0.0},
        }
    )


def long_short_workload(
    num_requests: int, long_len: int, long_fraction: float, output_tokens: int
) -> Workload:
    """Short prompts (32-64 tokens) mixed with long ones (``long_len`` more tokens each).

    The long part is a shared-prefix entry with as many prefixes as long requests, so every
    long prompt is distinct (no prefix-cache hits between them).
    """
    num_long = round(long_fraction * num_requests)
    return Workload.from_dict(
        {
            "name": "long_short",
            "seed": 1,
            "num_requests": num_requests,
            "prompt": {"source": "random", "len": {"type": "uniform", "min": 32, "max": 64}},
            "shared_prefix": {"num_prefixes": num_long, "len": long_len, "fraction": long_fraction},
            "output": {"len": output_tokens, "ignore_eos": True},
            "sampling": {"temperature": 0.0},
        }
    )


def shared_prefix_workload(
    num_requests: int, num_prefixes: int, prefix_len: int, output_tokens: int
) -> Workload:
    """``num_prefixes`` system prompts of ``prefix_len`` tokens shared by every request."""
    return Workload.from_dict(
        {
            "name": "shared_prefix",
            "seed": 2,
            "num_requests": num_requests,
            "prompt": {"source": "random", "len": {"type": "uniform", "min": 32, "max": 64}},
            "shared_prefix": {"num_prefixes": num_prefixes, "len": prefix_len, "fraction": 1.0},
            "output": {"len": output_tokens, "ignore_eos": True},
            "sampling": {"temperature": 0.0},
        }
    )


class Served(Protocol):
    """A running server: ``ServerProcess`` (gRPC) or ``bench_llama_cpp.LlamaServer`` (HTTP)."""

    @property
    def target(self) -> str: ...

    @property
    def metrics_url(self) -> str | None: ...


class LoadArgs(TypedDict):
    """How one closed-loop run drives a server (``run_load``'s keywords, passed through
    ``warm_and_run`` and ``measure``)."""

    users: int
    num_requests: int
    duration_s: float
    desc: str
    api: NotRequired[str]  # "grpc" (default) or "openai"
    progress: NotRequired[bool]
    slo: NotRequired[SLO | None]  # goodput limits (default: none)


def run_load(server: Served, workload: Workload, **load: Unpack[LoadArgs]) -> dict[str, Any]:
    config = LoadConfig(
        target=server.target,
        mode="closed",
        users=load["users"],
        num_requests=load["num_requests"],
        duration_s=load["duration_s"],
        metrics_url=server.metrics_url,
        progress=load.get("progress", True),
        progress_desc=load["desc"],
        api=load.get("api", "grpc"),
        slo=load.get("slo") or SLO(),
    )
    run = asyncio.run(LoadGenerator(config, workload).run())
    return build_report(run, workload)


def warm_and_run(server: Served, workload: Workload, **load: Unpack[LoadArgs]) -> dict[str, Any]:
    """The warm-up every measured server gets (2 short requests), then one closed-loop run."""
    run_load(server, WARM_UP, api=load.get("api", "grpc"), users=2, num_requests=2,
             duration_s=300, desc="warm-up", progress=False)  # fmt: skip
    return run_load(server, workload, **load)


def measure(
    serve_args: Sequence[str], workload: Workload, **load: Unpack[LoadArgs]
) -> dict[str, Any]:
    """Fresh server with ``serve_args``, warm-up, then one closed-loop run; its report."""
    with ServerProcess(["--runner", "torch", *serve_args]) as server:
        report = warm_and_run(server, workload, **load)
        report["serve_args"] = list(serve_args)
        return report
