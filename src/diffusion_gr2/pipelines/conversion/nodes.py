"""conversion node: the AR teacher's weights, unchanged, as a block-diffusion model
(docs/architecture.md#models-and-attention)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.model.diffusion import as_block_diffusion, check_conversion


def convert_teacher(
    model_ar_rl: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]
) -> PreTrainedModel:
    """Copy the weights, record block size and mask token; nothing is trained (the `naive` system).

    The model returned (the one the catalog saves) is checked against the AR model it came from.
    """
    block_size, mask_id = params["block_size"], tokenizer.mask_token_id
    converted = as_block_diffusion(model_ar_rl, block_size, mask_id)
    check_conversion(model_ar_rl, converted, block_size, mask_id)
    return converted
