"""Shared fixtures: a throw-away copy of the Kedro project for end-to-end runs."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DATA_LAYERS = (
    "01_raw",
    "02_intermediate",
    "03_primary",
    "04_feature",
    "05_model_input",
    "06_models",
    "07_model_output",
    "08_reporting",
)


def make_project_copy(target: Path) -> Path:
    """conf/ + pyproject.toml in ``target`` with empty data layers: a project Kedro can run there."""
    shutil.copytree(PROJECT_ROOT / "conf", target / "conf", ignore=shutil.ignore_patterns("local"))
    (target / "conf" / "local").mkdir()
    shutil.copy(PROJECT_ROOT / "pyproject.toml", target / "pyproject.toml")
    (target / "src").mkdir()  # Kedro checks it exists; the package itself is installed (editable)
    for layer in DATA_LAYERS:
        (target / "data" / layer).mkdir(parents=True)
    return target


@contextmanager
def isolated_project(target: Path) -> Iterator[Path]:
    """A project copy at `target`, made the working directory, with its own sqlite MLflow store."""
    root = make_project_copy(target)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        yield root


@pytest.fixture(scope="session")
def smoke_project(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A project copy whose MLflow store is its own sqlite file."""
    with isolated_project(tmp_path_factory.mktemp("project")) as root:
        yield root


@pytest.fixture(scope="session")
def dag_run(smoke_project: Path) -> Path:
    """The whole default DAG run once at smoke sizes; its outputs serve every end-to-end test."""
    run_kedro(smoke_project, ["__default__"])
    return smoke_project


def run_kedro(project: Path, pipelines: list[str], env: str = "smoke") -> None:
    """Run pipelines through a real Kedro session, exactly as ``kedro run`` does."""
    import mlflow
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project
    from mlflow.tracking import fluent

    # Sessions in one process may use different stores (each test project has its own mlflow.db):
    # forget the previous store's experiment and point MLflow at this one.
    _forget_active_runs()
    fluent._active_experiment_id = None
    mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", f"sqlite:///{project / 'mlflow.db'}"))
    bootstrap_project(project)
    try:
        with KedroSession.create(project_path=project, env=env) as session:
            session.run(pipeline_names=pipelines)
    finally:  # a run left active (or named in MLFLOW_RUN_ID) would capture the next test's logging
        _forget_active_runs()


def _forget_active_runs() -> None:
    """End every active MLflow run; one whose store is another test's (gone or switched) is dropped."""
    import mlflow
    from mlflow.exceptions import MlflowException

    while mlflow.active_run() is not None:
        with contextlib.suppress(MlflowException):  # end_run pops the run before it contacts the store
            mlflow.end_run()
    os.environ.pop("MLFLOW_RUN_ID", None)
