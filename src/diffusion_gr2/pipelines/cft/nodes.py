"""cft node: conversion fine-tuning, the masked-diffusion loss on the teacher traces (DESIGN §6)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.train.stages import (
    SupervisedConfig,
    example_batches,
    policy_block_size,
    supervised_loss,
)
from diffusion_gr2.pipelines.training import train_stage


def train_cft(
    model_naive: PreTrainedModel,
    sft_examples: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Complementary block masks, token shift, prompt never masked, lambda_r / lambda_o weights."""
    config = SupervisedConfig(**params["supervised"], block_size=policy_block_size(model_naive))
    make_batch = example_batches(sft_examples, tokenizer.pad_token_id, config)
    loss_fn = supervised_loss(config, tokenizer.mask_token_id)
    summary = train_stage("cft", model_naive, make_batch, loss_fn, params, sft_examples)
    return model_naive, summary
