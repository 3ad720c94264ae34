"""The evaluation of rankings frames (docs/architecture.md#names-and-report-files): stage metrics, paired
comparisons, MLflow names.

Every number here is recomputed from `rankings.parquet` rows (`rerank.RANKING_COLUMNS`) alone:
per (split, system, tau, window) the metrics with their user-bootstrap intervals (`stage_metrics`),
each system against each baseline on the same requests (`compare_systems`), and their names as
MLflow metrics and a Markdown table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import pandas as pd

from diffusion_gr2.core.evaluate.metrics import (
    METRICS,
    REQUEST_KEY,
    own_valid_flags,
    paired_bootstrap,
    request_key,
    system_metrics,
    user_values,
)
from diffusion_gr2.core.evaluate.tables import markdown_table, metric_cell, tau_cell, window_cell

__all__ = [
    "EvaluationConfig",
    "Variant",
    "compare_systems",
    "eval_metrics",
    "metrics_markdown",
    "rankings_summary",
    "stage_metrics",
    "system_key",
    "with_evidence_first",
]


@dataclass(frozen=True)
class EvaluationConfig:
    """Bootstrap settings and the comparisons of the evaluation stage."""

    n_boot: int = 1000  # bootstrap resamples of users (CI and paired tests; all of a user's requests)
    seed: int = 0  # resampling seed
    baselines: tuple[str, ...] = ("ar_rl", "prerank")  # every system is compared with each of these
    compare_metrics: tuple[str, ...] = ("recall@1", "ndcg@3")  # per-request metrics compared


def stage_metrics(rankings: pd.DataFrame, n_boot: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """`stage_metrics.json` rows (docs/architecture.md#names-and-report-files) per (split, system, tau,
    window) of `rankings`.

    tau is None for AR systems, window None for the whole block (and for AR systems).
    """
    rows = []
    for key, group in _groups(with_evidence_first(rankings)):
        rows.append(key._asdict() | system_metrics(group, n_boot, seed))
    return rows


def with_evidence_first(rankings: pd.DataFrame) -> pd.DataFrame:
    """`rankings` with ``evidence_first`` on every row: the analyst's first item for the same request
    (`request_key`), read from the analyst's rows; unchanged when it has none (no evidence in the run)."""
    analyst = rankings[rankings["system"] == "analyst"]
    if "evidence_first" in rankings or analyst.empty:
        return rankings
    keys = [c for c in REQUEST_KEY if c in rankings]  # only these columns become dicts, not the texts
    records = analyst[[*keys, "ranking"]].to_dict("records")
    first = {request_key(r): int(r["ranking"][0]) for r in records if len(r["ranking"])}
    return rankings.assign(evidence_first=[first.get(request_key(r)) for r in rankings[keys].to_dict("records")])


class Variant(NamedTuple):
    """What one group of ranking rows is: a system decoded one way on one split."""

    system: str
    tau: float | None
    window: int | None
    split: str


def system_key(system: str, tau: float | None, window: int | None = None, split: str | None = None) -> str:
    """Name of one variant in metric names: `test.cft.tau0.9.w4`, or `ar_rl` without a threshold."""
    key = system if tau is None else f"{system}.tau{float(tau)}"
    key += "" if window is None else f".w{int(window)}"
    return key if split is None else f"{split}.{key}"


def _optional(value: Any) -> float | None:
    return None if pd.isna(value) else float(value)


def _groups(rankings: pd.DataFrame) -> list[tuple[Variant, pd.DataFrame]]:
    """(variant, rows) per (split, system, tau, window) of `rankings`, in frame order."""
    frame = rankings.assign(
        tau=rankings["tau"].astype("float64"),
        window=rankings["window"].astype("float64") if "window" in rankings else float("nan"),
        split=rankings.get("split", "test"),
    )
    groups = frame.groupby(["split", "system", "tau", "window"], sort=False, dropna=False)
    out = []
    for (split, system, tau, window), g in groups:
        w = _optional(window)
        out.append((Variant(str(system), _optional(tau), None if w is None else int(w), str(split)), g))
    return out


def _by_request(rows: pd.DataFrame) -> pd.DataFrame:
    """`rows` indexed by `request_key` (split, user, point): a user may be asked at several points."""
    return rows.set_index(pd.MultiIndex.from_tuples([request_key(r) for r in rows.to_dict("records")]))


def _aligned_values(a: pd.DataFrame, b: pd.DataFrame, metric: str) -> tuple[Any, Any, list[int]]:
    """Per-request values of `metric` for the requests both frames rank, in one request order ([r]
    each), and each request's user (the bootstrap resamples users).

    A tau of the sweep decoded on fewer requests is paired on those only.
    """
    a_rows, b_rows = _by_request(a), _by_request(b)
    keys = sorted(set(a_rows.index) & set(b_rows.index))
    users = [user for _, user, _ in keys]
    return user_values(a_rows.loc[keys])[metric], user_values(b_rows.loc[keys])[metric], users


