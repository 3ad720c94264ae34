"""The run report: every figure a reader needs, in one markdown file and one self-contained HTML file.

Every number comes from the run's own files (docs/evaluation.md#which-run-a-figure-came-from):
`data_stats.json`, `sid_report.json`, `retrieval_report.json`, `stage_metrics.json`,
`comparisons.json`, `operating_point.json`, `reasoning_metrics.json`, `benchmark.json` (after `make
benchmark`), `decode_profile.json` (after `benchmarks/decode_profile.py`), the rankings (tokens per
forward) and the training stages' MLflow metric history, taken from the run the stage table came
from (`report_run`). A file that is absent gives a section saying so and naming the command that
writes it; nothing is estimated in its place. Tables print 4 decimals (intervals 3), which is what a
reader can check back against the JSON files.
"""

from __future__ import annotations

import base64
import html
import io
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
from markdown_it import MarkdownIt
from matplotlib.figure import Figure

from diffusion_gr2.core.base.manifest import RunSources
from diffusion_gr2.core.evaluate.metrics import REASONING_METRICS
from diffusion_gr2.core.evaluate.plots import (
    frontier_figure,
    own_valid_rate_figure,
    speedup_by_batch_figure,
    speedup_by_length_figure,
    training_curves_figure,
)
from diffusion_gr2.core.evaluate.results import results_table, runs_text
from diffusion_gr2.core.evaluate.tables import (
    DASH,
    NO_MODEL_SYSTEMS,
    interval,
    markdown_table,
    paired_cell,
    paired_row,
    tau_cell,
    window_cell,
)

logger = logging.getLogger(__name__)

__all__ = [
    "STAGE_COLUMNS",
    "Curves",
    "ReportInputs",
    "decoding_stats",
    "frontier_points",
    "load_training_curves",
    "markdown_to_html",
    "missing_curves",
    "render_markdown",
    "report_figures",
    "report_run",
]

Curves = dict[str, dict[str, list[tuple[int, float]]]]  # stage -> metric -> [(step, value)]
# Stage-table metrics, in column order, with their header (the `stage_metrics.json` keys).
STAGE_COLUMNS = (
    ("recall@1", "R@1"),
    ("recall@3", "R@3"),
    ("recall@5", "R@5"),
    ("ndcg@3", "NDCG@3"),
    ("ndcg@5", "NDCG@5"),
    ("mrr", "MRR"),
    ("valid_rate", "valid (served)"),
    ("unforced_rate", "own valid"),
    ("prerank_copy_rate", "own valid, pre-rank's order"),  # of own valid: not re-ranked
)
BENCHMARK_COLUMNS = (
    ("output_tokens_per_s", "tokens/s", 1),
    ("nfe_per_sample", "NFE/request", 2),
    ("tokens_per_forward", "tokens/forward", 3),
    ("latency_p50_ms", "p50 ms", 1),
    ("latency_p95_ms", "p95 ms", 1),
    ("mean_output_tokens", "output tokens", 1),
)  # then the speed-up vs ar_rl with its interval (`_ratio`)
PLOTS = {  # figure name -> file under data/08_reporting/plots (the catalog writes them there)
    "frontier": "plots/frontier.png",
    "own_valid_rate": "plots/own_valid_rate.png",
    "training_curves": "plots/training_curves.png",
    "speedup_by_batch": "plots/speedup_by_batch.png",
    "speedup_by_length": "plots/speedup_by_length.png",
}


