"""The results table of a run: one Markdown table from `data/08_reporting/`, and the line saying where.

Per served system (`ar_rl`, and `rl` at its operating point), the pre-rank and the learned analyst
(its noiseless order, the teacher's ceiling; not served), on the test split:
R@1 with its 95% interval, the paired R@1 difference to `ar_rl` and to the pre-rank, the model's own
and the served valid rates, tokens per forward, and the speed-up over `ar_rl` at batch 1 and 16 (and
over the fastest AR row of the benchmark) under the answer grammar, each with its interval. Then the
run the figures came from (date, commit, env, pipelines, machine, minutes), read from each file's own
manifest (`core.base.manifest`): one `Run:` line when every file came from one run, else a line
per source run naming its files, and a flag on any model two runs measured with different weights.
`python -m diffusion_gr2 results` prints it (`--strict`: refuses a mixture); the run report starts
with it; the README embeds the last default run's.

Reads `stage_metrics.json`, `comparisons.json`, `operating_point.json`, `benchmark.json` (written by
`make benchmark`; without it the speed columns say so) through `manifest.load_reports`, and the
`node_times*.json` record of each source run for its minutes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diffusion_gr2.core.base.manifest import (
    NO_RECORD,
    MixedRunsError,
    ReportFileError,
    RunManifest,
    RunSources,
    load_reports,
)
from diffusion_gr2.core.base.speed import speedup
from diffusion_gr2.core.evaluate.tables import (
    NO_MODEL_SYSTEMS,
    interval,
    markdown_table,
    missing,
    paired_row,
    same_setting,
)

__all__ = ["MixedRunsError", "ResultsError", "results_markdown", "results_table", "runs_text"]

SPEED_BATCHES = (1, 16)
RESULTS_HEAD = (
    "system",
    "operating point",
    "requests",
    "test R@1 [95%]",
    "vs ar_rl (paired)",
    "vs pre-rank (paired)",
    "own valid",
    "of which copies",
    "served valid",
    "tokens/forward",
    "speed-up vs ar_rl, batch 1",
    "batch 16",
    "vs fastest AR, batch 1",
)


ResultsError = ReportFileError  # a reporting file the table needs is missing or unreadable
RESULTS_FILES = ("stage_metrics.json", "comparisons.json", "operating_point.json", "benchmark.json")


def _stage(rows: Sequence[Mapping[str, Any]], system: str, tau: Any, window: Any) -> Mapping[str, Any] | None:
    return next(
        (
            r
            for r in rows
            if r["split"] == "test"
            and r["system"] == system
            and same_setting(r.get("tau"), tau)
            and same_setting(r.get("window"), window)
        ),
        None,
    )


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if missing(value) else f"{value:.{digits}f}"


def _interval(value: Any, low: Any, high: Any, digits: int = 3, sign: bool = False) -> str:
    """This table's interval: as many digits on the bounds as on the value, `-` when not there."""
    return interval(value, low, high, digits, digits, signed=sign, empty="-")


def _bench_row(
    bench: Sequence[Mapping[str, Any]], system: str, tau: Any, window: Any, batch: int
) -> Mapping[str, Any] | None:
    return next(
        (
            r
            for r in bench
            if r["system"] == system
            and r["constrained"]
            and int(r["batch_size"]) == batch
            and same_setting(r.get("tau"), tau)
            and same_setting(r.get("window"), window)
        ),
        None,
    )


