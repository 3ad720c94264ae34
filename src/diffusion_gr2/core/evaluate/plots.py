"""Report figures: accuracy with intervals, valid-output rates, the speed/accuracy frontier, training
curves and speed-up by batch size.

Colours name systems and markers name thresholds, the same in every figure. There is no speed-up-by-
output-length figure: the benchmark's requests all fall in one length bucket (teacher-shaped answers of
~115 tokens), so such a plot showed two tokens of spread; a length plot needs lengths varied on purpose.

Figures are built as `matplotlib.figure.Figure` objects, never through `pyplot`: no global figure
state, no GUI backend (saving a PNG renders with Agg), so they are safe inside a Kedro run or a test.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from diffusion_gr2.core.evaluate.tables import NO_MODEL_SYSTEMS

__all__ = [
    "frontier_figure",
    "metric_figure",
    "own_valid_rate_figure",
    "speedup_by_batch_figure",
    "speedup_by_length_figure",
    "training_curves_figure",
    "valid_rate_figure",
]

_COLORS = {  # one colour per system, stable across figures
    "prerank": "#7f7f7f",
    "analyst": "#bcbd22",  # the learned analyst's noiseless order: the teacher's ceiling
    "ar_sft": "#9467bd",
    "ar_rl": "#d62728",
    "naive": "#8c564b",
    "cft": "#1f77b4",
    "opd": "#2ca02c",
    "rl": "#ff7f0e",
    "distilled": "#17becf",
    "generate": "#e377c2",  # transformers' generate on ar_rl's weights (benchmark)
}


_MARKERS = {1.0: "o", 0.9: "s", 0.6: "^", 0.4: "D"}  # one marker per threshold (tau), stable across figures
_OTHER_MARKERS = ("v", "P", "X", "h", "<", ">")
_AR_MARKER = "*"  # autoregressive systems: no threshold


def _marker(tau: float | None) -> str:
    if tau is None:
        return _AR_MARKER
    if float(tau) in _MARKERS:
        return _MARKERS[float(tau)]
    return _OTHER_MARKERS[int(round(float(tau) * 100)) % len(_OTHER_MARKERS)]


def _tau_name(tau: float | None, window: int | None = None) -> str:
    name = "AR" if tau is None else f"τ={tau:g}"
    return name + ("" if window is None else f" w{window}")


def _setting_label(system: str, tau: float | None, window: int | None, sep: str = " ") -> str:
    """`cft τ=0.9` (` w4` for a decoding window), or the bare system name when it has no threshold."""
    if tau is None:
        return str(system)
    return f"{system}{sep}τ={tau:g}" + ("" if window is None else f" w{window}")


def _label(row: Mapping[str, Any]) -> str:
    """A stage row's tick label: the setting on two lines (`cft` over `τ=0.9 w4`)."""
    return _setting_label(row["system"], row.get("tau"), row.get("window"), sep="\n")


def _color(system: str) -> str:
    return _COLORS.get(system, "#17becf")


# The rows no model wrote are drawn as levels: the pre-rank's floor dashed, the analyst's ceiling dotted.
_LEVEL_STYLES = {"prerank": "--", "analyst": ":"}


def metric_figure(stage_rows: Sequence[Mapping[str, Any]], metric: str = "recall@1") -> Figure:
    """One point per (system, tau) with its 95% bootstrap interval; the pre-rank as a dashed floor and
    the analyst as a dotted ceiling (the teacher's)."""
    fig = Figure(figsize=(max(6.0, 0.7 * len(stage_rows) + 2.0), 4.0), layout="constrained")
    ax = fig.add_subplot()
    for x, row in enumerate(stage_rows):
        low, high = row["ci"][metric]
        err = [[row[metric] - low], [high - row[metric]]]
        ax.errorbar(x, row[metric], yerr=err, fmt="o", capsize=4, color=_color(str(row["system"])))
    names = {"prerank": "pre-rank", "analyst": "analyst (teacher's ceiling)"}
    for system, style in _LEVEL_STYLES.items():
        level = [r[metric] for r in stage_rows if r["system"] == system]
        if level:
            ax.axhline(level[0], ls=style, lw=1, color=_color(system), label=names[system])
    if any(r["system"] in _LEVEL_STYLES for r in stage_rows):
        ax.legend(loc="lower right")
    ax.set_xticks(range(len(stage_rows)), [_label(r) for r in stage_rows], fontsize=8)
    ax.set_ylabel(f"{metric} (95% CI)")
    ax.set_title(f"{metric} per system and threshold")
    ax.grid(axis="y", alpha=0.3)
    return fig


