"""distill: rl → distilled, in rounds of trajectory distillation (expert iteration on the diffusion
model). Each round decodes training requests with the model it starts from, keeps the valid answers
and trains that model on the canvases those decodes ran; the second round starts from the first
round's model, so it learns from answers a model that already commits more per forward wrote.

Recording decodes once, on rank 0 (its rows, kept or set aside with their reason, are a dataset);
training runs on every process of a launch, as the other training stages do.
"""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines.training import record_trajectories_node
from diffusion_gr2.runner import ALL_RANKS

from .nodes import train_distilled

# Per round: (parameters, node-name suffix, the model it starts from, its trajectories, its model, its summary)
ROUNDS = (
    ("distill", "", "model_rl", "trajectories", "model_distill_round1", "distill_summary"),
    (
        "distill_round2",
        "_round2",
        "model_distill_round1",
        "trajectories_round2",
        "model_distilled",
        "distill_round2_summary",
    ),
)


def create_pipeline(**kwargs) -> Pipeline:
    nodes = []
    for params, suffix, model, trajectories, trained, summary in ROUNDS:
        nodes += [
            Node(
                record_trajectories_node,
                [model, "requests", "tokenizer", f"params:{params}", "params:inference"],
                trajectories,
                name=f"record_trajectories{suffix}",
            ),
            Node(
                train_distilled,
                [model, trajectories, "tokenizer", f"params:{params}"],
                [trained, summary],
                name=f"train_distilled{suffix}",
                tags=ALL_RANKS,
            ),
        ]
    return Pipeline(nodes)
