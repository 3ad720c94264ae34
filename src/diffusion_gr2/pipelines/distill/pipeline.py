"""distill: rl → distilled (trajectory distillation on rl's own served decodes).

Recording decodes once, on rank 0 (its rows, kept or set aside with their reason, are a dataset);
training runs on every process of a launch, as the other training stages do.
"""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines.training import record_trajectories_node
from diffusion_gr2.runner import ALL_RANKS

from .nodes import train_distilled


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                record_trajectories_node,
                ["model_rl", "requests", "tokenizer", "params:distill", "params:inference"],
                "trajectories",
                name="record_trajectories",
            ),
            Node(
                train_distilled,
                ["model_rl", "trajectories", "tokenizer", "params:distill"],
                ["model_distilled", "distill_summary"],
                name="train_distilled",
                tags=ALL_RANKS,
            ),
        ]
    )