def _paired_rows(
    a: pd.DataFrame, b: pd.DataFrame, config: EvaluationConfig, level: float
) -> list[dict[str, Any]]:
    """One paired bootstrap (a - b) per compared metric, on the requests both frames rank."""
    out = []
    for metric in config.compare_metrics:
        a_vals, b_vals, users = _aligned_values(a, b, metric)
        if len(a_vals):
            test = paired_bootstrap(a_vals, b_vals, config.n_boot, config.seed, level=level, groups=users)
            out.append({"metric": metric, "n": len(a_vals), **test._asdict()})
    return out


def compare_systems(rankings: pd.DataFrame, config: EvaluationConfig, level: float) -> list[dict[str, Any]]:
    """Paired bootstrap of every variant against each baseline present on the same split and requests.

    Rows: `split, system, tau, window, baseline, baseline_tau, metric, n, mean_diff, low, high,
    sign_share`, where `mean_diff` = system - baseline, [`low`, `high`] its two-sided `level` interval
    (the serving policy's, `Policy.level`: the level the operating point and the gate decide at) and
    `sign_share` is the bootstrap's two-sided share against its sign (`PairedBootstrap`). Pairing by
    request (`request_key`: split, user, point) cancels the per-request difficulty both share; the
    resamples draw whole users.
    """
    groups = _groups(rankings)
    rows: list[dict[str, Any]] = []
    for base in config.baselines:
        for b_key, b_rows in (g for g in groups if g[0].system == base):
            for key, a_rows in (g for g in groups if g[0].system != base and g[0].split == b_key.split):
                head = key._asdict() | {"baseline": base, "baseline_tau": b_key.tau}
                rows += [head | r for r in _paired_rows(a_rows, b_rows, config, level)]
    return rows


def eval_metrics(
    stage_rows: Sequence[Mapping[str, Any]], comparisons: Sequence[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """Nested numbers for MLflow: `{"cft.tau0.9": {"recall@1": ...}, "cmp": {"cft.tau0.9": {"vs_ar_rl": ...}}}`.

    Intervals are left out (they are in `stage_metrics.json`); a comparison logs its mean difference.
    """
    out: dict[str, Any] = {_row_key(row): {k: row[k] for k in ("n", *METRICS)} for row in stage_rows}
    cmp: dict[str, dict[str, dict[str, float]]] = {}
    for c in comparisons:
        per_base = cmp.setdefault(_row_key(c), {})
        per_base.setdefault(f"vs_{system_key(c['baseline'], c['baseline_tau'])}", {})[c["metric"]] = c[
            "mean_diff"
        ]
    return out | ({"cmp": cmp} if cmp else {})


def _row_key(row: Mapping[str, Any]) -> str:
    """Metric-name key of a row; test (the reported split) keeps the plain `cft.tau0.9` names."""
    split = row.get("split", "test")
    return system_key(row["system"], row["tau"], row.get("window"), None if split == "test" else split)


def metrics_markdown(stage_rows: Sequence[Mapping[str, Any]]) -> str:
    """A readable markdown table of `stage_metrics.json` rows (95% bootstrap intervals in brackets)."""
    head = ["split", "system", "tau", "window", "n", *METRICS]
    rows = [
        [str(row.get("split", "test")), str(row["system"]), tau_cell(row), window_cell(row), str(row["n"])]
        + [metric_cell(row, m) for m in METRICS]
        for row in stage_rows
    ]
    note = (
        "\nMetrics with 95% bootstrap intervals over users (each resample draws whole users with all "
        "their requests); tau — = autoregressive (no threshold); window — = the whole block fed at "
        "every step. Choices are made on `valid`, `test` is reported.\n"
        "valid_rate: served answers that are valid rankings (the rest fall back to the pre-rank); "
        "unforced_rate: the model's own valid rate, the share of requests whose answer decoded "
        "without the grammar (a second, free pass) is valid and one the grammar accepts "
        "(equal to valid_rate when decoding is unconstrained); prerank_copy_rate: the share of "
        "requests whose own valid answer is the pre-rank's list in the pre-rank's order (valid, "
        "but not re-ranked); copy_against_evidence_rate: the share of requests whose own valid "
        "answer is such a copy although the evidence (the analyst's first pick, the hint's first) "
        "is another candidate.\n"
    )
    if any(row["system"] == "analyst" for row in stage_rows):
        note += (
            "analyst: the learned analyst's noiseless order over the evidence, the teacher's ceiling (no "
            "model: no tokens, no forwards; prerank likewise).\n"
        )
    return "# Stage metrics\n\n" + markdown_table(head, rows) + "\n" + note


def rankings_summary(rankings: pd.DataFrame) -> dict[str, dict[str, float]]:
    """Per (system, tau): valid rate, mean output tokens, mean forwards, tokens per forward (for MLflow)."""
    out = {}
    for key, rows in _groups(rankings):
        nfe = int(rows["nfe"].sum())
        out[_row_key(key._asdict())] = {
            "valid_rate": float(rows["valid"].mean()),
            "unforced_rate": float(own_valid_flags(rows).mean()),
            "mean_output_tokens": float(rows["output_tokens"].mean()),
            "mean_nfe": float(rows["nfe"].mean()),
            "tokens_per_forward": float(rows["output_tokens"].sum()) / nfe if nfe else 0.0,
        }
    return out
