"""Reports of made-up runs, for tests of the summary, the sweep table and the plots."""

from __future__ import annotations

from typing import Any

from loadtest.generator import LoadConfig, RunResult
from loadtest.report import build_report
from loadtest.stats import SLO, Outcome, RequestResult
from loadtest.workload import Workload

WORKLOAD = Workload.from_dict(
    {
        "name": "tiny",
        "num_requests": 2,
        "prompt": {"source": "random", "len": 8},
        "output": {"len": 3},
    }
)


def make_run(rate: float = 2.0, slo: SLO | None = None, **config: Any) -> RunResult:
    """Two OK requests at ``rate`` in one second: TTFT 100 ms, TPOT 100 ms, e2e 500 ms."""
    cfg = LoadConfig(
        target="127.0.0.1:1", mode="open", rate=rate, num_requests=2, slo=slo or SLO(), **config
    )
    results = [
        RequestResult(
            index=i,
            request_id=f"r{i}",
            priority=0,
            num_prompt_tokens=8,
            max_tokens=3,
            cancel_after_tokens=None,
            send_s=0.0,
            outcome=Outcome.OK,
            code="OK",
            end_s=0.5,
            token_arrivals=[(0.1, 1), (0.2, 1), (0.3, 1)],
        )
        for i in range(2)
    ]
    return RunResult(cfg, results, 2, 0.0, 1.0)


def make_report(rate: float = 2.0, slo: SLO | None = None, **config: Any) -> dict[str, Any]:
    """The report of ``make_run``."""
    return build_report(make_run(rate, slo, **config), WORKLOAD)
