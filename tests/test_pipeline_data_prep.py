"""End-to-end: the data_prep pipeline through a Kedro session on the embedded MovieLens-100k."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from tests.conftest import run_kedro


@pytest.fixture(scope="module")
def data_prep_run(smoke_project: Path) -> Path:
    run_kedro(smoke_project, ["data_prep"])
    return smoke_project


def test_data_prep_writes_statistics_and_validated_outputs(data_prep_run: Path) -> None:
    stats = json.loads((data_prep_run / "data/08_reporting/data_stats.json").read_text())
    assert (stats["users"], stats["items"], stats["interactions"]) == (943, 1349, 99287)
    # smoke holds out two test and two validation points per user (data_prep.test_points,
    # valid_points: 2); every ml-100k user has them all
    assert stats["splits"]["test"] == 2 * stats["users"] == stats["splits"]["valid"]
    assert stats["test_points"] == stats["valid_points"] == {"per_user": 2, "users_with_fewer": 0}
    splits = pd.read_parquet(data_prep_run / "data/05_model_input/splits.parquet")
    assert len(splits) == 943 and (splits["test_items"].map(len) == 2).all()
    assert (splits["valid_items"].map(len) == 2).all()
    validation = json.loads((data_prep_run / "data/08_reporting/validation/splits.json").read_text())
    assert validation["success"] is True


def test_data_prep_run_is_logged_to_mlflow(data_prep_run: Path) -> None:
    mlflow.set_tracking_uri(f"sqlite:///{data_prep_run / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["diffusion-gr2"], output_format="list")
    assert runs, "kedro-mlflow opened no run"
    run = runs[0]
    assert run.data.metrics["data_prep.users"] == 943
    assert run.data.tags["pipeline"] == "data_prep"
    assert run.data.params["data_prep.k_core"] == "5"
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert "data_stats.json" in artifacts
