"""teacher nodes: the AR GR2 re-ranker from the model factory (DESIGN §5); SFT and RL are shared nodes."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.model.factory import ModelSpec, build_model


def build_ar_model(tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]) -> PreTrainedModel:
    """A Qwen3-architecture model (random config, local HF checkpoint or GGUF) with our vocabulary."""
    return build_model(ModelSpec(**params["model"]), tokenizer)
