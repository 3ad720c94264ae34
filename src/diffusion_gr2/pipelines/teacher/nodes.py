"""teacher nodes: the AR GR2 re-ranker — model factory, SFT, then DAPO RL (DESIGN §5, §7)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.model.factory import ModelSpec, build_model
from diffusion_gr2.core.train.stages import (
    RolloutConfig,
    SupervisedConfig,
    example_batches,
    grpo_batches,
    grpo_loss,
    supervised_loss,
)
from diffusion_gr2.pipelines.training import train_stage


def build_ar_model(tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]) -> PreTrainedModel:
    """A Qwen3-architecture model (random config, local HF checkpoint or GGUF) with our vocabulary."""
    return build_model(ModelSpec(**params["model"]), tokenizer)


def train_sft(
    model: PreTrainedModel,
    sft_examples: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """SFT on the assistant message, answer tokens weighted above reasoning tokens."""
    config = SupervisedConfig(**params["supervised"], block_size=1)
    make_batch = example_batches(sft_examples, tokenizer.pad_token_id, config)
    summary = train_stage("ar_sft", model, make_batch, supervised_loss(config), params, sft_examples)
    return model, summary


def train_policy_rl(
    model: PreTrainedModel, requests: pd.DataFrame, tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """DAPO on the policy's own rollouts; the same node trains the AR teacher and the diffusion model."""
    train_requests = requests[requests["split"] == "train"].reset_index(drop=True)
    rollout = RolloutConfig(**params["rollout"])
    loss_fn = grpo_loss(tokenizer.pad_token_id, params["clip_low"], params["clip_high"])
    summary = train_stage(
        params["stage"],
        model,
        grpo_batches(tokenizer, train_requests, rollout),
        loss_fn,
        params,
        train_requests,
    )
    return model, summary