def _speed_cells(bench: Sequence[Mapping[str, Any]] | None, system: str, tau: Any, window: Any) -> list[str]:
    """Tokens per forward (batch 1), speed-up over ar_rl at each of SPEED_BATCHES, and over the fastest
    AR row at batch 1; all under the grammar, from the one benchmark run."""
    if bench is None:
        return ["no benchmark.json"] + ["-"] * (len(SPEED_BATCHES) + 1)
    one = _bench_row(bench, system, tau, window, 1)
    cells = [_fmt(one["tokens_per_forward"], 2) if one else "-"]
    for batch in SPEED_BATCHES:
        row = _bench_row(bench, system, tau, window, batch)
        cells.append(
            "-"
            if row is None or row.get("speedup_vs_ar") is None
            else _interval(row["speedup_vs_ar"], row["speedup_vs_ar_low"], row["speedup_vs_ar_high"], 2) + "x"
        )
    if one is not None and one.get("speedup_vs_best_ar") is not None:  # the benchmark paired it by round
        low, high = one["speedup_vs_best_ar_low"], one["speedup_vs_best_ar_high"]
        cells.append(f"{_interval(one['speedup_vs_best_ar'], low, high, 2)}x ({one['best_ar']})")
        return cells
    ar = [r for r in bench if r["constrained"] and int(r["batch_size"]) == 1 and r.get("tau") is None]
    fastest = max(ar, key=lambda r: r["output_tokens_per_s"], default=None)
    if one is None or fastest is None:
        cells.append("-")
    else:
        rounds = [r.get("tokens_per_s_by_round") for r in (one, fastest)]
        if all(rounds):  # paired by round, with its interval
            ratio = speedup(*rounds)
            cells.append(f"{_interval(ratio.value, ratio.low, ratio.high, 2)}x ({fastest['system']})")
        else:  # rows without their rounds: the ratio of the two rates alone
            value = one["output_tokens_per_s"] / fastest["output_tokens_per_s"]
            cells.append(f"{value:.2f}x ({fastest['system']})")
    return cells


def _served(points: Mapping[str, Any] | None) -> list[tuple[str, Any, Any, str]]:
    """(system, tau, window, operating point text) of each row: pre-rank, the analyst (the teacher's
    ceiling, not served), ar_rl, then each diffusion system with an operating point, or its refusal
    (shown at its first test tau, marked not served)."""
    rows: list[tuple[str, Any, Any, str]] = [
        ("prerank", None, None, "retriever order"),
        ("analyst", None, None, "teacher's ceiling, not served"),
        ("ar_rl", None, None, "AR"),
    ]
    for system, point in (points or {}).items():
        if point.get("tau") is not None:
            window = point.get("window")
            text = f"tau {point['tau']}, " + ("whole block" if window is None else f"window {window}")
            rows.append((system, point["tau"], window, text))
        else:
            rows.append((system, "refused", None, "none: refused on validation"))
    return rows


def _machine(run: Mapping[str, Any]) -> str:
    gpu = run.get("gpu") or "no GPU"
    return f"{run.get('cpu_cores', '?')} CPU cores, {run.get('torch_threads', '?')} torch threads, {gpu}"


def _minutes(times: Mapping[str, Any] | None) -> str:
    return f"{(times or {}).get('total_s', math.nan) / 60.0:.1f} min"


def _run_line(times: Mapping[str, Any] | None) -> str:
    """The run line of reports that carry no manifest: `node_times.json`'s record, said unchecked."""
    run = (times or {}).get("run") or {}
    if not run:
        return "Run: unknown (the reports carry no run record and node_times.json has none)."
    commit = str(run.get("git_commit", "unknown"))[:7] + (
        " (uncommitted changes)" if run.get("git_dirty") == "true" else ""
    )
    return (
        f"Run: {run.get('started', 'unknown')}, commit {commit}, env {run.get('env', '?')}, {_machine(run)}; "
        f"{_minutes(times)} (pipelines: {', '.join(run.get('pipelines', ['?']))}); the reports carry no "
        "run record: not checked that they came from this run."
    )


def _times_of(folder: Path, manifest: RunManifest) -> Mapping[str, Any] | None:
    """The `node_times*.json` record of the run `manifest` names (None: none, e.g. the run failed)."""
    for path in sorted(folder.glob("node_times*.json")):
        try:
            times = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if manifest.run_id and (times.get("run") or {}).get("run_id") == manifest.run_id:
            return times
    return None


