"""The retrain DAG run by Airflow itself (`airflow dags test`), nothing new delivered, a champion serving:
the first task skips, Airflow skips every other one, and nothing is trained or registered.

Airflow runs from its own environment (`.venv-airflow`, `make setup-airflow`), its metadata DB and
AIRFLOW_HOME in the test's tmp dir; each task runs on this interpreter (DIFFUSION_GR2_PYTHON), in a
project copy whose `airflow` environment has the smoke parameters. ~30 s, most of it Airflow's start.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest

from diffusion_gr2.airflow_task import PYTHON_ENV
from diffusion_gr2.core.registry import registry
from diffusion_gr2.pipelines.retrain.pipeline import retrain_pipeline
from tests.conftest import PROJECT_ROOT, make_project_copy
from tests.ops.conftest import World
from tests.ops.test_retrain_command import held_lines

AIRFLOW = PROJECT_ROOT / ".venv-airflow/bin/airflow"
DAG_ID = "diffusion-gr2"


@pytest.fixture
def airflow() -> Path:
    if not AIRFLOW.exists():
        if os.environ.get("CI"):  # CI runs `make test`, which installs it: missing there is a failure
            pytest.fail(f"{AIRFLOW} is missing: make setup-airflow")
        pytest.skip(f"{AIRFLOW} is missing: make setup-airflow")
    return AIRFLOW


def airflow_env(home: Path, store: str) -> dict[str, str]:
    """This process's (quiet, offline) environment, plus a throw-away Airflow and the test's MLflow store."""
    return os.environ | {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(PROJECT_ROOT / "airflow_dags"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        PYTHON_ENV: sys.executable,
        "MLFLOW_TRACKING_URI": store,
    }


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_the_dag_under_airflow_skips_everything_when_nothing_is_new(
    airflow: Path, store: str, world: World, tmp_path: Path
) -> None:
    root = make_project_copy(tmp_path / "project")
    for params in (root / "conf/smoke").glob("parameters_*.yml"):
        shutil.copy(params, root / "conf/airflow" / params.name)  # smoke sizes, had it trained
    version = registry.register_reranker(
        registry.DIFFUSION_MODEL, world.models["rl"], world.items, world.sids, world.config("rl")
    ).version
    registry.promote(registry.DIFFUSION_MODEL, version, "test")
    incoming = root / "data/01_raw/incoming"
    incoming.mkdir(parents=True)
    (incoming / "ml-100k.again.inter").write_text(held_lines(30))  # rows the raw folder holds already
    home = tmp_path / "airflow"
    env = airflow_env(home, store)

    def airflow_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(airflow), *args], cwd=root, env=env, capture_output=True, text=True, timeout=300
        )

    migrate = airflow_cli("db", "migrate")
    assert migrate.returncode == 0, migrate.stdout[-3000:] + migrate.stderr[-3000:]
    run = airflow_cli("dags", "test", DAG_ID, "2026-01-05")
    log = run.stdout[-6000:] + run.stderr[-6000:]
    assert run.returncode == 0, log

    with sqlite3.connect(home / "airflow.db") as db:
        states = dict(db.execute("SELECT task_id, state FROM task_instance WHERE dag_id = ?", (DAG_ID,)))
        (dag_state,) = db.execute("SELECT state FROM dag_run WHERE dag_id = ?", (DAG_ID,)).fetchone()
    tasks = len(retrain_pipeline().nodes)  # one task per node of the retrain pipeline
    assert len(states) == tasks and set(states.values()) == {"skipped"}, (states, log)
    assert dag_state == "success"  # a run of skipped tasks ended, it did not fail
    assert "Skipping task." in run.stdout and "diffusion-gr2 v1 stays champion" in run.stdout  # and why

    client = mlflow.MlflowClient()
    assert [str(v.version) for v in client.search_model_versions(f"name = '{registry.DIFFUSION_MODEL}'")] == [
        "1"
    ]
    assert not client.search_registered_models(f"name = '{registry.TEACHER_MODEL}'")
    # no training output: the raw folder seeded, the file taken in, the decision task's node time
    # (a task runs one node: part of the pipeline), the decision and the report of the files taken in
    assert files_under(root / "data") == [
        "01_raw/incoming/done/ml-100k.again.inter",
        "01_raw/ml-100k/ml-100k.inter",
        "01_raw/ml-100k/ml-100k.item",
        "08_reporting/node_times.retrain.partial.json",
        "08_reporting/retrain/decision.json",
        "08_reporting/retrain/ingest_without_retrain.json",
    ]
    decision = json.loads((root / "data/08_reporting/retrain/decision.json").read_text())
    assert not decision["retrain"] and decision["champion_version"] == version
    assert "no retrain, diffusion-gr2 v1 stays champion" in decision["reason"]