@dataclass(frozen=True)
class ReportInputs:
    """The run's files, as loaded; None = the file is absent."""

    stage_metrics: Sequence[Mapping[str, Any]]
    comparisons: Sequence[Mapping[str, Any]]
    reasoning: Sequence[Mapping[str, Any]]
    decoding: Sequence[Mapping[str, Any]]  # `decoding_stats(rankings)`
    operating_point: Mapping[str, Any] | None = None
    data_stats: Mapping[str, Any] | None = None
    sid_report: Mapping[str, Any] | None = None
    retrieval_report: Mapping[str, Any] | None = None
    benchmark: Sequence[Mapping[str, Any]] | None = None
    speedup_by_length: Sequence[Mapping[str, Any]] | None = None
    decode_profile: Mapping[str, Any] | None = None
    runs: RunSources | None = None  # the report files' manifests: the runs their figures came from
    # the run writing the report (its id), whose minutes are recorded only when it ends
    writing_run: str | None = None
    training_curves: Curves = field(default_factory=dict)  # from the report's run (`report_run`)
    training_stages: Sequence[str] = ()  # the stages whose curves the report shows (`missing_curves`)
    reference: str = "ar_rl"  # the AR system speed-ups and frontier marks refer to
    split: str = "test"  # the reported split (valid chooses)


# ---- figures from the files ----------------------------------------------------------------------


def _key(row: Mapping[str, Any]) -> tuple[str, str, float | None, int | None]:
    return (str(row.get("split", "test")), str(row["system"]), row.get("tau"), row.get("window"))


def decoding_stats(rankings: pd.DataFrame) -> list[dict[str, Any]]:
    """Per (split, system, tau, window): `n`, mean output tokens and forwards, and output tokens per
    forward (all tokens over all forwards, as the benchmark counts them); 0 for the pre-rank."""
    frame = rankings.assign(
        tau=rankings["tau"].astype("float64"), window=rankings["window"].astype("float64")
    )
    out = []
    for (split, system, tau, window), g in frame.groupby(
        ["split", "system", "tau", "window"], sort=False, dropna=False
    ):
        nfe = int(g["nfe"].sum())
        out.append(
            {
                "split": str(split),
                "system": str(system),
                "tau": None if pd.isna(tau) else float(tau),
                "window": None if pd.isna(window) else int(window),
                "n": len(g),
                "mean_output_tokens": float(g["output_tokens"].mean()),
                "mean_nfe": float(g["nfe"].mean()),
                "tokens_per_forward": float(g["output_tokens"].sum()) / nfe if nfe else 0.0,
            }
        )
    return out


def frontier_points(inputs: ReportInputs) -> list[dict[str, Any]]:
    """One point per model variant on the reported split: R@1 and its interval, tokens per forward
    (rankings) and output tokens/s at batch 1 under the grammar (benchmark.json; None if not timed).
    The rows no model wrote (`NO_MODEL_SYSTEMS`) decode nothing: lines of the figure, not points."""
    decoding = {_key(d): d for d in inputs.decoding}
    timed = {
        (inputs.split, str(b["system"]), b["tau"], b["window"]): b["output_tokens_per_s"]
        for b in inputs.benchmark or ()
        if b["batch_size"] == 1 and b["constrained"]
    }
    points = []
    for row in inputs.stage_metrics:
        key = _key(row)
        if key[0] != inputs.split or row["system"] in NO_MODEL_SYSTEMS or key not in decoding:
            continue
        points.append(
            {
                "system": row["system"],
                "tau": row["tau"],
                "window": row.get("window"),
                "recall@1": row["recall@1"],
                "ci": {"recall@1": row["ci"]["recall@1"]},
                "tokens_per_forward": decoding[key]["tokens_per_forward"],
                "tokens_per_s": timed.get(key),
            }
        )
    return points


def _reported(inputs: ReportInputs) -> list[Mapping[str, Any]]:
    return [r for r in inputs.stage_metrics if r.get("split", "test") == inputs.split]


def report_figures(inputs: ReportInputs) -> dict[str, Figure]:
    """The report's figures by name (`PLOTS`); the batch sweep only when there is a benchmark."""
    reported = _reported(inputs)
    prerank, analyst = (
        next((r["recall@1"] for r in reported if r["system"] == s), None) for s in NO_MODEL_SYSTEMS
    )
    figures = {
        "frontier": frontier_figure(frontier_points(inputs), prerank, inputs.reference, analyst),
        "own_valid_rate": own_valid_rate_figure(reported),
        "training_curves": training_curves_figure(inputs.training_curves),
    }
    if inputs.benchmark:
        figures["speedup_by_batch"] = speedup_by_batch_figure(inputs.benchmark, inputs.reference)
    if inputs.speedup_by_length and any(r.get("budget") is not None for r in inputs.speedup_by_length):
        figures["speedup_by_length"] = speedup_by_length_figure(inputs.speedup_by_length, inputs.reference)
    return figures


