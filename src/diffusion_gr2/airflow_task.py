"""What one task of the generated Airflow DAG runs (airflow_dags/dag_template.j2).

A task is one Kedro node (`kedro airflow create` groups nothing here). A training node (tagged
``all_ranks``) becomes one launched job when the worker sets ``DIFFUSION_GR2_LAUNCH`` to the launcher,
for example ``accelerate launch --config_file conf/accelerate/ddp.yaml``: the task runs
``<launcher> -m diffusion_gr2 run --env ENV --pipelines PIPELINE --nodes NODE`` and fails when it
fails. Every other node, and every node when the variable is unset, runs in the task's own process,
as kedro-airflow's default DAG does.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

LAUNCH_ENV = "DIFFUSION_GR2_LAUNCH"
PACKAGE = "diffusion_gr2"


def launch_command(
    launcher: str, env: str, pipeline: str, nodes: list[str], conf_source: str | None
) -> list[str]:
    """The command a launched task runs: the launcher, then ``-m diffusion_gr2 run`` on the task's nodes."""
    command = [*shlex.split(launcher), "-m", PACKAGE, "run", "--env", env, "--pipelines", pipeline]
    command += ["--nodes", ",".join(nodes)]
    return command + (["--conf-source", conf_source] if conf_source else [])


def run_nodes(pipeline: str, nodes: list[str], env: str, conf_source: str | None = None) -> None:
    """Run ``nodes`` of ``pipeline``: as a launched job if they train and a launcher is set, else here."""
    from kedro.framework.project import configure_project, pipelines
    from kedro.framework.session import KedroSession

    from diffusion_gr2.runner import runs_on_all_ranks

    configure_project(PACKAGE)
    launcher = os.environ.get(LAUNCH_ENV, "").strip()
    trains = any(runs_on_all_ranks(n) for n in pipelines[pipeline].nodes if n.name in nodes)
    if launcher and trains:
        command = launch_command(launcher, env, pipeline, nodes, conf_source)
        logger.info("launching %s", shlex.join(command))
        subprocess.run(command, check=True, cwd=Path.cwd(), stdout=sys.stdout, stderr=sys.stderr)
        return
    with KedroSession.create(project_path=Path.cwd(), env=env, conf_source=conf_source) as session:
        session.run(pipeline_names=[pipeline], node_names=nodes)
