"""Thin MLflow helpers shared by the stages: per-step metrics, report metrics, model directories."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlflow

logger = logging.getLogger(__name__)


class MlflowTracker:
    """The training loop's tracker: logs step metrics to the active MLflow run, if there is one."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if mlflow.active_run() is None:
            return
        finite = {f"{self.prefix}.{k}": float(v) for k, v in metrics.items() if _is_number(v)}
        mlflow.log_metrics(finite, step=step)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def flatten_numbers(report: Mapping[str, Any], sep: str = ".") -> dict[str, float]:
    """Every finite number in a nested report, keyed by its path (``splits.train``)."""
    flat: dict[str, float] = {}
    for key, value in report.items():
        if isinstance(value, Mapping):
            flat.update({f"{key}{sep}{k}": v for k, v in flatten_numbers(value, sep).items()})
        elif _is_number(value):
            flat[str(key)] = float(value)
    return flat


def as_metrics_history(report: Mapping[str, Any]) -> dict[str, dict[str, float | int]]:
    """A report in the format of kedro-mlflow's ``MlflowMetricsHistoryDataset`` (step 0)."""
    return {
        name.replace("@", "_at_"): {"value": value, "step": 0}
        for name, value in flatten_numbers(report).items()
    }


def log_model_directory(model_dir: str | Path, name: str) -> None:
    """Log a saved model directory (weights, config, tokenizer) as run artifacts under ``models/``."""
    if mlflow.active_run() is None:
        logger.info("No active MLflow run: model %s not logged", name)
        return
    mlflow.log_artifacts(str(model_dir), artifact_path=f"models/{name}")
