"""The one Markdown table renderer of the evaluation: a table from its header and cell rows, and the
cells every table of the run prints (a figure with its interval, tau, window).

`rankings.metrics_markdown` (`stage_metrics.md`), the report's stage table (`report._stage_section`,
and its other tables) and the results table (`results.results_table`, `make results`) all render
through these, so a figure reads the same wherever it is printed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "NO_MODEL_SYSTEMS",
    "interval",
    "markdown_table",
    "metric_cell",
    "missing",
    "paired_cell",
    "paired_row",
    "same_setting",
    "tau_cell",
    "window_cell",
]

DASH = "—"  # an empty setting (AR: no tau; the whole block: no window)
# Rows no model wrote (no tokens, no forwards, no speed, no training curve): the retriever's order
# (`prerank`) and the learned analyst's noiseless order, the teacher's ceiling (`analyst`).
NO_MODEL_SYSTEMS = ("prerank", "analyst")


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """`| a | b |`, `|---|---|`, then a line per row; no trailing newline."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def missing(value: Any) -> bool:
    """None or NaN: a figure that is not there."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def interval(
    value: Any,
    low: Any,
    high: Any,
    digits: int = 4,
    bound_digits: int = 3,
    signed: bool = False,
    empty: str | None = None,
) -> str:
    """`0.1854 [0.119, 0.252]`; `signed` for differences (`+0.0132 [-0.053, +0.073]`). With `empty`,
    a value that is not there (None, NaN) prints as `empty`; without it, as Python formats it."""
    if empty is not None and missing(value):
        return empty
    sign = "+" if signed else ""
    return f"{value:{sign}.{digits}f} [{low:{sign}.{bound_digits}f}, {high:{sign}.{bound_digits}f}]"


def metric_cell(row: Mapping[str, Any], metric: str, digits: int = 4, bound_digits: int = 3) -> str:
    """A `stage_metrics.json` row's metric with its 95% interval (`row["ci"][metric]`)."""
    low, high = row["ci"][metric]
    return interval(row[metric], low, high, digits, bound_digits)


def tau_cell(row: Mapping[str, Any]) -> str:
    """`0.9`, or `—` for an AR row (no threshold)."""
    return DASH if row.get("tau") is None else f"{row['tau']:g}"


def window_cell(row: Mapping[str, Any]) -> str:
    """The decoding window, or `—` for the whole block."""
    return DASH if row.get("window") is None else str(row["window"])


def same_setting(a: Any, b: Any) -> bool:
    """Equal settings, None and NaN alike (AR rows have no tau, whole-block rows no window)."""
    gone = [v is None or (isinstance(v, float) and math.isnan(v)) for v in (a, b)]
    if any(gone):
        return all(gone)
    return float(a) == float(b)


def paired_row(
    rows: Sequence[Mapping[str, Any]],
    split: str,
    system: str,
    tau: Any,
    window: Any,
    baseline: str,
    metric: str = "recall@1",
) -> Mapping[str, Any] | None:
    """The `comparisons.json` row of `system` at (tau, window) against `baseline` on `split`, or None."""
    return next(
        (
            r
            for r in rows
            if r["split"] == split
            and r["metric"] == metric
            and r["system"] == system
            and r["baseline"] == baseline
            and same_setting(r.get("tau"), tau)
            and same_setting(r.get("window"), window)
        ),
        None,
    )


def paired_cell(row: Mapping[str, Any] | None, digits: int = 3) -> str:
    """A paired difference with its interval, signed (`+0.012 [-0.003, +0.027]`); `-` where none."""
    if row is None:
        return "-"
    return f"{row['mean_diff']:+.{digits}f} [{row['low']:+.{digits}f}, {row['high']:+.{digits}f}]"
