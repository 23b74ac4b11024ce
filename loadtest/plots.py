"""PNG plots of a run or a rate sweep (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from loadtest.generator import RunResult
from loadtest.stats import Outcome


def _label(report: dict[str, Any]) -> str:
    load = report["load"]
    if load["mode"] == "closed":
        return f"{load['users']} users"
    return f"{load['rate'] or 'inf'} req/s"


def plot_cdf(runs: Sequence[RunResult], reports: Sequence[dict[str, Any]], path: Path) -> Path:
    """Empirical CDFs of TTFT and e2e latency, one line per run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run, report in zip(runs, reports, strict=True):
        ok = [r for r in run.results if r.outcome == Outcome.OK]
        for ax, values in (
            (axes[0], sorted(t for r in ok if (t := r.ttft_s) is not None)),
            (axes[1], sorted(r.e2e_s for r in ok)),
        ):
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step([v * 1000 for v in values], ys, where="post", label=_label(report))
    for ax, title in ((axes[0], "TTFT"), (axes[1], "end-to-end latency")):
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(reports: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Latency percentiles vs offered rate, and goodput / throughput vs offered rate."""
    rates = [r["load"]["rate"] for r in reports]
    if any(r is None for r in rates):
        raise ValueError("a sweep plot needs finite offered rates")
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, (key, title) in zip(
        axes,
        (("ttft", "TTFT"), ("tpot", "time per output token"), ("e2e", "end-to-end")),
        strict=True,
    ):
        for p in ("p50", "p90", "p99"):
            ys = [r["latency_s"][key][p] for r in reports]
            ax.plot(rates, [None if y is None else y * 1000 for y in ys], marker="o", label=p)
        ax.set_title(f"{title} vs offered rate")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "sweep_latency.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, [r["request_throughput_rps"] for r in reports], marker="o", label="throughput")
    ax.plot(rates, [r["goodput"]["goodput_rps"] for r in reports], marker="s", label="goodput")
    ax.plot(rates, rates, linestyle="--", color="grey", label="offered")
    g = reports[0]["goodput"]
    ax.set_title(f"goodput (TTFT <= {g['slo_ttft_s']} s, TPOT <= {g['slo_tpot_s']} s)", fontsize=10)
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "sweep_goodput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
