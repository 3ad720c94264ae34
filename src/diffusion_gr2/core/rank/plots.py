"""Report figures: accuracy with intervals, valid-output rate, speed-up by output length and by batch size.

Figures are built as `matplotlib.figure.Figure` objects, never through `pyplot`: no global figure
state, no GUI backend (saving a PNG renders with Agg), so they are safe inside a Kedro run or a test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure

__all__ = ["metric_figure", "speedup_by_batch_figure", "speedup_figure", "valid_rate_figure"]

_COLORS = {  # one colour per system, stable across figures
    "prerank": "#7f7f7f",
    "ar_sft": "#9467bd",
    "ar_rl": "#d62728",
    "naive": "#8c564b",
    "cft": "#1f77b4",
    "opd": "#2ca02c",
    "rl": "#ff7f0e",
    "generate": "#e377c2",  # transformers' generate on ar_rl's weights (benchmark)
}


def _label(row: Mapping[str, Any]) -> str:
    """`cft\\nτ=0.9` (`w4` for a decoding window), or the bare system name when it has no threshold."""
    if row.get("tau") is None:
        return str(row["system"])
    window = "" if row.get("window") is None else f" w{row['window']}"
    return f"{row['system']}\nτ={row['tau']:g}{window}"


def _color(system: str) -> str:
    return _COLORS.get(system, "#17becf")


def metric_figure(stage_rows: Sequence[Mapping[str, Any]], metric: str = "recall@1") -> Figure:
    """One point per (system, tau) with its 95% bootstrap interval; the pre-rank as a dashed floor."""
    fig = Figure(figsize=(max(6.0, 0.7 * len(stage_rows) + 2.0), 4.0), layout="constrained")
    ax = fig.add_subplot()
    for x, row in enumerate(stage_rows):
        low, high = row["ci"][metric]
        err = [[row[metric] - low], [high - row[metric]]]
        ax.errorbar(x, row[metric], yerr=err, fmt="o", capsize=4, color=_color(str(row["system"])))
    floor = [r[metric] for r in stage_rows if r["system"] == "prerank"]
    if floor:
        ax.axhline(floor[0], ls="--", lw=1, color=_color("prerank"), label="pre-rank")
        ax.legend(loc="lower right")
    ax.set_xticks(range(len(stage_rows)), [_label(r) for r in stage_rows], fontsize=8)
    ax.set_ylabel(f"{metric} (95% CI)")
    ax.set_title(f"{metric} per system and threshold")
    ax.grid(axis="y", alpha=0.3)
    return fig


def valid_rate_figure(stage_rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Per (system, tau): served answers that are valid rankings (light bar) and, in front, those the
    model wrote with no grammar correction (`unforced_rate`; the same bar when decoding is free)."""
    fig = Figure(figsize=(max(6.0, 0.7 * len(stage_rows) + 2.0), 4.0), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(stage_rows))
    colors = [_color(str(r["system"])) for r in stage_rows]
    ax.bar(xs, [r["valid_rate"] for r in stage_rows], color=colors, alpha=0.35, label="valid (served)")
    unforced = [r.get("unforced_rate", r["valid_rate"]) for r in stage_rows]
    ax.bar(xs, unforced, width=0.5, color=colors, label="valid without grammar correction")
    ax.set_xticks(xs, [_label(r) for r in stage_rows], fontsize=8)
    ax.set_ylim(0.0, 1.05)
    ax.set_ylabel("share of answers")
    ax.set_title("Valid rankings per system and threshold (invalid -> pre-rank fallback)")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def speedup_figure(length_rows: Sequence[Mapping[str, Any]], reference: str = "ar_rl") -> Figure:
    """Speed-up over the AR reference against output length, one line per (system, tau)."""
    fig = Figure(figsize=(6.5, 4.0), layout="constrained")
    ax = fig.add_subplot()
    series: dict[tuple[str, Any, Any], list[tuple[float, float]]] = {}
    for row in length_rows:
        if row["system"] != reference and row.get("speedup") is not None:
            series.setdefault((row["system"], row["tau"], row.get("window")), []).append(
                (row["mean_output_tokens"], row["speedup"])
            )
    for (system, tau, window), points in series.items():
        points.sort()
        label = system if tau is None else f"{system} τ={tau:g}"
        label += "" if window is None else f" w{window}"
        ax.plot(*zip(*points, strict=True), marker="o", label=label, color=_color(system))
    ax.axhline(1.0, ls="--", lw=1, color=_color(reference), label=reference)
    ax.set_xlabel("output tokens (bucket mean)")
    ax.set_ylabel(f"speed-up vs {reference} (output tokens/s)")
    ax.set_title("Speed-up by output length (batch 1)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def speedup_by_batch_figure(bench_rows: Sequence[Mapping[str, Any]], reference: str = "ar_rl") -> Figure:
    """Speed-up over `reference` (same batch size, same grammar flag) against batch size.

    One line per system at its operating point (`generate` included); solid = under the answer
    grammar (as served), dashed = free. Sweep rows (not operating points) belong to the frontier.
    """
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.add_subplot()
    series: dict[tuple[str, Any, Any, bool], list[tuple[int, float]]] = {}
    for row in bench_rows:
        if row["operating_point"] and row["system"] != reference and row["speedup_vs_ar"] is not None:
            key = (row["system"], row["tau"], row["window"], row["constrained"])
            series.setdefault(key, []).append((row["batch_size"], row["speedup_vs_ar"]))
    for (system, tau, window, constrained), points in series.items():
        points.sort()
        label = system if tau is None else f"{system} τ={tau:g}"
        label += ("" if window is None else f" w{window}") + (" (grammar)" if constrained else " (free)")
        style = "-" if constrained else "--"
        ax.plot(*zip(*points, strict=True), style, marker="o", label=label, color=_color(system))
    ax.axhline(1.0, ls=":", lw=1, color=_color(reference), label=f"{reference} (= 1)")
    ax.set_xscale("log", base=2)
    sizes = sorted({int(r["batch_size"]) for r in bench_rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel(f"speed-up vs {reference} (output tokens/s)")
    ax.set_title("Speed-up by batch size, at each system's operating point")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig
