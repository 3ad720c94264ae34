"""opd: cft → opd (on-policy distillation from ar_rl)."""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.runner import ALL_RANKS

from .nodes import train_opd


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                train_opd,
                ["model_cft", "model_ar_rl", "requests", "tokenizer", "params:opd"],
                ["model_opd", "opd_summary"],
                name="train_opd",
                tags=ALL_RANKS,
            )
        ]
    )
