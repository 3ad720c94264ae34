"""rl: opd → rl (DAPO with the diffusion policy; log-probs by replay). Final Diffusion-GR2."""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.pipelines.training import train_policy_rl
from diffusion_gr2.runner import ALL_RANKS


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                train_policy_rl,
                ["model_opd", "requests", "tokenizer", "params:rl"],
                ["model_rl", "rl_summary"],
                name="train_diffusion_rl",
                tags=ALL_RANKS,
            )
        ]
    )
