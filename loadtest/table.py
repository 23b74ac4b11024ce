"""Text tables, the one renderer for the load tester, the simulator and the benchmarks."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]], pad: bool = True) -> str:
    """A Markdown table (pastes into the README as is); ``pad``: columns aligned in text."""
    cells = [list(header), *(list(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) if pad else 0 for i in range(len(header))]
    out = []
    for k, line in enumerate(cells):
        out.append("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")
        if k == 0:
            out.append("|" + "|".join("-" * (w + 2) if pad else "---" for w in widths) + "|")
    return "\n".join(out)


def fixed_width_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], num_left: int = 1
) -> str:
    """A fixed-width table: a header, a rule, a row per item; the first ``num_left`` columns
    left-aligned, the rest right-aligned."""
    cells = [list(header), *(list(r) for r in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for j, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i < num_left else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
