"""retrain: fresh files → the default DAG on the merged data → register → gate → promote or refuse.

`registration_pipeline` (register the trained `rl`/`ar_rl`, gate, promote) is also the pipeline
``register``: after a first `kedro run` it puts the models in the registry (the first passing
version becomes champion).
"""

from __future__ import annotations

from importlib import import_module

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines import TRAINING_STAGES

from .nodes import after_ingest, gate_requests, register_models, run_gate, take_in_incoming


def registration_pipeline() -> Pipeline:
    return Pipeline(
        [
            Node(
                register_models,
                [
                    "model_rl",
                    "model_ar_rl",
                    "items",
                    "sids",
                    "params:retrain",
                    "params:traces",
                    "params:inference",
                ],
                "registered_versions",
                name="register_models",
            ),
            Node(
                gate_requests,
                ["candidates", "splits", "items", "params:retrain"],
                "gate_requests",
                name="gate_requests",
            ),
            Node(
                run_gate,
                ["registered_versions", "gate_requests", "params:retrain"],
                {"gate_report": "gate_report", "gate_metrics": "gate_metrics"},
                name="run_gate",
            ),
        ]
    )


def _wait_for_ingest(data_prep: Pipeline) -> Pipeline:
    """`data_prep` with its `prepare_dataset` node taking the ingest report as an extra input."""
    nodes = []
    for node in data_prep.nodes:
        if node.name == "prepare_dataset":
            node = Node(
                after_ingest(node.func),
                [*node.inputs, "ingest_report"],
                node._outputs,
                name=node.name,
            )
        nodes.append(node)
    return Pipeline(nodes)


def retrain_pipeline() -> Pipeline:
    """Ingest, the DAG's training stages (data_prep waiting for the ingest), then registration and gate.

    The stages are imported here: Kedro builds only the pipelines a run asks for (``--pipelines
    retrain`` alone), so they are not in the registry's discovered set.
    """
    stages = {s: import_module(f"diffusion_gr2.pipelines.{s}").create_pipeline() for s in TRAINING_STAGES}
    ingest = Pipeline([Node(take_in_incoming, "params:retrain", "ingest_report", name="take_in_incoming")])
    dag = sum((stages[s] for s in TRAINING_STAGES[1:]), _wait_for_ingest(stages["data_prep"]))
    return ingest + dag + registration_pipeline()


def create_pipeline(**kwargs) -> Pipeline:
    """The ingest and registration nodes alone; the registry assembles the full retrain (it needs the stages)."""
    ingest = Pipeline([Node(take_in_incoming, "params:retrain", "ingest_report", name="take_in_incoming")])
    return ingest + registration_pipeline()
