"""cft: naive → cft (conversion fine-tuning)."""

from kedro.pipeline import Node, Pipeline

from .nodes import train_cft


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                train_cft,
                ["model_naive", "sft_examples", "tokenizer", "params:cft"],
                ["model_cft", "cft_summary"],
                name="train_cft",
            )
        ]
    )