def runs_text(sources: RunSources, writing_run: str | None = None) -> str:
    """Which run each file's figures came from: one `Run:` line when they all came from one run,
    else a line per source run; then any model two runs measured with different weights.

    `writing_run`: the id of the run writing this text (the report, written by its own run's last
    node): its minutes cannot be known yet, and the line says so rather than that it failed."""
    runs, folder = sources.runs(), sources.folder
    if not runs:
        return "Run: unknown (no report files)."
    if all(manifest is None for manifest, _ in runs):
        return _run_line(None if folder is None else _read_json(folder / "node_times.json"))
    lines = []
    for manifest, files in runs:
        if manifest is None:
            lines.append(f"{', '.join(files)}: {NO_RECORD} (written before run manifests, or by hand)")
            continue
        times = None if folder is None else _times_of(folder, manifest)
        took = (
            _minutes(times)
            if times
            else "this run, still running when this was written (its minutes: `make results`)"
            if writing_run and manifest.run_id == writing_run
            else "no node_times record (running when this was written, or failed)"
        )
        lines.append(f"{', '.join(files)}: {manifest.label()}; {_machine(manifest.machine)}; {took}")
    if len(lines) == 1:
        text = f"Run: {lines[0]}."
    else:
        text = f"Runs (the figures come from {len(lines)} runs):\n\n" + "\n".join(
            f"* {line}." for line in lines
        )
    conflicts = sources.conflicts()
    if conflicts:
        text += "\n\n**Mixed models**: these files measured different weights: " + "; ".join(conflicts) + "."
    return text


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except json.JSONDecodeError:
        return None


def results_table(
    stages: Sequence[Mapping[str, Any]],
    paired: Sequence[Mapping[str, Any]],
    points: Mapping[str, Any] | None,
    bench: Sequence[Mapping[str, Any]] | None,
) -> str:
    """The table and its note, from the run's `stage_metrics`, `comparisons`, `operating_point` and
    `benchmark` (None: not run); what `results_markdown` and the report's first section show."""
    rows = []
    for system, tau, window, text in _served(points):
        if tau == "refused":
            tested = sorted(
                (r for r in stages if r["split"] == "test" and r["system"] == system),
                key=lambda r: -(r.get("tau") or 0.0),
            )
            if not tested:
                continue
            tau, window = tested[0].get("tau"), tested[0].get("window")
            text += f" (figures at tau {tau}, not served)"
        row = _stage(stages, system, tau, window)
        if row is None:
            continue
        cells = [system, text, str(row["n"]), _interval(row["recall@1"], *row["ci"]["recall@1"])]
        for baseline in ("ar_rl", "prerank"):
            diff = None if system == baseline else paired_row(paired, "test", system, tau, window, baseline)
            cells.append(
                "-" if diff is None else _interval(diff["mean_diff"], diff["low"], diff["high"], sign=True)
            )
        cells += [_fmt(row.get(k), 2) for k in ("unforced_rate", "prerank_copy_rate", "valid_rate")]
        cells += ["-"] * 4 if system in NO_MODEL_SYSTEMS else _speed_cells(bench, system, tau, window)
        rows.append(cells)
    ar = _stage(stages, "ar_rl", None, None)
    size = "" if ar is None else f" ({ar['n']} requests)"
    note = (
        f"Test split{size}; paired differences on the requests both answered; intervals resample users; "
        "speed-ups are medians of per-round ratios under the answer grammar, with their sign-test "
        "intervals (`benchmark.json` `statistic`). Own valid: answers decoded without the grammar that "
        "it accepts; of which copies: own valid answers that are the pre-rank's list unchanged (the "
        "rest re-rank)."
    )
    if any(cells[0] == "analyst" for cells in rows):
        note += (
            " analyst: the learned analyst's noiseless order, the teacher's ceiling (no model, not served)."
        )
    return markdown_table(RESULTS_HEAD, rows) + "\n\n" + note + "\n"


def results_markdown(folder: str | Path, strict: bool = False) -> str:
    """The results table of the run whose reports are in `folder` (`data/08_reporting`), and the runs
    its figures came from (`runs_text`). Models measured with different weights by the files' runs are
    flagged; `strict` refuses them, and any mixture of runs (`MixedRunsError`)."""
    folder = Path(folder)
    sources = load_reports(folder, RESULTS_FILES, required=RESULTS_FILES[:2])
    sources.check(strict)
    data = sources.data
    table = results_table(
        data["stage_metrics.json"],
        data["comparisons.json"],
        data["operating_point.json"],
        data["benchmark.json"],
    )
    return table + "\n" + runs_text(sources) + "\n"
