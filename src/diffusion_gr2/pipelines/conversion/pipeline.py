"""conversion: ar_rl → naive block-diffusion model (same weights, [MASK], block size B)."""

from kedro.pipeline import Node, Pipeline

from .nodes import convert_teacher


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                convert_teacher,
                ["model_ar_rl", "tokenizer", "params:conversion"],
                "model_naive",
                name="convert_teacher",
            )
        ]
    )
