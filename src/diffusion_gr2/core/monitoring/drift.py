"""Drift of a delivery against the champion's training window (docs/operations.md#retraining, issue 44).

Each check compares one aspect of the delivered rows with the rows the champion was trained on and
says whether it moved past its threshold:

* ``new_users`` / ``new_items``: the share of delivered rows whose user (item) the reference lacks. An
  unseen item has no semantic ID in the champion's vocabulary, so it cannot be served at all; an
  unseen user is served from a history the champion never trained on.
* ``item_popularity``: two-sample Kolmogorov-Smirnov on log(1 + reference count) of the item of
  every row (reference rows against delivered rows on known items): the head/tail mix of what is
  consumed. The Jensen-Shannon distance of the two item distributions is reported beside it.
* ``history_length``: KS on the history a request would show (the user's earlier rows in reference
  and delivery together, capped as the prompt caps it).
* ``rating``: chi-square test of homogeneity of the rating counts, its effect size the
  Jensen-Shannon distance between the two rating histograms.
* ``time_gap``: KS on log(1 + seconds since the same user's previous row).

A distribution check drifts only when its effect size passes the threshold **and** its test rejects
at ``alpha``: at MovieLens sizes (10^5 reference rows) a p-value alone flags differences too small to
matter, and on a small delivery an effect size alone flags sampling noise. The statistics are
scipy's (`scipy.stats.ks_2samp`, `chi2_contingency`, `scipy.spatial.distance.jensenshannon`).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy.spatial.distance import jensenshannon
from scipy.stats import chi2_contingency, ks_2samp

__all__ = ["CHECKS", "DriftConfig", "drift_report", "render_html", "summary_line"]

CHECKS = ("new_users", "new_items", "item_popularity", "history_length", "rating", "time_gap")
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass(frozen=True)
class DriftConfig:
    """Thresholds of the drift checks (`retrain.drift`; conf/base/parameters_retrain.yml says why each)."""

    enabled: bool  # false: no drift report, and drift never forces a retrain
    alpha: float  # level of the two-sample tests (a distribution check needs p < alpha to drift)
    new_users: float  # max share of delivered rows from users the reference lacks
    new_items: float  # max share of delivered rows on items the reference lacks
    item_popularity: float  # max KS statistic on log reference popularity of consumed items
    history_length: float  # max KS statistic on the (capped) history length at each row
    rating: float  # max Jensen-Shannon distance between the rating histograms
    time_gap: float  # max KS statistic on log seconds since the user's previous row
    history_cap: int  # the prompt's history cap (data_prep's): longer histories look the same
    min_rows: int  # a delivery with fewer rows is not judged (every check says so)
    strong_checks: int  # this many drifted checks is strong drift
    force_retrain: bool  # strong drift retrains even below retrain.min_new_rows


def _quantiles(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.quantile(values, QUANTILES)] if len(values) else []


def _check(name: str, statistic: str, value: float, threshold: float, **extra: Any) -> dict[str, Any]:
    p = extra.get("p_value")
    significant = True if p is None else bool(p < extra.pop("alpha"))
    extra.pop("alpha", None)
    drifted = bool(value > threshold and significant)
    return {
        "check": name,
        "statistic": statistic,
        "value": round(float(value), 6),
        "threshold": threshold,
        "drifted": drifted,
        **extra,
    }


def _share(name: str, delivered: pd.Series, known: set[str], threshold: float) -> dict[str, Any]:
    new = ~delivered.isin(known)
    return _check(
        name,
        "share of delivered rows",
        float(new.mean()),
        threshold,
        new_ids=int(delivered[new].nunique()),
        rows=int(new.sum()),
    )


def _ks(
    name: str, reference: np.ndarray, delivered: np.ndarray, threshold: float, alpha: float
) -> dict[str, Any]:
    if len(reference) == 0 or len(delivered) == 0:
        return {
            "check": name,
            "statistic": "ks_2samp D",
            "value": None,
            "threshold": threshold,
            "drifted": False,
            "skipped": "no values on one side",
        }
    test = ks_2samp(reference, delivered)
    return _check(
        name,
        "ks_2samp D",
        float(test.statistic),
        threshold,
        p_value=float(test.pvalue),
        alpha=alpha,
        n_reference=len(reference),
        n_delivery=len(delivered),
        quantiles={"reference": _quantiles(reference), "delivery": _quantiles(delivered)},
    )


def _rating(reference: pd.Series, delivered: pd.Series, threshold: float, alpha: float) -> dict[str, Any]:
    reference, delivered = reference.dropna(), delivered.dropna()
    levels = sorted(set(reference) | set(delivered))
    table = np.array([[int((side == v).sum()) for v in levels] for side in (reference, delivered)])
    if table.shape[1] < 2 or table[1].sum() == 0 or table[0].sum() == 0:
        return {
            "check": "rating",
            "statistic": "jensen-shannon distance",
            "value": None,
            "threshold": threshold,
            "drifted": False,
            "skipped": "fewer than two rating values",
        }
    p_value = float(chi2_contingency(table).pvalue)
    distance = float(jensenshannon(table[0] / table[0].sum(), table[1] / table[1].sum(), base=2))
    return _check(
        "rating",
        "jensen-shannon distance",
        distance,
        threshold,
        p_value=p_value,
        alpha=alpha,
        test="chi2_contingency",
        histogram={
            "levels": [float(v) for v in levels],
            "reference": (table[0] / table[0].sum()).round(4).tolist(),
            "delivery": (table[1] / table[1].sum()).round(4).tolist(),
        },
    )


def _sequence_features(reference: pd.DataFrame, delivery: pd.DataFrame, cap: int) -> pd.DataFrame:
    """Per row of both frames: its side, capped history length and log time gap, over both in time order.

    Both sides are measured on the union, so a delivery drawn from the reference's own process
    measures the same; a later delivery sees longer histories because its users have lived longer.
    """
    both = pd.concat(
        [reference.assign(_side="reference"), delivery.assign(_side="delivery")], ignore_index=True
    )
    # Rows of one user at the same second (MovieLens rates in bursts) are measured alike, whichever
    # side holds them: history = the user's rows strictly earlier, gap = to the previous distinct time.
    earlier = both.groupby("raw_user_id")["timestamp"].rank(method="min") - 1
    both["history"] = earlier.clip(upper=cap)
    times = both[["raw_user_id", "timestamp"]].drop_duplicates().sort_values(["raw_user_id", "timestamp"])
    times["previous"] = times.groupby("raw_user_id")["timestamp"].shift(1)
    both = both.merge(times, on=["raw_user_id", "timestamp"], how="left")
    both["log_gap"] = np.log1p(both["timestamp"] - both["previous"])  # NaN: a user's first time
    return both


def drift_report(reference: pd.DataFrame, delivery: pd.DataFrame, config: DriftConfig) -> dict[str, Any]:
    """Every check of the module docstring on two interaction frames (`core.data.raw` columns).

    ``drifted`` names the checks over their threshold; ``strong`` is at least ``strong_checks`` of them.
    """
    sides = {name: _describe(frame) for name, frame in (("reference", reference), ("delivery", delivery))}
    if len(delivery) < config.min_rows:
        why = f"{len(delivery)} delivered rows < drift.min_rows {config.min_rows}: not judged"
        checks = [{"check": c, "value": None, "drifted": False, "skipped": why} for c in CHECKS]
        return {**sides, "checks": checks, "drifted": [], "strong": False, "judged": False, "summary": why}
    alpha = config.alpha
    counts = reference["raw_item_id"].value_counts()
    known = delivery["raw_item_id"].isin(counts.index)
    popularity = (
        np.log1p(counts.loc[reference["raw_item_id"]].to_numpy()),
        np.log1p(counts.loc[delivery.loc[known, "raw_item_id"]].to_numpy()),
    )
    items = counts.index.union(delivery["raw_item_id"].unique())
    delivered_counts = delivery["raw_item_id"].value_counts().reindex(items, fill_value=0)
    js_items = float(jensenshannon(counts.reindex(items, fill_value=0), delivered_counts, base=2))
    seq = _sequence_features(reference, delivery, config.history_cap)
    ref_rows, new_rows = seq[seq["_side"] == "reference"], seq[seq["_side"] == "delivery"]
    checks = [
        _share("new_users", delivery["raw_user_id"], set(reference["raw_user_id"]), config.new_users),
        _share("new_items", delivery["raw_item_id"], set(counts.index), config.new_items),
        _ks("item_popularity", *popularity, config.item_popularity, alpha)
        | {"js_distance_items": round(js_items, 6)},
        _ks(
            "history_length",
            ref_rows["history"].to_numpy(float),
            new_rows["history"].to_numpy(float),
            config.history_length,
            alpha,
        ),
        _rating(reference["rating"], delivery["rating"], config.rating, alpha),
        _ks(
            "time_gap",
            ref_rows["log_gap"].dropna().to_numpy(),
            new_rows["log_gap"].dropna().to_numpy(),
            config.time_gap,
            alpha,
        ),
    ]
    drifted = [c["check"] for c in checks if c["drifted"]]
    report = {**sides, "checks": checks, "drifted": drifted, "judged": True}
    report["strong"] = len(drifted) >= config.strong_checks
    report["summary"] = summary_line(report)
    return report


def _describe(frame: pd.DataFrame) -> dict[str, Any]:
    stamps = frame["timestamp"]
    return {
        "rows": len(frame),
        "users": int(frame["raw_user_id"].nunique()),
        "items": int(frame["raw_item_id"].nunique()),
        "first": pd.Timestamp(int(stamps.min()), unit="s").isoformat() if len(frame) else None,
        "last": pd.Timestamp(int(stamps.max()), unit="s").isoformat() if len(frame) else None,
    }


def summary_line(report: dict[str, Any]) -> str:
    """One line for the retrain decision: how many checks drifted, each with its figure and bar."""
    if not report.get("judged", False):
        return report.get("summary", "drift not judged")
    checks = [c for c in report["checks"] if c["drifted"]]
    where = "; ".join(f"{c['check']} {c['value']:.3g} > {c['threshold']:g}" for c in checks)
    strength = "strong drift" if report["strong"] else ("drift" if checks else "no drift")
    return f"{strength}: {len(checks)} of {len(report['checks'])} checks over threshold" + (
        f" ({where})" if where else ""
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    return str(value)


def _esc(value: Any) -> str:
    return html.escape(_fmt(value))


def _sides_html(report: dict[str, Any]) -> str:
    """The table of both sides; a sentence instead when the report has none (a retrain that ran with
    no delivered rows, e.g. forced or with nothing serving yet, still writes its page)."""
    present = [side for side in ("reference", "delivery") if isinstance(report.get(side), dict)]
    if not present:
        return "<p>No delivered rows: nothing was compared.</p>"
    columns = ("rows", "users", "items", "first", "last")
    rows = "".join(
        f"<tr><th>{side}</th>" + "".join(f"<td>{_esc(report[side].get(k))}</td>" for k in columns) + "</tr>"
        for side in present
    )
    header = "".join(f"<th>{k}</th>" for k in columns)
    return f"<table><tr><th></th>{header}</tr>{rows}</table>"


def render_html(report: dict[str, Any], title: str = "Drift report") -> str:
    """A self-contained page (inline CSS, no script) of the report: both sides, then one row per check.

    Any report renders, one without a delivery included (no sides, no checks: the page says so).
    """
    meta = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{_esc(v)}</td></tr>"
        for k, v in report.items()
        if k not in {"checks", "reference", "delivery"} and not isinstance(v, dict)
    )
    rows = []
    for c in report.get("checks", []):
        detail = c.get("skipped") or "; ".join(
            f"{k}: {_fmt(v)}"
            for k, v in c.items()
            if k not in {"check", "statistic", "value", "threshold", "drifted", "p_value"}
        )
        cls = "drift" if c["drifted"] else "ok"
        rows.append(
            f"<tr class='{cls}'><td>{c['check']}</td><td>{_esc(c.get('statistic'))}</td>"
            f"<td>{_esc(c.get('value'))}</td><td>{_esc(c.get('threshold'))}</td>"
            f"<td>{_esc(c.get('p_value'))}</td><td>{'DRIFT' if c['drifted'] else 'ok'}</td>"
            f"<td>{html.escape(detail)}</td></tr>"
        )
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:1.5em}"
        "td,th{border:1px solid #bbb;padding:4px 8px;text-align:left;vertical-align:top}"
        "tr.drift td{background:#fdd}tr.ok td{background:#efe}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{html.escape(str(report.get('summary', '')))}</p>"
        f"<table>{meta}</table>"
        "<h2>Reference (the champion's training window) and delivery</h2>"
        f"{_sides_html(report)}<h2>Checks</h2><table><tr><th>check</th><th>statistic</th><th>value</th>"
        "<th>threshold</th><th>p-value</th><th>verdict</th><th>detail</th></tr>"
        + "".join(rows)
        + "</table></body></html>"
    )