def valid_rate_figure(stage_rows: Sequence[Mapping[str, Any]]) -> Figure:
    """Per (system, tau): served answers that are valid rankings (light bar) and, in front, the model's
    own valid rate: its answers decoded without the grammar (`unforced_rate`; the same bar when
    decoding is free)."""
    fig = Figure(figsize=(max(6.0, 0.7 * len(stage_rows) + 2.0), 4.0), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(stage_rows))
    colors = [_color(str(r["system"])) for r in stage_rows]
    ax.bar(xs, [r["valid_rate"] for r in stage_rows], color=colors, alpha=0.35, label="valid (served)")
    unforced = [r.get("unforced_rate", r["valid_rate"]) for r in stage_rows]
    ax.bar(xs, unforced, width=0.5, color=colors, label="own answer valid (no grammar)")
    ax.set_xticks(xs, [_label(r) for r in stage_rows], fontsize=8)
    ax.set_ylim(0.0, 1.05)
    ax.set_ylabel("share of answers")
    ax.set_title("Valid rankings per system and threshold (invalid -> pre-rank fallback)")
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return fig


def _yerr(value: float, low: float, high: float) -> list[list[float]]:
    """Error-bar lengths below and above `value` (0 where a percentile interval misses it)."""
    return [[max(value - low, 0.0)], [max(high - value, 0.0)]]


def _level_line(ax: Any, system: str, value: float | None) -> None:
    """A labelled horizontal line at the R@1 of a system no model answers (the pre-rank, the analyst)."""
    if value is None:
        return
    ax.axhline(value, ls=_LEVEL_STYLES[system], lw=1, color=_color(system))
    ax.annotate(
        system,
        (0.01, value),
        xycoords=("axes fraction", "data"),
        xytext=(0, 3),
        textcoords="offset points",
        fontsize=8,
        color=_color(system),
    )


def _frontier_panel(
    ax: Any,
    points: Sequence[Mapping[str, Any]],
    x_key: str,
    floor: float | None,
    reference: str,
    ceiling: float | None = None,
) -> None:
    """R@1 (95% CI) against `x_key`: colour = system, marker = tau (hollow = a decoding window); the
    pre-rank's R@1 (`floor`) dashed, the analyst's (`ceiling`) dotted."""
    for p in points:
        color, low, high = _color(str(p["system"])), *p["ci"]["recall@1"]
        filled = p.get("window") is None
        big = p["system"] == reference
        ax.errorbar(
            p[x_key],
            p["recall@1"],
            yerr=_yerr(p["recall@1"], low, high),
            fmt=_marker(p["tau"]),
            ms=16 if big else 8,
            color=color,
            mfc=color if filled else "none",
            mec="black" if big else color,
            elinewidth=0.8,
            alpha=0.9,
            zorder=5 if big else 3,  # the reference on top of the points it is compared with
        )
        if big:
            ax.annotate(reference, (p[x_key], p["recall@1"]), textcoords="offset points", xytext=(8, 8))
    _level_line(ax, "prerank", floor)
    _level_line(ax, "analyst", ceiling)
    ax.set_ylabel("R@1 on test (95% CI)")
    ax.grid(alpha=0.3)


def _legend_handles(points: Sequence[Mapping[str, Any]]) -> list[Any]:
    """One colour entry per system and one marker entry per tau present in `points`."""
    systems = list(dict.fromkeys(str(p["system"]) for p in points))
    taus = list(dict.fromkeys(p["tau"] for p in points))
    handles = [Line2D([], [], ls="", marker="o", color=_color(s), label=s) for s in systems]
    handles += [
        Line2D([], [], ls="", marker=_marker(t), color="black", mfc="none", label=_tau_name(t)) for t in taus
    ]
    if any(p.get("window") is not None for p in points):
        handles.append(Line2D([], [], ls="", marker="o", color="gray", mfc="none", label="hollow: window"))
    return handles


