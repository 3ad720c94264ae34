"""What one task of the generated Airflow DAG runs (airflow_dags/dag_template.j2).

A task is one Kedro node (`kedro airflow create` groups nothing here). A training node (tagged
``all_ranks``) becomes one launched job when the worker sets ``DIFFUSION_GR2_LAUNCH`` to the launcher,
for example ``accelerate launch --config_file conf/accelerate/ddp.yaml``: the task runs
``<launcher> -m diffusion_gr2 run --env ENV --pipelines PIPELINE --nodes NODE`` and fails when it
fails. Every other node, and every node when the variable is unset, runs in the task's own process,
as kedro-airflow's default DAG does.

Airflow in an environment of its own: Airflow 3.3 cannot join the project's pinned set (it needs
fastapi<0.137, the lock pins 0.165), so `make setup-airflow` installs it into ``.venv-airflow`` with
this package but none of its dependencies. A worker there sets ``DIFFUSION_GR2_PYTHON`` to the
project's interpreter (``.venv/bin/python``); each task then runs
``<python> -m diffusion_gr2.airflow_task PIPELINE ENV NODE...``, which does the above in the project's
environment. This module imports only the standard library at import time, so the DAG parses there.

Nothing to retrain: the retrain pipeline's first node decides whether there is anything to retrain
(`pipelines/retrain/decision.py`). When it decides not to, its task raises Airflow's skip, and Airflow
skips every task after it (each waits for all its upstream tasks to succeed, the default trigger
rule): nothing is trained or registered and the run ends skipped, not failed. From the project's
interpreter the skip comes back as exit status 99 (`SKIP_EXIT`, the status Airflow's BashOperator
reads as a skip).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

LAUNCH_ENV = "DIFFUSION_GR2_LAUNCH"
PYTHON_ENV = "DIFFUSION_GR2_PYTHON"
PACKAGE = "diffusion_gr2"
SKIP_EXIT = 99


def launch_command(
    launcher: str, env: str, pipeline: str, nodes: list[str], conf_source: str | None
) -> list[str]:
    """The command a launched task runs: the launcher, then ``-m diffusion_gr2 run`` on the task's nodes."""
    command = [*shlex.split(launcher), "-m", PACKAGE, "run", "--env", env, "--pipelines", pipeline]
    command += ["--nodes", ",".join(nodes)]
    return command + (["--conf-source", conf_source] if conf_source else [])


def task_command(
    python: str, pipeline: str, nodes: list[str], env: str, conf_source: str | None, reason_file: Path
) -> list[str]:
    """The command a task runs on the project's interpreter when Airflow has an environment of its own."""
    command = [*shlex.split(python), "-m", f"{PACKAGE}.airflow_task", pipeline, env, *nodes]
    command += ["--reason-file", str(reason_file)]
    return command + (["--conf-source", conf_source] if conf_source else [])


def run_nodes(pipeline: str, nodes: list[str], env: str, conf_source: str | None = None) -> None:
    """The body of an Airflow task: run ``nodes`` of ``pipeline``; skip the task when they decided that
    there is nothing to retrain (so Airflow skips the rest of the run)."""
    python = os.environ.get(PYTHON_ENV, "").strip()
    if python:
        reason = run_on(python, pipeline, nodes, env, conf_source)
    else:
        reason = run_here(pipeline, nodes, env, conf_source)
    if reason is not None:
        _skip(reason)


def run_on(python: str, pipeline: str, nodes: list[str], env: str, conf_source: str | None) -> str | None:
    """Run ``nodes`` as a process on the project's interpreter ``python``; why it stopped, or None."""
    with tempfile.TemporaryDirectory() as tmp:  # the child writes there why it stopped, if it did
        reason_file = Path(tmp) / "reason.txt"
        command = task_command(python, pipeline, nodes, env, conf_source, reason_file)
        logger.info("running %s", shlex.join(command))
        status = subprocess.run(command, cwd=Path.cwd()).returncode
        if status == SKIP_EXIT:
            return reason_file.read_text() if reason_file.exists() else "nothing to retrain"
    if status:
        raise subprocess.CalledProcessError(status, command)
    return None


def _skip(reason: str) -> None:
    from airflow.sdk.exceptions import AirflowSkipException

    raise AirflowSkipException(reason)


def run_here(pipeline: str, nodes: list[str], env: str, conf_source: str | None) -> str | None:
    """Run ``nodes`` from this interpreter: as a launched job if they train and a launcher is set, else
    in this process. The reason to stop when they decided there is nothing to retrain, else None."""
    if importlib.util.find_spec("kedro") is None:
        raise RuntimeError(
            f"{sys.executable} lacks the project's packages (Airflow in its own environment?): "
            f"set {PYTHON_ENV} to the project's interpreter, e.g. .venv/bin/python"
        )
    from kedro.framework.project import configure_project, pipelines
    from kedro.framework.session import KedroSession

    from diffusion_gr2.core.monitoring.retrain_decision import NothingToRetrain
    from diffusion_gr2.pipelines.retrain.decision import DECISION, DECISION_NODE
    from diffusion_gr2.runner import runs_on_all_ranks

    configure_project(PACKAGE)
    launcher = os.environ.get(LAUNCH_ENV, "").strip()
    trains = any(runs_on_all_ranks(n) for n in pipelines[pipeline].nodes if n.name in nodes)
    if launcher and trains:
        command = launch_command(launcher, env, pipeline, nodes, conf_source)
        logger.info("launching %s", shlex.join(command))
        subprocess.run(command, check=True, cwd=Path.cwd(), stdout=sys.stdout, stderr=sys.stderr)
        return None
    with KedroSession.create(project_path=Path.cwd(), env=env, conf_source=conf_source) as session:
        try:
            outputs = session.run(pipeline_names=[pipeline], node_names=nodes)
        except NothingToRetrain as stop:  # the decision and the ingest in one task: the ingest refused
            return str(stop)
    decision = outputs[DECISION].load() if DECISION_NODE in nodes and DECISION in outputs else None
    return None if decision is None or decision["retrain"] else decision["reason"]


def main(argv: list[str] | None = None) -> int:
    """``python -m diffusion_gr2.airflow_task PIPELINE ENV NODE...``: one task on the project's interpreter."""
    parser = argparse.ArgumentParser(prog=f"python -m {PACKAGE}.airflow_task", description=main.__doc__)
    parser.add_argument("pipeline")
    parser.add_argument("env")
    parser.add_argument("nodes", nargs="+")
    parser.add_argument("--conf-source", default=None)
    parser.add_argument("--reason-file", default=None, help="where to write why the run stops, if it does")
    args = parser.parse_args(argv)
    reason = run_here(args.pipeline, args.nodes, args.env, args.conf_source)
    if reason is None:
        return 0
    sys.stderr.write(f"skip: {reason}\n")
    if args.reason_file:
        Path(args.reason_file).write_text(reason)
    return SKIP_EXIT


if __name__ == "__main__":
    raise SystemExit(main())
