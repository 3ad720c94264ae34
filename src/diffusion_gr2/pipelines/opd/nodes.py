"""opd node: on-policy distillation from the frozen AR teacher (docs/architecture.md#training-stages)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.train.loop import TrainConfig
from diffusion_gr2.core.train.stages import RolloutConfig, opd_batches, opd_loss
from diffusion_gr2.pipelines.training import train_stage
from diffusion_gr2.runner import launch_size


def train_opd(
    model_cft: PreTrainedModel,
    model_ar_rl: PreTrainedModel,
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Student rollouts from its real decoder, teacher logits once per rollout, forward KL by replay."""
    train_requests = requests[requests["split"] == "train"].reset_index(drop=True)
    model_ar_rl.eval().requires_grad_(False)
    make_batch = opd_batches(
        model_ar_rl,
        tokenizer,
        train_requests,
        RolloutConfig(**params["rollout"]),
        TrainConfig(**params["train"]).grad_accum,
        launch_size(),
    )
    loss_fn = opd_loss(tokenizer.pad_token_id)
    return train_stage("opd", model_cft, make_batch, loss_fn, params, train_requests, decodes=True)
