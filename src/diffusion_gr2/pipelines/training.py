"""The training nodes every stage shares: SFT/CFT, DAPO RL (AR or diffusion), and their bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.tracking.mlflow_utils import MlflowTracker
from diffusion_gr2.core.train.checkpoint import content_fingerprint
from diffusion_gr2.core.train.loop import TrainConfig, train
from diffusion_gr2.core.train.stages import (
    RolloutConfig,
    SupervisedConfig,
    example_batches,
    grpo_batches,
    grpo_loss,
    policy_block_size,
    supervised_loss,
)


def fingerprint(params: dict[str, Any], model: torch.nn.Module, *frames: pd.DataFrame) -> str:
    """Hash of what a training run depends on, so a resume never picks up another run's checkpoint."""
    return content_fingerprint(params, model, *frames)


def train_stage(
    stage: str,
    model: torch.nn.Module,
    make_batch: Callable,
    loss_fn: Callable,
    params: dict[str, Any],
    *frames: pd.DataFrame,
) -> dict[str, Any]:
    """Train ``model`` in place on the shared loop; checkpoints live under a fingerprinted folder."""
    run_dir = Path(params["checkpoint_root"]) / stage / fingerprint(params, model, *frames)
    config = TrainConfig(output_dir=str(run_dir), **params["train"])
    start = time.perf_counter()
    result = train(model, make_batch, loss_fn, config, MlflowTracker(stage))
    model.eval()
    return {
        **{f"final_{k}": v for k, v in result.final_metrics.items()},
        "steps": result.steps,
        "resumed_from_step": result.resumed_from or 0,
        # every step's time, steps run before a resume included; run_seconds is this call alone
        "train_seconds": round(result.seconds, 1),
        "run_seconds": round(time.perf_counter() - start, 1),
    }


def train_supervised(
    model: PreTrainedModel,
    sft_examples: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """SFT (an AR model) or CFT (a converted model): the block size comes from the model itself.

    Answer tokens weigh more than reasoning tokens (GR2); for block size k > 1 the loss is the
    masked-diffusion CE with complementary views and the token shift (DESIGN §6).
    """
    config = SupervisedConfig(**params["supervised"], block_size=policy_block_size(model))
    make_batch = example_batches(sft_examples, tokenizer.pad_token_id, config)
    loss_fn = supervised_loss(config, tokenizer.mask_token_id)
    return model, train_stage(params["stage"], model, make_batch, loss_fn, params, sft_examples)


def train_policy_rl(
    model: PreTrainedModel, requests: pd.DataFrame, tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """DAPO on the policy's own rollouts; the same node trains the AR teacher and the diffusion model."""
    train_requests = requests[requests["split"] == "train"].reset_index(drop=True)
    rollout = RolloutConfig(**params["rollout"])
    loss_fn = grpo_loss(tokenizer.pad_token_id, params["clip_low"], params["clip_high"])
    make_batch = grpo_batches(tokenizer, train_requests, rollout)
    return model, train_stage(params["stage"], model, make_batch, loss_fn, params, train_requests)
