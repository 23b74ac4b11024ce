"""What a section hands back and what a run writes: one format for the CPU and GPU sections.

- ``SectionResult``: a section's rows of the main table, its JSON beyond the rows
  (``extra``), and a table of its own printed under the main one;
- ``Report``: the run's JSON document (``kvserve.bench/v1``): the run's header, the sections
  measured in order, every row, and each section's ``extra`` under its name;
- ``Row`` and its ``COLUMNS``: one line of the main table, and the formatting every section
  shares (cells, ratios, and "met" / "MISSED" against a target).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest.table import markdown_table


@dataclass(slots=True)
class Row:
    """One line of the table; None prints as '-'."""

    section: str
    setting: str
    system: str
    requests: int | None = None
    out_tok_s: float | None = None
    itl_p99_ms: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    peak_concurrent: int | None = None
    cache_efficiency: float | None = None
    vs_baseline: str = ""
    llama_cpp_tok_s: float | str | None = None  # a figure, or "not measured: <reason>"
    llama_cpp_itl_p99_ms: float | None = None
    vs_llama_cpp: str = ""
    notes: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


COLUMNS = (
    ("Section", "section"),
    ("Setting", "setting"),
    ("System", "system"),
    ("Req", "requests"),
    ("Out tok/s", "out_tok_s"),
    ("ITL p99 ms", "itl_p99_ms"),
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p99 ms", "ttft_p99_ms"),
    ("Peak running", "peak_concurrent"),
    ("Cache eff.", "cache_efficiency"),
    ("vs baseline", "vs_baseline"),
    ("llama.cpp tok/s", "llama_cpp_tok_s"),
    ("llama.cpp ITL p99 ms", "llama_cpp_itl_p99_ms"),
    ("kvserve / llama.cpp", "vs_llama_cpp"),
    ("Notes", "notes"),
)


def fmt(value: Any, spec: str = "") -> str:
    """A cell: '-' for nothing, floats with ``spec`` (one decimal by default)."""
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return format(value, spec or ".1f")
    return str(value)


def format_table(rows: list[Row]) -> str:
    """The Markdown table of ``rows`` (pastes into the README as is)."""
    return markdown_table(
        [h for h, _ in COLUMNS],
        [
            [fmt(getattr(r, a), ".2f" if a == "cache_efficiency" else ".1f") for _, a in COLUMNS]
            for r in rows
        ],
    )


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def times(value: float | None, what: str) -> str:
    """A ratio as the table words it: ``"1.23x tok/s"``."""
    return f"{fmt(value, '.2f')}x {what}"


def verdict(
    value: float | None, op: str, target: float, unit: str = "x", name: str = "target"
) -> str:
    """``"target >= 1.5x: met"``: whether ``value`` is ``op`` (>=, <=, <) the target; no
    value misses it."""
    checks = {">=": value is not None and value >= target,
              "<=": value is not None and value <= target,
              "<": value is not None and value < target}  # fmt: skip
    return f"{name} {op} {target:g}{unit}: {'met' if checks[op] else 'MISSED'}"


def row_from_report(section: str, setting: str, system: str, report: dict[str, Any]) -> Row:
    """A row from a load-test report (``loadtest`` JSON)."""
    lat = report["latency_s"]
    return Row(
        section=section,
        setting=setting,
        system=system,
        requests=report["requests"]["ok"],
        out_tok_s=report["output_token_throughput_tps"],
        itl_p99_ms=ms(lat["itl"]["p99"]),
        ttft_p50_ms=ms(lat["ttft"]["p50"]),
        ttft_p99_ms=ms(lat["ttft"]["p99"]),
        raw=report,
    )


def pooled_row(section: str, setting: str, system: str, reports: list[dict[str, Any]]) -> Row:
    """One configuration's rounds (load-test reports, each on a fresh server) as one row:
    output tok/s = all tokens / all time; TTFT p50 the mean of the rounds', ITL and TTFT p99
    the worst round's; goodput pooled over every request sent. ``raw``: the rounds and the
    pooled goodput."""
    tokens = sum(r["output_tokens_total"] for r in reports)
    duration = sum(r["duration_s"] for r in reports)

    def over_rounds(metric: str, stat: str) -> list[float] | None:
        values = [r["latency_s"][metric][stat] for r in reports]
        return None if None in values else values

    ttft50, ttft99, itl99 = (over_rounds(*m) for m in (("ttft", "p50"), ("ttft", "p99"),
                                                       ("itl", "p99")))  # fmt: skip
    within = sum(r["goodput"]["num_ok_within_slo"] for r in reports)
    sent = sum(r["requests"]["sent"] for r in reports)
    return Row(
        section=section,
        setting=setting,
        system=system,
        requests=sum(r["requests"]["ok"] for r in reports),
        out_tok_s=tokens / duration if duration else None,
        itl_p99_ms=ms(max(itl99)) if itl99 else None,
        ttft_p50_ms=ms(sum(ttft50) / len(ttft50)) if ttft50 else None,
        ttft_p99_ms=ms(max(ttft99)) if ttft99 else None,
        raw={
            "rounds": reports,
            "goodput": {
                "num_ok_within_slo": within,
                "sent": sent,
                "fraction_within_slo": within / sent if sent else 0.0,
            },
        },
    )


@dataclass(slots=True)
class SectionResult:
    """A section's rows of the main table; ``extra``: its JSON beyond the rows; ``table``:
    a table of its own, printed under the main one."""

    rows: list[Row] = field(default_factory=list)
    extra: Any = None
    table: str = ""


@dataclass(slots=True)
class Report:
    """A run's results as they come in: ``header`` (machine, sizes, peers: each driver's
    own), the sections measured in order, and each one's result."""

    header: dict[str, Any] = field(default_factory=dict)
    results: dict[str, SectionResult] = field(default_factory=dict)

    @property
    def sections(self) -> list[str]:
        return list(self.results)

    @property
    def rows(self) -> list[Row]:
        return [row for result in self.results.values() for row in result.rows]

    def extra(self, name: str) -> Any:
        """Section ``name``'s JSON beyond the rows (None when it did not run)."""
        result = self.results.get(name)
        return None if result is None else result.extra

    def as_json(self, leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
        """The document: ``schema``, the header, ``sections``, ``rows``, then each section's
        ``extra`` under its name (those in ``leave_out`` aside: the header carries them)."""
        extra = {
            name: r.extra
            for name, r in self.results.items()
            if r.extra is not None and name not in leave_out
        }
        return {
            "schema": "kvserve.bench/v1",
            **self.header,
            "sections": self.sections,
            "rows": [asdict(r) for r in self.rows],
            **extra,
        }

    def write(self, path: Path, leave_out: tuple[str, ...] = ()) -> None:
        path.write_text(json.dumps(self.as_json(leave_out), indent=2, default=str) + "\n")