# ---- MLflow metric history -------------------------------------------------------------------------


def report_run(runs: RunSources | None, writing_run: str | None) -> str | None:
    """The MLflow run a report's figures come from: the run that wrote `stage_metrics.json` (the stage
    table's run, which `runs` carries in that file's manifest), else the run writing the report.

    A report the benchmark re-renders keeps the stage table's run, so its training curves stay those
    of the run its accuracy figures came from. None: that file was written outside an MLflow run.
    """
    manifest = None if runs is None else runs.manifests.get("stage_metrics.json")
    return writing_run if manifest is None else manifest.run_id


def load_training_curves(
    run_id: str | None, stages: Sequence[str], metrics: Sequence[str] = ("loss", "reward_mean")
) -> Curves:
    """`<stage>.<metric>` step histories logged on the MLflow run `run_id` (the report's, `report_run`).

    The training loop logs every stage under its name (`MlflowTracker(stage)`) on the run that trains
    it. A stage that run did not train (a run of `evaluation` alone trains none) is absent, never
    taken from another run; the report names it (`missing_curves`). None, or a run the store does
    not hold: no curves.
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    if run_id is None:
        return {}
    client = mlflow.MlflowClient()
    try:
        logged = client.get_run(run_id).data.metrics
    except MlflowException:
        logger.warning("Run %s is not in the MLflow store: the report has no training curves", run_id)
        return {}
    curves: Curves = {}
    for stage in stages:
        for metric in metrics:
            name = f"{stage}.{metric}"
            if name in logged:
                history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, name))
                curves.setdefault(stage, {})[metric] = history
    return curves


def missing_curves(inputs: ReportInputs) -> list[str]:
    """The training stages the report asks for (`training_stages`) whose curves its run lacks."""
    return [s for s in inputs.training_stages if not any(inputs.training_curves.get(s, {}).values())]


# ---- markdown ----------------------------------------------------------------------------------------


def _num(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    return f"{value:.{digits}f}"


def _cell(row: Mapping[str, Any], metric: str, signed: bool = False) -> str:
    """`0.1854 [0.119, 0.252]`; `signed` for differences (`+0.0132 [-0.053, +0.073]`); `—` for a
    metric a row does not have (a file older than the metric)."""
    if "ci" in row and metric not in row["ci"]:
        return "—"
    low, high = row["ci"][metric] if "ci" in row else (row["low"], row["high"])
    value = row[metric] if metric in row else row["mean_diff"]
    return interval(value, low, high, signed=signed)


def _ratio(row: Mapping[str, Any], name: str) -> str:
    """A speed-up with its interval, `1.5200 [1.310, 1.600]` (the `name`, `name_low`, `name_high` keys of
    the timing harness); `—` when not timed against the reference, or in a file older than intervals."""
    value, low, high = (row.get(k) for k in (name, f"{name}_low", f"{name}_high"))
    if value is None or low is None or high is None:
        return DASH
    return interval(value, low, high)


def _paired(row: Mapping[str, Any], key: str) -> str:
    """A candidate's paired R@1 difference, `+0.0120 [-0.010, +0.034] (1267)` (`operating_point.paired_recall`);
    `—` in a file older than the paired rule."""
    value, low, high, n = (row.get(k) for k in (key, f"{key}.low", f"{key}.high", f"{key}.n"))
    if value is None or low is None or high is None:
        return DASH
    return f"{interval(value, low, high, signed=True)} ({n})"


def _statistics(rows: Sequence[Mapping[str, Any]]) -> str:
    """The harness statistic the rows name (`statistic`), for the text above their table."""
    names = sorted({str(r["statistic"]) for r in rows if r.get("statistic")})
    return "; ".join(names) if names else "not named (a file older than the timing harness)"


def _served(inputs: ReportInputs) -> set[tuple[str, float | None, int | None]]:
    """(system, tau, window) each diffusion system is served at (operating_point.json)."""
    return {
        (system, p["tau"], p.get("window"))
        for system, p in (inputs.operating_point or {}).items()
        if p.get("tau") is not None
    }


def _absent(name: str, command: str) -> str:
    return f"*`{name}` is absent from this run: `{command}` writes it.*"


def _inputs_section(inputs: ReportInputs) -> str:
    parts = ["## Data, semantic IDs and retriever"]
    if inputs.data_stats is None:
        parts.append(_absent("data_stats.json", "kedro run --pipelines data_prep"))
    else:
        d = inputs.data_stats
        rows = [[k, _num(d[k], 2) if isinstance(d[k], float) else str(d[k])] for k in (
            "users", "items", "interactions", "mean_history", "median_history", "rows_read", "rows_rejected"
        ) if k in d]  # fmt: skip
        rows += [[f"split `{s}` (interactions)", str(n)] for s, n in d.get("splits", {}).items()]
        parts.append("Dataset (`data_stats.json`):\n\n" + markdown_table(["statistic", "value"], rows))
    if inputs.sid_report is None:
        parts.append(_absent("sid_report.json", "kedro run --pipelines semantic_ids"))
    else:
        s = inputs.sid_report
        rows = [
            ["levels", str(s["levels"])],
            ["codebook sizes", ", ".join(str(c) for c in s["codebook_sizes"])],
            ["unique with 3 levels", _num(s["uniqueness_3"])],
            ["unique with 4 levels", _num(s["uniqueness_4"])],
            ["collisions with 3 levels", str(s["collisions_3"])],
            ["embedding model", f"`{s['embedding_model']}`"],
        ]
        parts.append("Semantic IDs (`sid_report.json`):\n\n" + markdown_table(["statistic", "value"], rows))
    if inputs.retrieval_report is None:
        parts.append(_absent("retrieval_report.json", "kedro run --pipelines retrieval"))
    else:
        r = inputs.retrieval_report
        rows = [
            [name, _num(r[name]["recall@10"]), _num(r[name]["ndcg@10"])]
            for name in ("retriever", "popularity")
        ]
        kept = ", ".join(f"{s} {_num(v)}" for s, v in r.get("users_kept", {}).items())
        requests = ", ".join(f"{s} {n}" for s, n in r.get("rows", {}).items())
        parts.append(
            "First-stage retriever (`retrieval_report.json`, full catalog):\n\n"
            + markdown_table(["model", "Recall@10", "NDCG@10"], rows)
            + f"\n\nCandidate mode `{r.get('candidate_mode')}`; share of users kept: {kept}"
            + (f"; requests: {requests}." if requests else ".")
        )
    return "\n\n".join(parts)


def _stage_section(inputs: ReportInputs) -> str:
    served, decoding = _served(inputs), {_key(d): d for d in inputs.decoding}
    head = ["system", "tau", "window", "served", "n", *(h for _, h in STAGE_COLUMNS)]
    head += ["R@1 vs ar_rl (paired)", "R@1 vs pre-rank (paired)", "tokens/forward"]
    rows = []
    for row in _reported(inputs):
        at = (row["system"], row["tau"], row.get("window"))
        tpf = decoding.get(_key(row), {}).get("tokens_per_forward") or None  # NO_MODEL_SYSTEMS: none
        cells = [
            str(row["system"]),
            tau_cell(row),
            window_cell(row),
            "yes" if at in served else "",
            str(row["n"]),
        ]
        versus = [
            DASH
            if row["system"] == base
            else paired_cell(paired_row(inputs.comparisons, inputs.split, *at, base))
            for base in ("ar_rl", "prerank")
        ]
        rows.append(cells + [_cell(row, m) for m, _ in STAGE_COLUMNS] + versus + [_num(tpf, 3)])
    text = (
        f"## Stage table ({inputs.split})\n\n"
        "Every system at each threshold, 95% bootstrap intervals over users (`stage_metrics.json`). "
        "tau — = autoregressive; window — = the whole block fed at every step; *served* = the "
        "operating point chosen on validation (`operating_point.json`). *valid (served)*: answers that "
        "are valid rankings as served (under the answer grammar when decoding is constrained); *own "
        "valid*: requests whose answer decoded without the grammar (a second, free pass) is valid, "
        "the model's own valid-output rate; *own valid, pre-rank's order*: of those, the answers that "
        "copy the pre-rank's list unchanged. *vs ar_rl*, *vs pre-rank*: the paired R@1 difference on the "
        "same requests, with its 95% interval (`comparisons.json`). "
        + (
            "*analyst*: the learned analyst's noiseless order over the evidence (no model), the "
            "teacher's ceiling: a model trained on its traces can at best learn what it knows. "
            if any(r["system"] == "analyst" for r in _reported(inputs))
            else ""
        )
        + "tokens/forward: output tokens over forward passes (`rankings.parquet`).\n\n"
        + markdown_table(head, rows)
    )
    return text + "\n\n" + _operating_point_section(inputs)


def _operating_point_section(inputs: ReportInputs) -> str:
    if inputs.operating_point is None:
        return _absent("operating_point.json", "kedro run --pipelines inference")
    rows = []
    for system, p in inputs.operating_point.items():
        chosen = p.get("chosen") or {}
        rows.append(
            [
                system,
                tau_cell(p),
                window_cell(p),
                _num(p.get("budget")),
                f"{p.get('reference', '')} {_num(p.get('reference_recall@1'))}",
                _num(chosen.get("recall@1")),
                _num(chosen.get("unforced_rate")),
                _num(chosen.get("tokens_per_forward"), 3),
                _num(chosen.get("tokens_per_s"), 1),
                str(p.get("refused") or ""),
            ]
        )
    head = ["system", "tau", "window", "R@1 budget", "reference R@1", "R@1", "own valid", "tokens/forward",
            "tokens/s", "refused"]  # fmt: skip
    return (
        "### Served operating points (chosen on validation, `operating_point.json`)\n\n"
        "The fastest (tau, window) whose R@1 as served on validation, paired with the reference's on "
        "the same requests, has a 95% interval (users resampled) with its lower bound >= -budget; the "
        "figures are validation's.\n\n" + markdown_table(head, rows) + _candidates_table(inputs)
    )


def _candidates_table(inputs: ReportInputs) -> str:
    """Every candidate the choice saw, with the timed speeds it was ranked by (when timed)."""
    assert inputs.operating_point is not None
    points = inputs.operating_point.items()
    batches = sorted(
        {
            int(b)
            for _, p in points
            for c in p.get("candidates", [])
            for b in c.get("tokens_per_s_by_batch") or {}
        }
    )
    rows = []
    for system, p in points:
        chosen = p.get("chosen") or {}
        for c in p.get("candidates", []):
            by_batch = c.get("tokens_per_s_by_batch") or {}
            picked = (c.get("tau"), c.get("window")) == (chosen.get("tau"), chosen.get("window"))
            rows.append(
                [
                    system,
                    tau_cell(c),
                    window_cell(c),
                    _num(c.get("recall@1")),
                    _paired(c, f"recall@1_vs_{inputs.reference}"),
                    _num(c.get("unforced_rate")),
                    _num(c.get("tokens_per_forward"), 3),
                    *(_num(by_batch.get(str(b)), 1) for b in batches),
                    _num(c.get("tokens_per_s") if by_batch or not batches else None, 1),
                    _ratio(c, f"speedup_vs_{inputs.reference}"),
                    "yes" if picked else "",
                ]  # fmt: skip
            )
    if not rows:
        return ""
    head = ["system", "tau", "window", "R@1", f"R@1 - {inputs.reference} [interval] (n)", "own valid",
            "tokens/forward", *(f"tokens/s @{b}" for b in batches), "speed ranked",
            f"speed-up vs {inputs.reference} [interval]",
            "chosen"]  # fmt: skip
    candidates = [c for _, p in points for c in p.get("candidates", [])]
    timed = (
        f" Speeds timed side by side on the first validation prompts at batch {', '.join(map(str, batches))}, "
        f"with `{inputs.reference}` in the same interleaved rounds; *speed ranked* is per round the geometric "
        "mean over the batch sizes, the speed-up per round the geometric mean of the ratios, paired by "
        f"round ({_statistics(candidates)}). A candidate that misses the R@1 budget or the own-valid "
        "floor cannot be served and is not timed (—)."
        if batches
        else " Speeds are the validation passes' own."
    )
    return "\n\nCandidates (validation)." + timed + "\n\n" + markdown_table(head, rows)


def _comparison_section(inputs: ReportInputs) -> str:
    cmp = [c for c in inputs.comparisons if c.get("split", "test") == inputs.split]
    pairs = list(dict.fromkeys((c["baseline"], c["metric"]) for c in cmp))
    by_row: dict[tuple[str, Any, Any], dict[tuple[str, str], Mapping[str, Any]]] = {}
    for c in cmp:
        by_row.setdefault((c["system"], c["tau"], c.get("window")), {})[(c["baseline"], c["metric"])] = c
    rows = []
    for row in _reported(inputs):  # in the stage table's order
        cells = by_row.get((row["system"], row["tau"], row.get("window")), {})
        if cells:
            head = [str(row["system"]), tau_cell(row), window_cell(row)]
            rows.append(
                head + [_cell(cells[p], "mean_diff", signed=True) if p in cells else "" for p in pairs]
            )
    return (
        f"## Paired differences ({inputs.split}, `comparisons.json`)\n\n"
        "System minus baseline on the same requests, mean and 95% paired-bootstrap interval (resampling "
        "whole users). An interval that contains 0 does not resolve the difference.\n\n"
        + markdown_table(["system", "tau", "window", *(f"Δ {m} vs {b}" for b, m in pairs)], rows)
    )


def _reasoning_section(inputs: ReportInputs) -> str:
    rows = []
    for r in inputs.reasoning:
        if r.get("split", "test") == inputs.split:
            cells = [str(r["system"]), tau_cell(r), window_cell(r), str(r["n"])]
            rows.append(cells + [_cell(r, m) for m in REASONING_METRICS])
    head = ["system", "tau", "window", "n", "has explanation", "cites a SID", "grounded", "pick = ranking #1",
            "explanation tokens"]  # fmt: skip
    return (
        f"## Reasoning quality ({inputs.split}, `reasoning_metrics.json`; no LLM judge)\n\n"
        "Per answer, from its text and its prompt alone (`core/evaluate/metrics.py`). *grounded*: the "
        "explanation cites at least one SID and every SID-token run it writes is a SID shown in the "
        "prompt (history or candidates); a truncated or repeated SID counts as not shown. *pick = "
        "ranking #1*: the stated top pick, i.e. the first candidate SID the explanation cites (the "
        "teacher's traces cite their best candidate first and pick it), is the first item of the "
        "served ranking. *explanation tokens*: length of the explanation string in the model's tokens. "
        "Means with 95% bootstrap intervals.\n\n" + markdown_table(head, rows)
    )


def _benchmark_section(inputs: ReportInputs) -> str:
    title = "## Decode benchmark (`benchmark.json`)\n\n"
    if not inputs.benchmark:
        return (
            title
            + _absent("benchmark.json", "make benchmark")
            + (
                " It times `ar_rl`, `generate` and each diffusion system at its operating point at batch "
                "1, 4, 16 and 32, and re-renders this report with the table and the batch-size plot."
            )
        )
    device = ", ".join(sorted({str(b["device"]) for b in inputs.benchmark}))
    rows = []
    for b in inputs.benchmark:
        cells = [str(b["system"]), tau_cell(b), window_cell(b), "yes" if b.get("operating_point") else "sweep",
                 str(b["batch_size"]), "grammar" if b["constrained"] else "free"]  # fmt: skip
        rows.append(cells + [_num(b[k], d) for k, _, d in BENCHMARK_COLUMNS] + [_ratio(b, "speedup_vs_ar")])
    head = [
        "system",
        "tau",
        "window",
        "operating point",
        "batch",
        "decoding",
        *(h for _, h, _ in BENCHMARK_COLUMNS),
        f"speed-up vs {inputs.reference} [interval]",
    ]
    return (
        title + f"One run on `{device}`. Output tokens/s counts output tokens only; latency is per "
        f"request; speed-up is against `{inputs.reference}` at the same batch size and grammar flag, in "
        "the same run, paired by round. Tokens/s and speed-ups: "
        f"{_statistics(inputs.benchmark)}. *sweep* rows are the threshold sweep behind the frontier."
        "\n\n" + markdown_table(head, rows)
    )


def _profile_section(inputs: ReportInputs) -> str:
    """Where decode time goes (`benchmarks/decode_profile.py`), and what a forward costs by width."""
    title = "## Where decode time goes (`decode_profile.json`)\n\n"
    if inputs.decode_profile is None:
        return title + _absent(
            "decode_profile.json",
            "python benchmarks/decode_profile.py --json data/08_reporting/decode_profile.json",
        )
    rows = []
    for s in inputs.decode_profile["settings"]:
        wall = s["wall_s"] or float("nan")
        rows.append(
            [
                str(s["system"]),
                tau_cell(s),
                str(s.get("window") or "—"),
                str(s["batch"]),
                _num(s["tokens_per_forward"], 3),
                _num(s["ms_per_forward_call"], 3),
                _num(s["forward_s"] / wall, 3),
                _num(s["grammar_s"] / wall, 3),
                _num(s["other_s"] / wall, 3),
                _num(s["tokens_per_s"], 1),
                _ratio(s, "speedup_vs_ar"),
            ]  # fmt: skip
        )
    head = ["system", "tau", "window", "batch", "tokens/forward", "ms/forward", "forward share", "grammar share",
            "other share", "tokens/s", "speed-up vs AR [interval]"]  # fmt: skip
    profile = inputs.decode_profile
    text = title + f"Tokens/s: {profile.get('statistic', _statistics([]))}.\n\n" + markdown_table(head, rows)
    costs = profile.get("step_costs", {})
    if costs:
        kinds = list(dict.fromkeys(k for c in costs.values() for k in c["cost"]))
        rows_read = {k: n for c in costs.values() for k, n in c["logit_rows"].items()}
        cost_rows = [
            [name, *(_ratio(c["cost"][k], "ratio") if k in c["cost"] else "—" for k in kinds)]
            for name, c in costs.items()
        ]
        text += (
            "\n\nCost of one decoding step of each kind relative to an AR step (one new token, one "
            "LM-head row), per setting (system@batch/forward): `canvas_q` = a later step of a block, q "
            "positions fed and q - 1 LM-head rows read; `fused_k+q` = a finished block of k with the next "
            f"canvas of q, q rows read ({profile.get('step_statistic', '')}). A diffusion step beats AR only "
            "where its tokens per forward exceed this ratio; at large batches the forward becomes "
            "compute-bound and the ratio grows.\n\n"
            + markdown_table(["setting", *(f"{k} ({rows_read[k]} rows)" for k in kinds)], cost_rows)
        )
    elif "canvas_ms" in profile:  # written before issue 28: its canvas rows had no LM head
        text += "\n\n*This file's forward-cost table predates the step-cost fix; rerun the script.*"
    return text


def _curves_caption(inputs: ReportInputs) -> str:
    """What the training-curves plot shows, from which run, and which stages that run did not train."""
    run_id = report_run(inputs.runs, inputs.writing_run)
    if run_id is None:
        return (
            "Training curves: none, as this report's figures come from no MLflow run (`stage_metrics.json` "
            "was written outside one)."
        )
    run = f"run {run_id[:8]}"
    text = (
        f"Training curves of each stage from the MLflow metric history of {run}, the run the stage "
        "table comes from: loss, and the mean reward (black) where the stage is RL."
    )
    if not inputs.training_curves:
        return text + f" No history was found in {run}: it trained none of the stages."
    missing = missing_curves(inputs)
    if missing:
        names = ", ".join(f"`{s}`" for s in missing)
        text += (
            f" **Not in {run}**: {names} (trained in another run, or not trained: 0 steps); their "
            "curves are not drawn, and none is taken from another run."
        )
    return text


def _plots_section(inputs: ReportInputs, figures: Mapping[str, Figure]) -> str:
    captions = {
        "frontier": "Speed/accuracy frontier on test: R@1 (95% CI) against tokens per forward (every "
        "system and tau) and against measured tokens/s (the benchmark's settings). Colour = system, "
        f"marker = tau (hollow = a decoding window), large star = `{inputs.reference}`, dashed line = "
        "the pre-rank's R@1, dotted line = the analyst's (the teacher's ceiling).",
        "own_valid_rate": "The model's own valid-output rate per stage (answers decoded without the "
        "grammar), 95% CI.",
        "training_curves": _curves_caption(inputs),
        "speedup_by_batch": "Speed-up against `ar_rl` by batch size at each system's operating point "
        "(solid = under the grammar, dashed = free; dotted = a system with no operating point, timed "
        "at the benchmark's `unserved_tau`, not served).",
        "speedup_by_length": "Speed-up against `ar_rl` by output length at batch 1 under the grammar: "
        "the length is varied on purpose by the reasoning budget (max_new_tokens, labelled; the "
        "grammar closes the explanation early so the ranking fits), each budget against `ar_rl` "
        "under the same budget.",
    }
    parts = ["## Plots"]
    for name, path in PLOTS.items():
        if name in figures:
            parts.append(f"**{name.replace('_', ' ')}.** {captions[name]}\n\n![{name}]({path})")
    if "speedup_by_batch" not in figures:
        parts.append("**speed-up by batch size.** " + _absent("benchmark.json", "make benchmark"))
    if "speedup_by_length" not in figures:
        parts.append("**speed-up by length.** " + _absent("speedup_by_length.json", "make benchmark"))
    return "\n\n".join(parts)


def render_markdown(inputs: ReportInputs, figures: Mapping[str, Figure]) -> str:
    """The whole report as markdown; figures are linked under `plots/` (`PLOTS`)."""
    sections = [
        "# Diffusion-GR2 run report",
        "What the run gains and what it gives up, from its own files "
        f"(`data/08_reporting/`); reported split: `{inputs.split}`.",
        "## Results\n\n"
        + results_table(inputs.stage_metrics, inputs.comparisons, inputs.operating_point, inputs.benchmark)
        + "\n"
        + (
            "The same table, with the run's date, commit, machine and minutes: `make results`."
            if inputs.runs is None
            else runs_text(inputs.runs, inputs.writing_run)
        ),
        _inputs_section(inputs),
        _stage_section(inputs),
        _comparison_section(inputs),
        _reasoning_section(inputs),
        _benchmark_section(inputs),
        _profile_section(inputs),
        _plots_section(inputs, figures),
    ]
    return "\n\n".join(sections) + "\n"


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def markdown_to_html(
    markdown: str, figures: Mapping[str, Figure], title: str = "Diffusion-GR2 run report"
) -> str:
    """The report as one HTML file: the same markdown rendered, its figures embedded as PNG data URIs
    (so the MLflow artifact opens on its own)."""
    for name, path in PLOTS.items():
        if name in figures:
            data = base64.b64encode(_png(figures[name])).decode("ascii")
            markdown = markdown.replace(f"]({path})", f"](data:image/png;base64,{data})")
    body = MarkdownIt("commonmark").enable("table").render(markdown)
    style = (
        "body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}"
        "table{border-collapse:collapse;font-size:0.85em;margin:1em 0}"
        "th,td{border:1px solid #ccc;padding:2px 6px;text-align:left}img{max-width:100%}"
    )
    return (
        f"<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>\n{body}</body></html>\n"
    )
