"""The plots: each names its workload; throughput stays visible where goodput equals it."""

from __future__ import annotations

from collections.abc import Iterator

import matplotlib.pyplot as plt
import pytest
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from loadtest.plots import cdf_figure, goodput_figure, latency_figure
from loadtest.report import build_report
from loadtest.stats import SLO
from tests.loadtest.helpers import WORKLOAD, make_report, make_run


@pytest.fixture(autouse=True)
def _close_figures() -> Iterator[None]:
    yield
    plt.close("all")


def _titles(fig: Figure) -> list[str]:
    return [fig.get_suptitle(), *(ax.get_title() for ax in fig.axes)]


def _lines(fig: Figure) -> dict[str, Line2D]:
    (ax,) = fig.axes
    return {str(line.get_label()): line for line in ax.get_lines()}


def test_every_plot_names_its_workload() -> None:
    """The CDF, latency and goodput figures each carry "workload tiny" in a title."""
    run = make_run()
    figures = [
        cdf_figure([run], [build_report(run, WORKLOAD)]),
        latency_figure([make_report(1.0), make_report(2.0)]),
        goodput_figure([make_report(1.0), make_report(2.0)]),
    ]
    for fig in figures:
        assert any("workload tiny" in title for title in _titles(fig)), _titles(fig)


def test_throughput_stays_visible_under_an_equal_goodput() -> None:
    """Goodput equals throughput here: the two lines differ in style, marker and width, goodput
    is drawn above, and the legend names both."""
    slo = SLO(ttft_s=1.0)
    fig = goodput_figure([make_report(1.0, slo), make_report(2.0, slo)])
    lines = _lines(fig)
    thr, good = lines["throughput (ok req/s)"], lines["goodput (within SLO)"]
    assert list(thr.get_ydata()) == list(good.get_ydata()) == [2.0, 2.0]
    assert thr.get_linestyle() != good.get_linestyle()
    assert thr.get_marker() != good.get_marker()
    assert thr.get_linewidth() > good.get_linewidth()
    assert thr.get_zorder() < good.get_zorder()
    (ax,) = fig.axes
    legend = ax.get_legend()
    assert legend is not None
    assert {t.get_text() for t in legend.get_texts()} == set(lines)
    assert "TTFT <= 1000.0 ms" in ax.get_title()


def test_goodput_plot_without_an_slo_draws_no_goodput() -> None:
    """No SLO: only offered and throughput lines, and the title says no SLO is set."""
    fig = goodput_figure([make_report(1.0), make_report(2.0)])
    assert set(_lines(fig)) == {"offered", "throughput (ok req/s)"}
    assert "no SLO set" in fig.axes[0].get_title()
