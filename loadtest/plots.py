"""PNG plots of a run or a rate sweep (matplotlib, Agg backend: no display needed).

Each ``*_figure`` builds one figure, titled with its workload; the ``plot_*`` functions save
them and return the paths written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from loadtest.generator import RunResult
from loadtest.report import slo_text
from loadtest.stats import Outcome


def _label(report: dict[str, Any]) -> str:
    load = report["load"]
    if load["mode"] == "closed":
        return f"{load['users']} users"
    return f"{load['rate'] or 'inf'} req/s"


def _workload(reports: Sequence[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(r["workload"]["name"] for r in reports))
    return f"workload {', '.join(names)}"


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cdf_figure(runs: Sequence[RunResult], reports: Sequence[dict[str, Any]]) -> Figure:
    """Empirical CDFs of TTFT and e2e latency, one line per run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
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
    fig.suptitle(_workload(reports))
    return fig


def latency_figure(reports: Sequence[dict[str, Any]]) -> Figure:
    """TTFT, TPOT and e2e percentiles against offered rate."""
    rates = _rates(reports)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
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
    fig.suptitle(_workload(reports))
    return fig


def goodput_figure(reports: Sequence[dict[str, Any]]) -> Figure:
    """Throughput and goodput against offered rate.

    Goodput never exceeds throughput and often equals it, so throughput is a wide, pale line
    with hollow markers underneath, and goodput a thin dashed line with small filled markers
    on top: where they coincide both stay visible.
    """
    rates = _rates(reports)
    fig, ax = plt.subplots(figsize=(6.5, 4.4))
    ax.plot(rates, rates, linestyle=":", color="grey", label="offered", zorder=1)
    ax.plot(
        rates,
        [r["request_throughput_rps"] for r in reports],
        color="tab:blue",
        linestyle="-",
        linewidth=5,
        alpha=0.45,
        marker="o",
        markersize=11,
        markerfacecolor="none",
        label="throughput (ok req/s)",
        zorder=2,
    )
    slo = slo_text(reports[0]["goodput"])
    if slo is not None:
        ax.plot(
            rates,
            [r["goodput"]["goodput_rps"] for r in reports],
            color="tab:red",
            linestyle="--",
            linewidth=1.5,
            marker="s",
            markersize=5,
            label="goodput (within SLO)",
            zorder=3,
        )
    ax.set_title(
        f"{_workload(reports)}\n"
        + (f"goodput: {slo}" if slo is not None else "throughput (no SLO set: no goodput)"),
        fontsize=10,
    )
    ax.set_xlabel("offered rate (req/s)")
    ax.set_ylabel("req/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _rates(reports: Sequence[dict[str, Any]]) -> list[float]:
    rates = [r["load"]["rate"] for r in reports]
    if any(r is None for r in rates):
        raise ValueError("a sweep plot needs finite offered rates")
    return rates


def plot_cdf(runs: Sequence[RunResult], reports: Sequence[dict[str, Any]], path: Path) -> Path:
    """Writes ``cdf_figure`` to ``path``; returns ``path``."""
    return _save(cdf_figure(runs, reports), path)


def plot_sweep(reports: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Writes sweep_latency.png and sweep_goodput.png to ``out_dir``; returns their paths."""
    return [
        _save(latency_figure(reports), out_dir / "sweep_latency.png"),
        _save(goodput_figure(reports), out_dir / "sweep_goodput.png"),
    ]
