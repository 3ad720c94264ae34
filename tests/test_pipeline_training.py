"""The shared training nodes: the RL node reuses each rollout batch and reports where the clip acted."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffusion_gr2.core.train.trajectory import EXAMPLE_COLUMNS, TRAJECTORY_COLUMNS, self_training_examples
from diffusion_gr2.pipelines.distill.nodes import train_distilled
from diffusion_gr2.pipelines.training import record_trajectories_node, train_policy_rl
from tests.conftest import PROJECT_ROOT
from tests.core.train.test_stages import policy_model, task  # noqa: F401 (`task` is a fixture)


def _params(root: Path, checkpoint_every: int = 4) -> dict:
    return {
        "stage": "rl",
        "checkpoint_root": str(root),
        "grpo": {"clip_low": 0.2, "clip_high": 0.2, "ppo_epochs": 2, "mini_batches": 2},
        # under the grammar every rollout is valid, so groups have reward variance and train
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 48, "threshold": 0.5,
                    "constrained": True},
        "train": {"lr": 3e-2, "max_steps": 4, "checkpoint_every": checkpoint_every, "log_every": 1,
                  "cpu": True, "progress": False},
    }  # fmt: skip


def test_rl_node_reports_the_clip_of_reused_rollouts(task: dict, tmp_path: Path) -> None:  # noqa: F811
    tok = task["tokenizer"]
    requests = task["requests"].assign(split="train")
    _, summary = train_policy_rl(policy_model(tok, 4), requests, tok, _params(tmp_path))
    assert summary["steps"] == 4 and summary["final_ppo_epoch"] == 1
    assert summary["mean_clip_fraction"] > 0 and 0 < summary["share_of_steps_clipped"] < 1  # not step 1
    assert summary["mean_kl_old"] > 0 and summary["mean_entropy"] > 0


def test_rl_checkpoints_must_fall_between_rollout_batches(task: dict, tmp_path: Path) -> None:  # noqa: F811
    tok = task["tokenizer"]
    with pytest.raises(ValueError, match="multiple of the 4 updates"):
        train_policy_rl(policy_model(tok, 1), task["requests"], tok, _params(tmp_path, checkpoint_every=3))


def test_a_stage_with_no_steps_records_nothing_and_trains_on_the_examples_alone(task: dict) -> None:  # noqa: F811
    """Expert iteration off (0 steps, the default budget): no decode runs, and the teacher's and
    CFT's data are the SFT examples, row for row."""
    params = {"train": {"max_steps": 0}, "trajectories": {"tau": None, "grammar": False}}
    answers = record_trajectories_node(None, task["requests"], task["tokenizer"], params, {})
    assert answers.empty and list(answers.columns) == list(TRAJECTORY_COLUMNS)
    examples = self_training_examples(task["sft"], answers)
    assert examples.equals(task["sft"][EXAMPLE_COLUMNS].reset_index(drop=True))
    # distillation with no steps: nothing recorded, the model passed through unchanged
    sentinel = object()
    assert train_distilled(sentinel, answers, task["tokenizer"], params) == (
        sentinel,
        {"steps": 0, "skipped": True},
    )


def test_each_distillation_round_starts_from_the_one_before_and_the_last_is_the_served_model() -> None:
    from diffusion_gr2.parameters import file_parameters
    from diffusion_gr2.pipelines.distill.pipeline import ROUNDS, create_pipeline

    assert ROUNDS == 3
    nodes = {n.name: n for n in create_pipeline().nodes}
    assert len(nodes) == 2 * ROUNDS
    assert nodes["record_trajectories"].inputs[0] == "model_rl"
    assert nodes["train_distilled"].outputs[0] == "model_distill_round1"
    assert nodes["record_trajectories_round2"].inputs[0] == "model_distill_round1"
    assert nodes["train_distilled_round2"].inputs[:2] == ["model_distill_round1", "trajectories_round2"]
    assert nodes["train_distilled_round2"].outputs[0] == "model_distill_round2"
    assert nodes["record_trajectories_round3"].inputs[0] == "model_distill_round2"
    assert nodes["train_distilled_round3"].inputs[:2] == ["model_distill_round2", "trajectories_round3"]
    assert nodes["train_distilled_round3"].outputs[0] == "model_distilled"
    # every later round takes the first's settings, under its own stage name (checkpoints, metrics)
    params = file_parameters(PROJECT_ROOT / "conf/base/parameters_training.yml")
    first = params["distill"]
    assert first["stage"] == "distill"
    for k in range(2, ROUNDS + 1):
        later = params[f"distill_round{k}"]
        assert later["stage"] == f"distill_round{k}"
        assert {key: v for key, v in later.items() if key != "stage"} == {
            key: v for key, v in first.items() if key != "stage"
        }
