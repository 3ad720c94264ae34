"""Block-diffusion forward passes with the token shift, and AR -> block-diffusion conversion.

Token shift (Fast-dLLM v2; docs/architecture.md#models-and-attention): the hidden state at position i-1
predicts token i, so the LM head keeps its AR meaning and block size 1 is exactly the AR model.

Convention shared with the decoder (pinned by tests): position 0 of every response block is always
clean. Its prediction comes from the previous position of the *clean* sequence (the prompt's last
token for block 0) -- at inference that is the committed previous block's last logit. Positions
1..k-1 are predicted from the previous position of the noisy copy, which lies in the same block.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch
from torch import Tensor
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.model.factory import load_model, save_model
from diffusion_gr2.core.model.lean import LeanForward
from diffusion_gr2.core.model.masks import (
    Layout,
    additive_mask,
    attention_mask,
    block_order_mask,
    cached_step_mask,
    dense_mask,
    flex_mask,
    prompt_response_layout,
    two_copy_layout,
)

logger = logging.getLogger(__name__)

__all__ = [
    "as_block_diffusion",
    "cached_block_hidden",
    "check_conversion",
    "convert_to_block_diffusion",
    "layout_hidden",
    "lm_logits",
    "response_logits",
]


def layout_hidden(
    model: PreTrainedModel, input_ids: Tensor, layout: Layout, cache: Cache | None = None
) -> Tensor:
    """Final hidden states `[b, l, h]` of a full forward of `input_ids` `[b, l]` under `layout`.

    With `cache`, the keys/values are written to it (a prefill).
    """
    mask = attention_mask(layout, model.config._attn_implementation, model.dtype)
    out = model.base_model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=layout.position,
        cache=cache,
        use_cache=cache is not None,
    )
    return out.last_hidden_state


def cached_block_hidden(
    model: PreTrainedModel,
    block: Tensor,
    layout: Layout,
    cache: Cache,
    full_mask: bool = False,
    lean: LeanForward | None = None,
    block_order: bool = False,
) -> Tensor:
    """Hidden states `[b, q, h]` of `block` `[b, q]` run after the clean prefix held in `cache`.

    `layout` covers cache + block (n + q columns). The block's keys/values are appended to `cache`
    (crop them off again for a noisy canvas). The decoder's single canvas sees every key, so its mask
    is key validity alone; `full_mask` builds the predicate's mask instead, for queries that hold
    several canvases as noisy copies (replay). `block_order` builds the same mask for queries that
    need block order but hold no copies (a clean block beside a canvas, several clean tokens after
    the prompt: `block_order_mask`). `lean` runs the same forward without the modules (`lean.py`,
    the decoder's `backend: lean`).
    """
    q, impl = block.shape[1], model.config._attn_implementation
    if lean is not None:  # boolean masks, as SDPA takes them
        if full_mask:
            mask = dense_mask(layout, q)
        else:
            mask = block_order_mask(layout, q) if block_order else layout.valid[:, None, None, :]
        return lean.hidden(block, layout.position[:, -q:], mask, cache)
    if impl == "flex_attention":
        mask = flex_mask(layout, q)
    elif full_mask:
        mask = attention_mask(layout, impl, model.dtype, q_len=q)
    elif block_order:
        order = block_order_mask(layout, q)
        mask = additive_mask(order, model.dtype) if impl == "eager" else order
    else:  # a slice of the validity row, not a rebuilt mask: cheap on every decode step
        mask = cached_step_mask(layout.valid, impl, model.dtype)
    out = model.base_model(
        input_ids=block,
        attention_mask=mask,
        position_ids=layout.position[:, -q:],
        cache=cache,
        use_cache=True,
    )
    return out.last_hidden_state


def lm_logits(model: PreTrainedModel, hidden: Tensor) -> Tensor:
    """LM-head logits `[..., v]` of hidden states `[..., h]` (computed only where needed)."""
    return model.get_output_embeddings()(hidden)


def _last_prompt_column(prompt_valid: Tensor) -> Tensor:
    """[b] column of each row's last prompt token (works for left and right padding)."""
    cols = torch.arange(prompt_valid.shape[1], device=prompt_valid.device)
    last = torch.where(prompt_valid, cols, -1).max(1).values
    if bool((last < 0).any()):
        raise ValueError("every row needs at least one prompt token (it predicts the first response token)")
    return last


def _shift_sources(prompt_valid: Tensor, r: int, block_size: int, views: int = 1) -> Tensor:
    """[b, views, r] column whose hidden state predicts response token j (layouts of `response_logits`)."""
    b, p = prompt_valid.shape
    j = torch.arange(r, device=prompt_valid.device)
    view = torch.arange(views, device=prompt_valid.device)[:, None]
    src = p + view * r + j - 1  # plain shift inside the response (k = 1), or inside noisy copy `view`
    if block_size > 1:  # a block's first token: the clean copy's previous position
        src = torch.where(j % block_size == 0, p + views * r + j - 1, src)
    src = src.expand(b, views, r)
    return torch.where(j == 0, _last_prompt_column(prompt_valid)[:, None, None], src)


def response_logits(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    response_ids: Tensor,
    block_size: int,
    noisy_response_ids: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    response_mask: Tensor | None = None,
) -> Tensor:
    """Logits `[b, r, v]` with `logits[:, j]` predicting `response_ids[:, j]` (token shift).

    prompt_ids: [b, p] (padding on either side, given by `prompt_mask` [b, p], 1 = token);
    response_ids: [b, r], right-padded (`response_mask` [b, r]); logits at padded positions are
    meaningless. Block size 1: one causal forward of `[prompt | response]`. Block size k > 1: the 2L
    forward `[prompt | noisy | clean]` of the canvas `noisy_response_ids` [b, r], taken as given:
    position 0 of a noisy block may be a mask (the decoder's fused first forward has it masked); the
    prediction of position 0 itself always comes from the clean copy. Several canvases of each example, [b, n, r], run as n noisy copies in one sequence that
    shares the prompt and the clean copy, and give logits `[b, n, r, v]`.
    """
    b, p = prompt_ids.shape
    r = response_ids.shape[1]
    pv = torch.ones_like(prompt_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask.bool()
    rv = torch.ones_like(response_ids, dtype=torch.bool) if response_mask is None else response_mask.bool()
    views, stacked = 1, noisy_response_ids is not None and noisy_response_ids.dim() == 3
    if block_size == 1:
        ids, layout = torch.cat([prompt_ids, response_ids], 1), prompt_response_layout(pv, rv, 1)
    else:
        if noisy_response_ids is None:
            raise ValueError("block_size > 1 needs noisy_response_ids (the canvas the model denoises)")
        noisy = noisy_response_ids.reshape(b, -1, r)  # [b, views, r]
        views = noisy.shape[1]
        ids = torch.cat([prompt_ids, noisy.flatten(1), response_ids], 1)
        layout = two_copy_layout(pv, rv, block_size, views)
    hidden = layout_hidden(model, ids, layout)  # [b, l, h]
    src = _shift_sources(pv, r, block_size, views).flatten(1)  # [b, views * r]
    picked = hidden.gather(1, src[..., None].expand(*src.shape, hidden.shape[-1]))
    logits = lm_logits(model, picked)  # [b, views * r, v]
    return logits.view(b, views, r, -1) if block_size > 1 and stacked else logits


def as_block_diffusion(model: PreTrainedModel, block_size: int, mask_token_id: int | None) -> PreTrainedModel:
    """A copy of an AR model as a block-diffusion model (docs/architecture.md#models-and-attention); nothing
    is trained.

    The weights are copied unchanged, and the block size and mask token id go into the config
    (`config.block_size`, `config.mask_token_id`), which the decoder and the stages read. Block size 1
    is exactly the AR model. `check_conversion` verifies the result against `model`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    vocab = model.get_input_embeddings().num_embeddings
    if mask_token_id is None or not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask token id {mask_token_id} is not in the model's vocabulary of {vocab}")
    converted = copy.deepcopy(model)
    converted.config.block_size = block_size
    converted.config.mask_token_id = mask_token_id
    logger.info("converted to block diffusion (B=%d, mask id %d)", block_size, mask_token_id)
    return converted


def check_conversion(
    ar_model: PreTrainedModel, converted: PreTrainedModel, block_size: int, mask_token_id: int
) -> None:
    """Raise unless `converted` holds `ar_model`'s weights key by key and records B and the mask id.

    Run on the model a conversion returns (not on a copy of it), so a conversion that drops, adds or
    alters a weight, or forgets the config entries the decoder reads, fails here
    (docs/architecture.md#code-conventions).
    """
    if converted is ar_model:
        raise ValueError("conversion must return a new model: the AR teacher stays an AR model")
    before, after = ar_model.state_dict(), converted.state_dict()
    missing, unexpected = sorted(before.keys() - after.keys()), sorted(after.keys() - before.keys())
    changed = sorted(
        k
        for k in before.keys() & after.keys()
        if before[k].shape != after[k].shape or not torch.equal(before[k], after[k].to(before[k].device))
    )
    if missing or unexpected or changed:
        raise ValueError(
            f"conversion must copy every weight unchanged: missing {missing}, unexpected {unexpected}, "
            f"changed {changed}"
        )
    recorded = (
        getattr(converted.config, "block_size", None),
        getattr(converted.config, "mask_token_id", None),
    )
    if recorded != (block_size, mask_token_id):
        raise ValueError(
            f"converted config records (block_size, mask_token_id) = {recorded}, "
            f"expected {(block_size, mask_token_id)}"
        )


def convert_to_block_diffusion(
    ar_model_dir: str | Path, out_dir: str | Path, block_size: int, tokenizer: PreTrainedTokenizerBase
) -> Path:
    """`as_block_diffusion` from and to model directories, checked before anything is written."""
    model = load_model(ar_model_dir)  # rejects missing and unexpected keys
    converted = as_block_diffusion(model, block_size, tokenizer.mask_token_id)
    check_conversion(model, converted, block_size, tokenizer.mask_token_id)
    return save_model(converted, tokenizer, out_dir)
