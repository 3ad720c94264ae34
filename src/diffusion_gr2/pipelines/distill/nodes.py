"""distill nodes: train a round's model on the canvases of its own kept free decodes of training
requests (recorded by `pipelines/training.record_trajectories_node`: docs/architecture.md)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.train.trajectory import kept_trajectories
from diffusion_gr2.pipelines.training import train_supervised


def train_distilled(
    model: PreTrainedModel,
    trajectories: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The CFT loss on the kept trajectories' canvases plus the certainty term (`core/train/trajectory.py`);
    `train.max_steps: 0` skips it (nothing was recorded: `record_trajectories_node`)."""
    if params["train"]["max_steps"] <= 0:
        return model, {"steps": 0, "skipped": True}
    kept = kept_trajectories(trajectories)
    model, summary = train_supervised(model, kept, tokenizer, params)  # the noise pattern is a setting
    recorded = trajectories["response_ids"].map(len).sum()
    return model, {
        **summary,
        "trajectories": len(trajectories),
        "kept": len(kept),
        "set_aside_by_reason": trajectories.loc[~trajectories["kept"], "reason"].value_counts().to_dict(),
        # the recording pass: what the model did before distillation, on training requests
        "recorded_tokens_per_forward": round(float(recorded / max(trajectories["nfe"].sum(), 1)), 3),
        "recorded_top1_share": round(float((trajectories["target_rank"] == 1).mean()), 4),
    }