def frontier_figure(
    points: Sequence[Mapping[str, Any]],
    prerank_recall: float | None = None,
    reference: str = "ar_rl",
    analyst_recall: float | None = None,
) -> Figure:
    """The speed/accuracy frontier on test, one point per (system, tau, window).

    Each point has `system, tau, window, recall@1, ci, tokens_per_forward` and `tokens_per_s` (None when
    the benchmark did not time that setting). Left: tokens per forward (from the rankings, every
    point, machine-independent); right: output tokens/s at batch 1 under the answer grammar (the
    benchmark's timed settings only). The pre-rank and the analyst decode nothing: a dashed line at
    the pre-rank's R@1, a dotted one at the analyst's (the teacher's ceiling).
    """
    fig = Figure(figsize=(12.0, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2, sharey=True)
    _frontier_panel(left, points, "tokens_per_forward", prerank_recall, reference, analyst_recall)
    left.set_xlabel("output tokens per forward pass (rankings.parquet)")
    left.set_title("R@1 vs tokens per forward, every system and tau")
    timed = [p for p in points if p.get("tokens_per_s") is not None]
    _frontier_panel(right, timed, "tokens_per_s", prerank_recall, reference, analyst_recall)
    right.set_xlabel("output tokens/s, batch 1, under the grammar (benchmark.json)")
    right.set_title("R@1 vs tokens/s, the benchmark's settings")
    if not timed:
        right.text(
            0.5,
            0.5,
            "no benchmark.json:\nrun `make benchmark`",
            ha="center",
            va="center",
            transform=right.transAxes,
        )
    fig.legend(handles=_legend_handles(points), loc="outside right center", fontsize=8)
    return fig


def own_valid_rate_figure(stage_rows: Sequence[Mapping[str, Any]]) -> Figure:
    """The model's own valid rate (`unforced_rate`, 95% CI) per stage, in pipeline order; one marker
    per tau (hollow = a decoding window), AR stages as stars. The pre-rank and the analyst write
    nothing (`NO_MODEL_SYSTEMS`): left out."""
    rows = [r for r in stage_rows if r["system"] not in NO_MODEL_SYSTEMS]
    stages = list(dict.fromkeys(str(r["system"]) for r in rows))
    variants = list(dict.fromkeys((r["tau"], r.get("window")) for r in rows))
    fig = Figure(figsize=(max(6.0, 1.1 * len(stages) + 3.0), 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.6 / max(len(variants), 1)
    for r in rows:
        v = variants.index((r["tau"], r.get("window")))
        x = stages.index(str(r["system"])) + (v - (len(variants) - 1) / 2) * width
        low, high = r["ci"]["unforced_rate"]
        color = _color(str(r["system"]))
        ax.errorbar(
            x,
            r["unforced_rate"],
            yerr=_yerr(r["unforced_rate"], low, high),
            fmt=_marker(r["tau"]),
            ms=10 if r["tau"] is None else 7,
            color=color,
            mfc=color if r.get("window") is None else "none",
            capsize=3,
        )
    ax.legend(
        handles=[
            Line2D(
                [],
                [],
                ls="",
                marker=_marker(t),
                color="black",
                mfc="black" if w is None else "none",
                label=_tau_name(t, w),
            )
            for t, w in variants
        ],
        fontsize=8,
        loc="lower left",
    )
    ax.set_xticks(range(len(stages)), stages)
    ax.set_ylim(-0.02, 1.05)
    ax.set_ylabel("own valid rate (decoded without the grammar), 95% CI")
    ax.set_title("The model's own valid-output rate per stage (test)")
    ax.grid(axis="y", alpha=0.3)
    return fig


def training_curves_figure(
    curves: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
    left_metric: str = "loss",
    right_metric: str = "reward_mean",
) -> Figure:
    """One panel per training stage: `left_metric` against the step, and `right_metric` on a second
    axis where the stage logs it (the RL stages' mean reward). `curves[stage][metric]` = [(step, value)]."""
    stages = [s for s in curves if curves[s].get(left_metric) or curves[s].get(right_metric)]
    cols = min(3, max(len(stages), 1))
    n_rows = max(1, -(-len(stages) // cols))
    fig = Figure(figsize=(4.2 * cols, 3.0 * n_rows), layout="constrained")
    axes = fig.subplots(n_rows, cols, squeeze=False).ravel()
    for ax, stage in zip(axes, stages, strict=False):
        color = _color(stage)
        if curves[stage].get(left_metric):
            ax.plot(*zip(*curves[stage][left_metric], strict=True), color=color, lw=1)
            ax.set_ylabel(left_metric)
        if curves[stage].get(right_metric):
            twin = ax.twinx()
            twin.plot(*zip(*curves[stage][right_metric], strict=True), color="black", lw=0.8, alpha=0.6)
            twin.set_ylabel(f"{right_metric} (black)", fontsize=8)
        ax.set_title(stage)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in axes[len(stages) :]:
        ax.set_axis_off()
    if not stages:
        axes[0].text(0.5, 0.5, "no training metric history found", ha="center", va="center")
    return fig


def speedup_by_batch_figure(bench_rows: Sequence[Mapping[str, Any]], reference: str = "ar_rl") -> Figure:
    """Speed-up over `reference` (same batch size, same grammar flag) against batch size.

    One line per system at its operating point (`generate` included); solid = under the answer
    grammar (as served), dashed = free. A diffusion system with no operating point (refused) is drawn
    at the tau it was timed at across batch sizes (the one with most of them), dotted, "not served".
    Other sweep rows belong to the frontier.
    """
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.add_subplot()
    served = {r["system"] for r in bench_rows if r["operating_point"]}
    series: dict[tuple[str, Any, Any, bool], list[tuple[int, float]]] = {}
    for row in bench_rows:
        shown = row["operating_point"] or row["system"] not in served
        if shown and row["system"] != reference and row["speedup_vs_ar"] is not None:
            key = (row["system"], row["tau"], row["window"], row["constrained"])
            series.setdefault(key, []).append((row["batch_size"], row["speedup_vs_ar"]))
    widest: dict[str, tuple[int, float, int]] = {}  # unserved system -> its line with most batch sizes
    for (system, tau, window, _), points in series.items():
        if system not in served:
            line = (len(points), float(tau), -1 if window is None else int(window))
            widest[system] = max(widest.get(system, line), line)
    for (system, tau, window, constrained), points in series.items():
        unserved = system not in served
        if unserved and (float(tau), -1 if window is None else int(window)) != widest[system][1:]:
            continue
        points.sort()
        label = _setting_label(system, tau, window) + (" (grammar)" if constrained else " (free)")
        label += " not served" if unserved else ""
        style = ":" if unserved else "-" if constrained else "--"
        ax.plot(*zip(*points, strict=True), style, marker="o", label=label, color=_color(system))
    ax.set_xscale("log", base=2)
    sizes = sorted({int(r["batch_size"]) for r in bench_rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    _finish_speedup_axes(
        ax,
        reference,
        "batch size",
        "Speed-up by batch size: operating points (dotted: no operating point, not served)",
    )
    return fig


def _finish_speedup_axes(ax: Any, reference: str, xlabel: str, title: str) -> None:
    """The reference line at 1, labels, grid and legend of a speed-up figure."""
    ax.axhline(1.0, ls=":", lw=1, color=_color(reference), label=f"{reference} (= 1)")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"speed-up vs {reference} (output tokens/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def speedup_by_length_figure(length_rows: Sequence[Mapping[str, Any]], reference: str = "ar_rl") -> Figure:
    """Speed-up over `reference` against mean output length, the length varied by reasoning budget.

    One line per system and setting through its budgets (`speedup_by_length.json`), batch 1 under
    the grammar; colour = system, marker = tau; dotted = a system with no operating point (not
    served). Each point's label is its budget (max_new_tokens).
    """
    fig = Figure(figsize=(7.0, 4.5), layout="constrained")
    ax = fig.add_subplot()
    lines: dict[tuple[str, Any, Any, bool], list[Mapping[str, Any]]] = {}
    for row in length_rows:
        if row["system"] != reference and row.get("speedup") is not None:
            key = (row["system"], row["tau"], row["window"], bool(row["operating_point"]))
            lines.setdefault(key, []).append(row)
    for (system, tau, window, served), rows in lines.items():
        rows = sorted(rows, key=lambda r: r["mean_output_tokens"])
        xs, ys = [r["mean_output_tokens"] for r in rows], [r["speedup"] for r in rows]
        label = _setting_label(system, tau, window) + ("" if served else " not served")
        ax.plot(xs, ys, "-" if served else ":", marker=_marker(tau), label=label, color=_color(system))
        for r, x, y in zip(rows, xs, ys, strict=True):
            ax.annotate(str(r["budget"]), (x, y), textcoords="offset points", xytext=(3, 4), fontsize=6)
    _finish_speedup_axes(
        ax,
        reference,
        "mean output tokens (reasoning budget = max_new_tokens, labelled)",
        "Speed-up by output length, batch 1, under the grammar",
    )
    return fig
