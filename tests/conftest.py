"""Shared fixtures: a throw-away copy of the Kedro project for end-to-end runs."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import sqlite3
import tempfile
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


@functools.cache
def _empty_store_template() -> Path:
    """An sqlite MLflow store with every table created, built once per test session."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    root = Path(tempfile.mkdtemp(prefix="mlflow-template-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    SqlAlchemyStore(f"sqlite:///{root / 'mlflow.db'}", str(root / "mlruns")).engine.dispose()
    return root / "mlflow.db"


def empty_mlflow_store(db: Path) -> str:
    """A new, empty sqlite MLflow store at ``db``; its URI.

    MLflow's schema migrations take 2-3 s per new store on two cores, and the suite makes dozens: each
    store is a copy of one migrated file, its Default experiment pointed where MLflow would point it
    for a process started in ``db``'s folder.
    """
    shutil.copyfile(_empty_store_template(), db)
    with contextlib.closing(sqlite3.connect(db)) as con, con:
        con.execute(
            "UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
            (str(db.parent / "mlruns" / "0"),),
        )
    return f"sqlite:///{db}"


def make_project_copy(target: Path) -> Path:
    """conf/ + pyproject.toml in ``target`` with empty data layers and an empty MLflow store
    (``mlflow.db``): a project Kedro can run there."""
    shutil.copytree(PROJECT_ROOT / "conf", target / "conf", ignore=shutil.ignore_patterns("local"))
    (target / "conf" / "local").mkdir()
    shutil.copy(PROJECT_ROOT / "pyproject.toml", target / "pyproject.toml")
    (target / "src").mkdir()  # Kedro checks it exists; the package itself is installed (editable)
    for layer in DATA_LAYERS:
        (target / "data" / layer).mkdir(parents=True)
    empty_mlflow_store(target / "mlflow.db")
    return target


PREPARED_LAYERS = DATA_LAYERS[:5]  # 01_raw .. 05_model_input: what the four preparing stages write


def prepared_project(dag_run: Path, target: Path) -> Path:
    """A project copy at `target` holding the smoke run's data layers 01-05 (data, semantic IDs,
    candidates and traces done); no model, checkpoint or report."""
    project = make_project_copy(target)
    for layer in PREPARED_LAYERS:
        shutil.copytree(dag_run / "data" / layer, project / "data" / layer, dirs_exist_ok=True)
    return project


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
