"""cft: naive → cft. Conversion fine-tuning is the supervised node with the converted model's block size."""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines.training import train_supervised
from diffusion_gr2.runner import ALL_RANKS


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                train_supervised,
                ["model_naive", "teacher_examples", "tokenizer", "params:cft"],
                ["model_cft", "cft_summary"],
                name="train_cft",
                tags=ALL_RANKS,
            )
        ]
    )
