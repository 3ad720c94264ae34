"""Thin MLflow helpers shared by the stages: per-step metrics, report metrics, model directories, and
look-ups of registered models, versions, aliases and runs that name what is missing (`NotFoundError`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.entities.model_registry import ModelVersion, RegisteredModel
from mlflow.exceptions import MlflowException

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


class NotFoundError(LookupError):
    """A registered model, version, alias or run the store does not hold; the message names it.

    The operations commands print it as one line (MLflow's own error is a traceback of a REST or
    SQL call that does not say which of the name, version or alias was wrong).
    """


def _does_not_exist(err: MlflowException) -> bool:
    # MlflowException (a local store) and RestException (a tracking server) both carry the code
    return err.error_code == "RESOURCE_DOES_NOT_EXIST"


def _or_not_found(fetch: Callable[[], Any], what: str) -> Any:
    """``fetch()``, with MLflow's "does not exist" turned into `NotFoundError` naming ``what``."""
    try:
        return fetch()
    except MlflowException as err:
        if _does_not_exist(err):
            raise NotFoundError(what) from None
        raise


def registered_model(client: MlflowClient, name: str) -> RegisteredModel:
    """The registered model `name`, or `NotFoundError`."""
    return _or_not_found(lambda: client.get_registered_model(name), f"no registered model {name!r}")


def model_version(client: MlflowClient, name: str, version: str | int) -> ModelVersion:
    """Version `version` of `name`, or `NotFoundError` listing the versions there are.

    Checked against the listing rather than by catching: a version that is not a number is an
    INVALID_PARAMETER_VALUE to MLflow, not a missing one.
    """
    registered_model(client, name)
    versions = sorted(int(mv.version) for mv in client.search_model_versions(f"name = '{name}'"))
    if str(version) not in map(str, versions):
        listed = ", ".join(map(str, versions)) or "none"
        raise NotFoundError(f"no version {version} of registered model {name} (versions: {listed})")
    return client.get_model_version(name, str(version))


def version_by_alias(client: MlflowClient, name: str, alias: str) -> ModelVersion:
    """The version `alias` of `name` points at, or `NotFoundError` listing the aliases there are.

    Checked on the model's aliases: MLflow answers a missing alias with INVALID_PARAMETER_VALUE.
    """
    aliases = registered_model(client, name).aliases
    if alias not in aliases:
        listed = ", ".join(sorted(aliases)) or "none"
        raise NotFoundError(f"no alias {alias!r} on registered model {name} (aliases: {listed})")
    return client.get_model_version_by_alias(name, alias)


def get_run(client: MlflowClient, run_id: str) -> Run:
    """The run `run_id`, or `NotFoundError`."""
    return _or_not_found(lambda: client.get_run(run_id), f"no run {run_id!r} in the tracking store")
