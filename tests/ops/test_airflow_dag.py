"""The committed Airflow DAG is the retrain pipeline as it is now (regenerate it when a node changes)."""

from __future__ import annotations

import re

from diffusion_gr2.pipelines.retrain import retrain_pipeline
from tests.conftest import PROJECT_ROOT

DAG = PROJECT_ROOT / "airflow_dags/diffusion_gr2_airflow_retrain_dag.py"


def test_the_airflow_dag_has_one_task_per_retrain_node_and_its_edges() -> None:
    text = DAG.read_text()
    tasks = set(re.findall(r'_run_kedro_node\(node_names=\["([^"]+)"\]\)', text))
    pipeline = retrain_pipeline()
    assert tasks == {n.name for n in pipeline.nodes}, (
        "stale DAG: kedro airflow create -p retrain -e airflow -t airflow_dags/"
    )
    edges = set(re.findall(r'tasks\["([^"]+)"\] >> tasks\["([^"]+)"\]', text))
    dashed = {n.name: n.name.replace("_", "-") for n in pipeline.nodes}
    expected = {
        (dashed[parent.name], dashed[child.name])
        for child, parents in pipeline.node_dependencies.items()
        for parent in parents
    }
    assert edges == expected
