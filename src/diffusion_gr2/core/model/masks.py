"""The one attention-mask module: block-causal inference masks and the 2L training mask.

Every mask comes from one predicate (`block_attention_predicate`), written in flex-attention's
`mask_mod(b, h, q_idx, kv_idx)` form so the same function yields a flex `BlockMask`, a dense boolean
SDPA mask and an additive float mask for eager attention (bd3lms/dllm keep one mask function the
same way). The predicate reads per-position attributes held in a `Layout`:

* `block`: prompt tokens each get their own id (their column), response tokens share one id per
  block of `k`, always larger than every prompt id -> "sees blocks <= mine" is causal on the prompt,
  bidirectional inside a response block and causal across blocks.
* `copy`: 0 for the prompt and the clean response, c > 0 for noisy copy c. A noisy block sees the
  prompt, clean blocks strictly before it and its own block of its own copy (BD3-LM's 2L layout);
  clean positions never see a noisy one.
* `valid`: False for padding; a padded key is seen by nobody but itself (a fully masked query row
  would make SDPA return NaN, which then leaks through `0 * NaN` in later layers).
* `position`: RoPE position ids; the noisy and clean copies of a block share them.

Queries are always the last `q_len` columns of the layout (a full forward has `q_len = l`; a
cached block step has the block as queries and cache + block as keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]

__all__ = [
    "Layout",
    "additive_mask",
    "attention_mask",
    "block_attention_predicate",
    "block_order_mask",
    "cached_step_mask",
    "dense_mask",
    "flex_mask",
    "prompt_response_layout",
    "two_copy_layout",
]


@dataclass(frozen=True)
class Layout:
    """Per-position attributes of a batch of sequences, each `[b, l]`."""

    block: Tensor  # long: block id (see module docstring)
    copy: Tensor  # long: 0 prompt/clean, c > 0 noisy copy c
    valid: Tensor  # bool: False on padding
    position: Tensor  # long: RoPE position ids

    @property
    def length(self) -> int:
        return self.block.shape[1]

    def head(self, n: int, rows: int | None = None) -> Layout:
        """The first `n` columns (a cached prefix plus the block being run), of the first `rows` rows."""
        return Layout(
            self.block[:rows, :n], self.copy[:rows, :n], self.valid[:rows, :n], self.position[:rows, :n]
        )

    def rows(self, index: Tensor) -> Layout:
        """The rows in `index` (finished rows leave the batch)."""
        return Layout(self.block[index], self.copy[index], self.valid[index], self.position[index])


def _prompt_parts(prompt_valid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Block ids `[b, p]`, positions `[b, p]` and lengths `[b]` of a padded prompt (any padding side)."""
    b, p = prompt_valid.shape
    block = torch.arange(p, device=prompt_valid.device).expand(b, p)
    position = (prompt_valid.long().cumsum(1) - 1).clamp(min=0)
    return block, position, prompt_valid.sum(1)


def _response_parts(prompt_len: Tensor, p: int, r: int, block_size: int) -> tuple[Tensor, Tensor]:
    """Block ids and positions `[b, r]` of a response that follows a (padded) prompt of width `p`."""
    j = torch.arange(r, device=prompt_len.device)
    block = (p + torch.div(j, block_size, rounding_mode="floor")).expand(prompt_len.shape[0], r)
    return block, prompt_len[:, None] + j  # response token j sits at position len(prompt) + j


def prompt_response_layout(prompt_valid: Tensor, response_valid: Tensor, block_size: int) -> Layout:
    """Inference layout `[prompt (causal) | response blocks of k]`.

    prompt_valid: [b, p] bool (left or right padding); response_valid: [b, r] bool.
    Block size 1 makes the whole layout plain causal.
    """
    p_block, p_pos, p_len = _prompt_parts(prompt_valid)
    r_block, r_pos = _response_parts(p_len, prompt_valid.shape[1], response_valid.shape[1], block_size)
    block = torch.cat([p_block, r_block], 1)
    return Layout(
        block,
        torch.zeros_like(block),
        torch.cat([prompt_valid, response_valid], 1),
        torch.cat([p_pos, r_pos], 1),
    )


