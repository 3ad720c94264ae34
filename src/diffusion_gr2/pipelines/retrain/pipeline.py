"""retrain: decide → fresh files → the default DAG on the merged data (warm or cold) → the served
diffusion system's operating point on validation → register → gate → promote.

The first node decides whether there is anything to retrain (`decision.py`): nothing new and a
champion serving stops the run there, under Kedro or Airflow.

`registration_pipeline` (register the trained diffusion system and `ar_rl`, gate, promote) is also the pipeline
``register`` (its own folder, `pipelines/register`): after a first `kedro run` it puts the models in
the registry (the first passing version becomes champion).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION
from diffusion_gr2.pipelines import TRAINING_STAGES
from diffusion_gr2.pipelines.distill.pipeline import ROUNDS as DISTILL_ROUNDS
from diffusion_gr2.pipelines.distill.pipeline import round_names

from .decision import DECISION, DECISION_NODE, after_decision, decide_retrain
from .nodes import (
    after_ingest,
    choose_operating_point,
    gate_requests,
    register_models,
    run_gate,
    take_in_incoming,
)
from .warm import plan_warm_start, warm_budget, warm_conversion, warm_sids, warm_teacher, warm_tokenizer


def registration_pipeline(delivery: str | None = None) -> Pipeline:
    """Register, gate, promote; reads the run's `operating_point` (inference's, or the retrain's own).

    `delivery` (the retrain's `ingest_report`) gives the gate's shadow evaluation its feedback.
    """
    return Pipeline(
        [
            Node(
                register_models,
                [
                    f"model_{SERVED_DIFFUSION}",
                    "model_ar_rl",
                    "items",
                    "sids",
                    "operating_point",
                    "params:retrain",
                    "params:traces",
                    "params:inference",
                    "evidence",
                    "splits",
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
                ["registered_versions", "gate_requests", "params:retrain", "params:serving", "params:policy"]
                + ([delivery] if delivery else []),
                {"gate_report": "gate_report", "gate_metrics": "gate_metrics"},
                name="run_gate",
            ),
        ]
    )


# The training nodes a warm start runs under `retrain.warm_start.budgets` (keyed by their parameters).
BUDGETED_NODES = (
    "midtrain_ar_copy",
    "train_ar_sft",
    "train_ar_ei",
    "train_ar_rl",
    "train_cft",
    "train_opd",
    "train_diffusion_rl",
    # every distillation round's training node (their count is the distill pipeline's)
    *(f"train_distilled{round_names(k)['suffix']}" for k in range(1, DISTILL_ROUNDS + 1)),
)


def _rewired(
    pipeline: Pipeline, changes: dict[str, tuple[Callable[[Node], Callable], list[str]]]
) -> Pipeline:
    """`pipeline` with the named nodes' functions replaced by `wrap(node)` and `extra` inputs appended."""
    nodes = []
    for node in pipeline.nodes:
        if node.name in changes:
            wrap, extra = changes[node.name]
            node = Node(wrap(node), [*node.inputs, *extra], node._outputs, name=node.name, tags=node.tags)
        nodes.append(node)
    return Pipeline(nodes)


def _budgeted(node: Node) -> Callable:
    """A training node under the warm budget of its own parameters (`params:<stage>`)."""
    at, name = next((i, n) for i, n in enumerate(node.inputs) if n.startswith("params:"))
    return warm_budget(node.func, name.removeprefix("params:"), at)


def retrain_pipeline() -> Pipeline:
    """The decision, the ingest, the warm-start plan, the DAG's training stages, then registration and gate.

    `data_prep` waits for the ingest; the nodes `warm.py` names take the plan (cold when it is not
    warm). The stages are imported here: Kedro builds only the pipelines a run asks for
    (``--pipelines retrain`` alone), so they are not in the registry's discovered set.
    """
    stages = {s: import_module(f"diffusion_gr2.pipelines.{s}").create_pipeline() for s in TRAINING_STAGES}
    plan = ["warm_start"]
    changes = {
        "prepare_dataset": (lambda n: after_ingest(n.func), ["ingest_report"]),
        "fit_item_sids": (lambda n: warm_sids(n.func), ["items", *plan]),
        "train_tokenizer": (lambda n: warm_tokenizer(n.func), plan),
        "build_ar_model": (lambda n: warm_teacher(n.func), plan),
        "convert_teacher": (lambda n: warm_conversion(n.func), plan),
        **{name: (_budgeted, plan) for name in BUDGETED_NODES},
    }
    dag = _rewired(sum(stages.values(), Pipeline([])), changes)
    missing = set(changes) - {n.name for n in dag.nodes}
    if missing:
        raise RuntimeError(f"retrain rewires nodes the stages no longer have: {sorted(missing)}")
    warm = Pipeline(
        [Node(plan_warm_start, ["params:retrain", "ingest_report"], "warm_start", name="plan_warm_start")]
    )
    # the operating point of the models this retrain trained, chosen on its validation requests
    chosen = Pipeline(
        [
            Node(
                choose_operating_point,
                [
                    f"model_{SERVED_DIFFUSION}",
                    "model_ar_rl",
                    "requests",
                    "tokenizer",
                    "params:inference",
                    "params:policy",  # the gate's (run_gate) too
                ],
                "operating_point",
                name="choose_operating_point",
            )
        ]
    )
    return _ingest() + warm + dag + chosen + registration_pipeline("ingest_report")


def _ingest() -> Pipeline:
    """Decide, then take the files in: every other node waits for the ingest, so for the decision."""
    return Pipeline(
        [
            Node(decide_retrain, "params:retrain", DECISION, name=DECISION_NODE),
            Node(
                after_decision(take_in_incoming),
                ["params:retrain", DECISION],
                {
                    "ingest_report": "ingest_report",
                    "drift_report": "drift_report",
                    "drift_html": "drift_html",
                },
                name="take_in_incoming",
            ),
        ]
    )


def create_pipeline(**kwargs) -> Pipeline:
    return retrain_pipeline()
