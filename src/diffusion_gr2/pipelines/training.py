"""The training nodes every stage shares: SFT/CFT, DAPO RL (AR or diffusion), recording a policy's own
decodes (distillation, expert iteration), and their bookkeeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.rank.rerank import RerankConfig, prepare_model
from diffusion_gr2.core.runs.mlflow_utils import MlflowTracker
from diffusion_gr2.core.train.checkpoint import content_fingerprint
from diffusion_gr2.core.train.grpo import GRPOConfig
from diffusion_gr2.core.train.loop import TrainConfig, train
from diffusion_gr2.core.train.stages import (
    RolloutConfig,
    SupervisedConfig,
    example_batches,
    policy_block_size,
    rl_batches,
    rl_loss,
    supervised_loss,
)
from diffusion_gr2.core.train.trajectory import TRAJECTORY_COLUMNS, TrajectoryConfig, record_trajectories
from diffusion_gr2.runner import launch_size


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
    summarise: Callable[[list[dict[str, float]]], dict[str, float]] | None = None,
    decodes: bool = False,
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Train ``model`` on the shared loop; the trained model and the stage's summary.

    Checkpoints live under a fingerprinted folder. ``summarise(history)`` adds run-wide figures to the
    summary (the final step's metrics are there anyway); ``decodes``: ``make_batch`` samples rollouts
    with the model (OPD, RL). The model is trained in place, except under
    FSDP, where its parameters end as shards: a fresh model with the gathered weights is returned.
    """
    run_dir = Path(params["checkpoint_root"]) / stage / fingerprint(params, model, *frames)
    config = TrainConfig(output_dir=str(run_dir), **params["train"])
    start = time.perf_counter()
    result = train(model, make_batch, loss_fn, config, MlflowTracker(stage), decodes)
    if result.full_state_dict is not None:
        model = type(model)(model.config)
        model.load_state_dict(result.full_state_dict, strict=False)  # tied weights are stored once
    model.eval()
    return model, {
        **{f"final_{k}": v for k, v in result.final_metrics.items()},
        "steps": result.steps,
        "resumed_from_step": result.resumed_from or 0,
        # every step's time, steps run before a resume included; run_seconds is this call alone
        "train_seconds": round(result.seconds, 1),
        "run_seconds": round(time.perf_counter() - start, 1),
        "processes": result.processes,
        # this process's peak (the main one's): GPU memory allocated on CUDA, resident memory on the CPU
        "peak_memory_mb": round(result.peak_memory_mb, 1),
        **(summarise(result.history) if summarise is not None else {}),
    }


def rl_diagnostics(history: list[dict[str, float]]) -> dict[str, float]:
    """Run-wide means of the per-step GRPO diagnostics, and the share of steps where the clip acted."""
    out = {
        f"mean_{k}": float(np.mean([h[k] for h in history if k in h]))
        for k in ("clip_fraction", "kl_old", "entropy", "ratio_mean")
        if any(k in h for h in history)
    }
    if "mean_clip_fraction" in out:
        out["share_of_steps_clipped"] = float(np.mean([h.get("clip_fraction", 0.0) > 0 for h in history]))
    return out


def train_supervised(
    model: PreTrainedModel,
    sft_examples: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """SFT (an AR model) or CFT (a converted model): the block size comes from the model itself.

    Answer tokens weigh more than reasoning tokens (GR2); for block size k > 1 the loss is the
    masked-diffusion CE with complementary views and the token shift (docs/architecture.md#training-stages).
    """
    config = SupervisedConfig(**params["supervised"], block_size=policy_block_size(model))
    make_batch = example_batches(sft_examples, tokenizer.pad_token_id, config)
    loss_fn = supervised_loss(config, tokenizer.mask_token_id)
    return train_stage(params["stage"], model, make_batch, loss_fn, params, sft_examples)


def train_policy_rl(
    model: PreTrainedModel, requests: pd.DataFrame, tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """DAPO on the policy's own rollouts; the same node trains the AR teacher and the diffusion model.

    Each rollout batch trains `grpo.ppo_epochs` x `grpo.mini_batches` optimiser steps (`train.max_steps`
    counts optimiser steps); checkpoints must fall between rollout batches so a resume is exact.
    """
    train_requests = requests[requests["split"] == "train"].reset_index(drop=True)
    rollout, grpo = RolloutConfig(**params["rollout"]), GRPOConfig(**params["grpo"])
    train = TrainConfig(**params["train"])  # the typed loop settings: unknown keys refused
    every = train.checkpoint_every
    if every > 0 and every % grpo.updates:
        raise ValueError(
            f"train.checkpoint_every ({every}) must be a multiple of the {grpo.updates} updates per rollout batch"
        )
    # each process samples its own shares of a step's rollout batch (the global batch stays the same)
    grad_accum = train.grad_accum
    make_batch = rl_batches(tokenizer, train_requests, rollout, grpo, grad_accum, launch_size())
    loss_fn = rl_loss(tokenizer.pad_token_id, grpo)
    stage = params["stage"]
    return train_stage(
        stage, model, make_batch, loss_fn, params, train_requests, summarise=rl_diagnostics, decodes=True
    )


def record_trajectories_node(
    model: PreTrainedModel,
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
    inference: dict[str, Any],
) -> pd.DataFrame:
    """`params.trajectories.requests` training requests decoded as inference serves them (the grammar as
    `params.trajectories.grammar` says): distillation's trajectories, expert iteration's own answers.
    A stage with no training steps records nothing (an empty frame): nothing would learn from it."""
    if params["train"]["max_steps"] <= 0:
        return pd.DataFrame(columns=list(TRAJECTORY_COLUMNS)).astype({"kept": bool})
    decoding = RerankConfig(**inference["decoding"])
    train_requests = requests[requests["split"] == "train"].reset_index(drop=True)
    return record_trajectories(
        prepare_model(model, decoding.device),
        tokenizer,
        train_requests,
        decoding,
        TrajectoryConfig(**params["trajectories"]),
    )
