"""teacher nodes: the AR GR2 re-ranker — model factory and copy mid-training; SFT and RL are shared nodes."""

from __future__ import annotations

from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.model.factory import ModelSpec, build_model
from diffusion_gr2.core.text.midtraining import copy_task_examples
from diffusion_gr2.pipelines.training import train_supervised


def build_ar_model(tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]) -> PreTrainedModel:
    """A Qwen3-architecture model (random config, local HF checkpoint or GGUF) with our vocabulary."""
    return build_model(ModelSpec(**params["model"]), tokenizer)


def midtrain_copy(
    model: PreTrainedModel, sids: pd.DataFrame, tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]
) -> tuple[PreTrainedModel, dict[str, Any]]:
    """Mid-training on the copy task before SFT; `train.max_steps: 0` skips it (pretrained models)."""
    if params["train"]["max_steps"] <= 0:
        return model, {"steps": 0, "skipped": True}
    examples = copy_task_examples(
        list(sids["sid"]),
        tokenizer,
        params["examples"],
        params["n_candidates"],
        params["seed"],
        params["answer_order"],
    )
    return train_supervised(model, examples, tokenizer, params)
