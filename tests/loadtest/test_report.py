"""The printed summary and sweep table: goodput only under an SLO; prefix-cache isolation."""

from __future__ import annotations

from loadtest.report import format_summary, format_sweep
from loadtest.stats import SLO
from tests.loadtest.helpers import make_report


def test_summary_without_an_slo_says_no_slo_set() -> None:
    """No --slo-*: the goodput line says "no SLO set" instead of "TTFT <= - ms"."""
    text = format_summary(make_report())
    assert "goodput: no SLO set (--ttft-slo-ms, --itl-slo-ms)" in text.splitlines()
    assert "<= -" not in text
    assert "goodput (" not in text


def test_summary_names_only_the_limits_that_are_set() -> None:
    """A TTFT limit alone: the goodput line names it and no TPOT limit."""
    text = format_summary(make_report(slo=SLO(ttft_s=0.5)))
    assert "goodput (TTFT <= 500.0 ms): 2.00 req/s, 2/2 within SLO" in text.splitlines()
    assert "TPOT <=" not in text


def test_each_run_has_its_own_cache_salt_and_says_so() -> None:
    """By default a run carries a fresh cache_salt; JSON and summary both say it is isolated."""
    first, second = make_report(), make_report()
    salts = [first["load"]["cache_salt"], second["load"]["cache_salt"]]
    assert all(s.startswith("loadtest-") for s in salts)
    assert salts[0] != salts[1]
    assert first["load"]["reuse_cache"] is False
    line = f"prefix cache: isolated from other runs (cache_salt {salts[0]})"
    assert line in format_summary(first).splitlines()


def test_reuse_cache_sends_no_salt_and_says_so() -> None:
    """cache_salt=None (--reuse-cache): the report says the cache is shared with earlier runs."""
    report = make_report(cache_salt=None)
    assert (report["load"]["reuse_cache"], report["load"]["cache_salt"]) == (True, None)
    line = "prefix cache: shared with earlier runs (--reuse-cache: no cache_salt)"
    assert line in format_summary(report).splitlines()


def test_sweep_table_without_an_slo_has_no_goodput() -> None:
    """A sweep without an SLO prints "-" for goodput and says why; it names the cache mode."""
    lines = format_sweep([make_report(1.0), make_report(2.0)]).splitlines()
    assert [line.split()[-2] for line in lines[1:3]] == ["-", "-"]
    assert lines[3:] == [
        "(latencies in ms; no SLO set, no goodput)",
        "(prefix cache isolated: a cache_salt of its own per rate)",
    ]


def test_sweep_table_with_an_slo_shows_goodput() -> None:
    """With both limits the goodput column has the figures and the footer the limits."""
    slo = SLO(ttft_s=1.0, tpot_s=0.15)
    lines = format_sweep([make_report(1.0, slo), make_report(2.0, slo)]).splitlines()
    assert [line.split()[-2] for line in lines[1:3]] == ["2.00", "2.00"]
    within = "TTFT <= 1000.0 ms, TPOT <= 150.0 ms"
    assert lines[3] == f"(latencies in ms; goodput: req/s within {within})"
