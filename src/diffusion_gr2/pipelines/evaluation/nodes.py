"""evaluation nodes: stage metrics with intervals, paired comparisons, table and plots (DESIGN §7, §10)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from diffusion_gr2.core.rank.plots import metric_figure, valid_rate_figure
from diffusion_gr2.core.rank.rerank import (
    EvaluationConfig,
    compare_systems,
    eval_metrics,
    metrics_markdown,
    stage_metrics,
)
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history


def _config(params: dict[str, Any]) -> EvaluationConfig:
    return EvaluationConfig(
        n_boot=params["n_boot"],
        seed=params["seed"],
        baselines=tuple(params["baselines"]),
        compare_metrics=tuple(params["compare_metrics"]),
    )


def compute_stage_metrics(rankings: pd.DataFrame, params: dict[str, Any]) -> dict[str, Any]:
    """`stage_metrics.json` rows (one per system and tau) and the same as a markdown table."""
    config = _config(params)
    rows = stage_metrics(rankings, config.n_boot, config.seed)
    return {"stage_metrics": rows, "stage_metrics_md": metrics_markdown(rows)}


def compare_to_baselines(rankings: pd.DataFrame, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Paired bootstrap of every system against the AR teacher and the pre-rank."""
    return compare_systems(rankings, _config(params))


def log_eval_metrics(stage_rows: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> dict[str, Any]:
    """Metric means and comparison differences as MLflow metrics (`eval.cft.tau0.9.recall_at_1`)."""
    return as_metrics_history(eval_metrics(stage_rows, comparisons))


def plot_stage_metrics(stage_rows: list[dict[str, Any]]) -> dict[str, Figure]:
    """R@1 with 95% intervals and the valid-output rate, per system and tau, on test (what is reported)."""
    test = [r for r in stage_rows if r.get("split", "test") == "test"]
    return {
        "recall_plot": metric_figure(test, "recall@1"),
        "valid_rate_plot": valid_rate_figure(test),
    }
