"""The committed Airflow DAG is the retrain pipeline as it is now (regenerate it when a node changes);
what a task runs. The DAG run under Airflow itself: test_airflow_run.py."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest

from diffusion_gr2.pipelines.retrain import retrain_pipeline
from tests.conftest import PROJECT_ROOT

DAG = PROJECT_ROOT / "airflow_dags/diffusion_gr2_airflow_retrain_dag.py"


def test_the_airflow_dag_has_one_task_per_retrain_node_and_its_edges() -> None:
    text = DAG.read_text()
    tasks = set(re.findall(r'run_nodes\(pipeline_name, \["([^"]+)"\], env, conf_source\)', text))
    pipeline = retrain_pipeline()
    assert tasks == {n.name for n in pipeline.nodes}, (
        "stale DAG: kedro airflow create -p retrain -e airflow -t airflow_dags/ -j airflow_dags/dag_template.j2"
    )
    edges = set(re.findall(r'tasks\["([^"]+)"\] >> tasks\["([^"]+)"\]', text))
    dashed = {n.name: n.name.replace("_", "-") for n in pipeline.nodes}
    expected = {
        (dashed[parent.name], dashed[child.name])
        for child, parents in pipeline.node_dependencies.items()
        for parent in parents
    }
    assert edges == expected


def test_a_training_task_is_one_launched_job_when_the_worker_names_a_launcher(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from diffusion_gr2 import airflow_task

    launched: list[list[str]] = []
    monkeypatch.setattr(airflow_task.subprocess, "run", lambda cmd, **kw: launched.append(cmd))
    monkeypatch.setenv(airflow_task.LAUNCH_ENV, "accelerate launch --config_file conf/accelerate/ddp.yaml")
    monkeypatch.chdir(PROJECT_ROOT)
    airflow_task.run_nodes("retrain", ["train_cft"], "airflow")
    assert launched == [[
        "accelerate", "launch", "--config_file", "conf/accelerate/ddp.yaml", "-m", "diffusion_gr2", "run",
        "--env", "airflow", "--pipelines", "retrain", "--nodes", "train_cft",
    ]]  # fmt: skip
    sessions: list[list[str]] = []

    class Session:  # a node that does not train runs in the task's process, launcher or not
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def run(self, pipeline_names, node_names):
            sessions.append(node_names)

    monkeypatch.setattr("kedro.framework.session.KedroSession.create", lambda **kw: Session())
    airflow_task.run_nodes("retrain", ["convert_teacher"], "airflow")
    assert sessions == [["convert_teacher"]] and len(launched) == 1


def test_a_task_on_the_projects_interpreter_comes_back_skipped_or_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Airflow in its own environment: exit 99 is the skip (with the child's reason), any other failure fails."""
    import subprocess

    from diffusion_gr2 import airflow_task

    def child(status: int, reason: str | None) -> Callable[..., subprocess.CompletedProcess]:
        def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
            assert command[:4] == ["/p/python", "-m", "diffusion_gr2.airflow_task", "retrain"]
            if reason is not None:
                Path(command[command.index("--reason-file") + 1]).write_text(reason)
            return subprocess.CompletedProcess(command, status)

        return run

    monkeypatch.setattr(airflow_task.subprocess, "run", child(airflow_task.SKIP_EXIT, "nothing new"))
    assert airflow_task.run_on("/p/python", "retrain", ["decide_retrain"], "airflow", None) == "nothing new"
    monkeypatch.setattr(airflow_task.subprocess, "run", child(0, None))
    assert airflow_task.run_on("/p/python", "retrain", ["train_cft"], "airflow", None) is None
    monkeypatch.setattr(airflow_task.subprocess, "run", child(1, None))
    with pytest.raises(subprocess.CalledProcessError):
        airflow_task.run_on("/p/python", "retrain", ["train_cft"], "airflow", None)
