"""``make soak`` in miniature: 45 s of the mixed traffic and the crash drill pass, and the
verdict reads the server's exposition exactly."""

from __future__ import annotations

import pytest

from loadtest.soak import main, metric

EXPOSITION = """\
# TYPE kvserve_kv_cache_blocks gauge
kvserve_kv_cache_blocks{state="used"} 3.0
kvserve_kv_cache_blocks{state="free"} 61.0
kvserve_requests_running 2.0
"""


def test_metric_reads_one_sample_by_name_and_labels() -> None:
    """A labelled sample, an unlabelled one, and 0 for one that is absent."""
    assert metric(EXPOSITION, "kvserve_kv_cache_blocks", '{state="used"}') == 3.0
    assert metric(EXPOSITION, "kvserve_kv_cache_blocks", '{state="free"}') == 61.0
    assert metric(EXPOSITION, "kvserve_requests_running") == 2.0
    assert metric(EXPOSITION, "kvserve_requests_waiting") == 0.0


@pytest.mark.slow
def test_a_short_soak_passes(capsys: pytest.CaptureFixture[str]) -> None:
    """45 s with 4 clients: exit 0, every outcome intended, the counts match, idle at 0."""
    assert main(["--minutes", "0.75", "--workers", "4", "--sample-s", "10"]) == 0
    out = capsys.readouterr().out
    assert "unintended: {}" in out
    assert "idle: blocks used 0, running 0, waiting 0" in out
    assert "crash drill: streams ended {'UNAVAILABLE': 8}, server exit status 1" in out
