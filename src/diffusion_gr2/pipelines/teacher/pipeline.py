"""teacher: tokenizer → AR model → copy mid-training → SFT (ar_sft) → expert iteration on its own valid
answers (ar_ei) → DAPO RL (ar_rl, the frozen teacher)."""

from kedro.pipeline import Node, Pipeline

from diffusion_gr2.core.train.trajectory import self_training_examples
from diffusion_gr2.pipelines.training import record_trajectories_node, train_policy_rl, train_supervised
from diffusion_gr2.runner import ALL_RANKS

from .nodes import build_ar_model, midtrain_copy


def create_pipeline(**kwargs) -> Pipeline:
    return Pipeline(
        [
            Node(
                build_ar_model,
                ["tokenizer", "params:teacher_sft"],
                "model_ar_init",
                name="build_ar_model",
                tags=ALL_RANKS,
            ),
            Node(
                midtrain_copy,
                ["model_ar_init", "sids", "tokenizer", "params:teacher_midtrain"],
                ["model_ar_mid", "ar_mid_summary"],
                name="midtrain_ar_copy",
                tags=ALL_RANKS,
            ),
            Node(
                train_supervised,
                ["model_ar_mid", "sft_examples", "tokenizer", "params:teacher_sft"],
                ["model_ar_sft", "ar_sft_summary"],
                name="train_ar_sft",
                tags=ALL_RANKS,
            ),
            Node(
                record_trajectories_node,
                ["model_ar_sft", "requests", "tokenizer", "params:teacher_ei", "params:inference"],
                "teacher_answers",
                name="record_teacher_answers",
            ),
            Node(
                self_training_examples,
                ["sft_examples", "teacher_answers"],
                "teacher_examples",
                name="teacher_self_training_examples",
            ),
            Node(
                train_supervised,
                ["model_ar_sft", "teacher_examples", "tokenizer", "params:teacher_ei"],
                ["model_ar_ei", "ar_ei_summary"],
                name="train_ar_ei",
                tags=ALL_RANKS,
            ),
            Node(
                train_policy_rl,
                ["model_ar_ei", "requests", "tokenizer", "params:teacher_rl"],
                ["model_ar_rl", "ar_rl_summary"],
                name="train_ar_rl",
                tags=ALL_RANKS,
            ),
        ]
    )