def two_copy_layout(prompt_valid: Tensor, response_valid: Tensor, block_size: int, views: int = 1) -> Layout:
    """Training layout `[prompt | noisy response x views | clean response]` (BD3-LM 2L), shared positions.

    prompt_valid: [b, p]; response_valid: [b, r] -> layout of length p + (views + 1) r. Noisy copy
    c = 1..views sees the prompt, earlier clean blocks and its own block of copy c only, so several
    noise views of one example share a single prompt and clean copy instead of repeating them (the
    CFT's two complementary views cost p + 3r columns, not 2 (p + 2r)). `views=1` is the 2L layout.
    """
    if views < 1:
        raise ValueError(f"views must be >= 1, got {views}")
    p_block, p_pos, p_len = _prompt_parts(prompt_valid)
    r_block, r_pos = _response_parts(p_len, prompt_valid.shape[1], response_valid.shape[1], block_size)
    noisy_copies = [torch.full_like(r_block, c) for c in range(1, views + 1)]
    copy = torch.cat([torch.zeros_like(p_block), *noisy_copies, torch.zeros_like(r_block)], 1)
    return Layout(
        torch.cat([p_block, *[r_block] * (views + 1)], 1),
        copy,
        torch.cat([prompt_valid, *[response_valid] * (views + 1)], 1),
        torch.cat([p_pos, *[r_pos] * (views + 1)], 1),
    )


def block_attention_predicate(layout: Layout, q_len: int | None = None) -> MaskMod:
    """`mask_mod(b, h, q_idx, kv_idx) -> bool`: may query `q_idx` (of the last `q_len`) see `kv_idx`?"""
    offset = layout.length - (layout.length if q_len is None else q_len)
    block, copy, valid = layout.block, layout.copy, layout.valid

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q = q_idx + offset
        bq, bk, cq, ck = block[b, q], block[b, kv_idx], copy[b, q], copy[b, kv_idx]
        clean_kv = ck == 0
        # a clean query sees clean blocks up to its own; a noisy one only strictly earlier clean blocks
        sees_clean = clean_kv & torch.where(cq == 0, bk <= bq, bk < bq)
        sees_own_block = ~clean_kv & (ck == cq) & (bk == bq)
        return ((sees_clean | sees_own_block) & valid[b, kv_idx]) | (q == kv_idx)

    return mask_mod


def dense_mask(layout: Layout, q_len: int | None = None) -> Tensor:
    """Boolean SDPA mask `[b, 1, q, l]` (True = attend) from the predicate, by broadcasting indices."""
    b, n = layout.block.shape
    q = n if q_len is None else q_len
    dev = layout.block.device
    mask_mod = block_attention_predicate(layout, q)
    return mask_mod(
        torch.arange(b, device=dev).view(b, 1, 1, 1),
        torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev),
        torch.arange(q, device=dev).view(1, 1, q, 1),
        torch.arange(n, device=dev).view(1, 1, 1, n),
    )


def block_order_mask(layout: Layout, q_len: int) -> Tensor:
    """Boolean `[b, 1, q, l]` mask of a decode step after the prompt: key validity and block order.

    With no noisy copies (every `copy` is 0) the predicate reduces to "keys of blocks <= mine that
    are valid", plus a query's own key, which only matters to a query that sees nothing else (a
    padded prompt position). After the prefill every query sees the cached prompt, so the step's
    mask is this comparison: a few ops, where the predicate's gathers cost a tenth of a millisecond
    on every block's first forward (a clean block beside the next canvas, or AR's jumped tokens).
    """
    return (layout.block[:, None, None, :] <= layout.block[:, None, -q_len:, None]) & layout.valid[
        :, None, None, :
    ]


def additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """Float mask for eager attention: 0 where allowed, `finfo.min` (not -inf: no NaN) elsewhere.

    Eager attention *adds* the mask to the scores, so a boolean mask would be silently wrong.
    """
    zero = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def flex_mask(layout: Layout, q_len: int | None = None) -> BlockMask:
    """Flex-attention `BlockMask` over `[b, q, l]` from the same predicate."""
    b, n = layout.block.shape
    q = n if q_len is None else q_len
    mask_mod = block_attention_predicate(layout, q)
    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=q, KV_LEN=n, device=layout.block.device)


def attention_mask(
    layout: Layout, attn_impl: str, dtype: torch.dtype, q_len: int | None = None
) -> Tensor | BlockMask:
    """The mask in the form the model's attention backend needs (never None: SDPA would go causal)."""
    if attn_impl == "flex_attention":
        return flex_mask(layout, q_len)
    mask = dense_mask(layout, q_len)
    return additive_mask(mask, dtype) if attn_impl == "eager" else mask


def cached_step_mask(kv_valid: Tensor, attn_impl: str, dtype: torch.dtype) -> Tensor:
    """Mask `[b, 1, 1, n]` for a block run against a cache of clean blocks (cache + block = n keys).

    Every key is either an earlier clean position or in the query's own block, so the predicate
    reduces to key validity for every query: a broadcast slice instead of a rebuilt `[b, q, n]` mask
    (cheap enough to call on every decode step). SDPA and eager only; flex uses `flex_mask`.
    """
    mask = kv_valid[:, None, None, :]
    return additive_mask(mask, dtype) if attn_impl == "eager" else mask
