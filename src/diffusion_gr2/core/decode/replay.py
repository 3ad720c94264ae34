"""Replay: the logits each decoded token was committed from, rebuilt from its commit record.

OPD and RL need the student's distribution on the exact canvas it saw when it committed a token
(TraceRL: a one-step mean-field estimate does not match how the model decodes). The canvas of a
token committed at step s of block b is: prompt, clean blocks before b, and block b with the tokens
committed at steps < s visible and the rest MASK. A block's first token (step 0) comes from the
clean prefix, so one block-causal forward of `[prompt | response]` gives it.

Cost, for a whole batch of rollouts: one clean forward (whose KV cache is then shared) plus, per
block index, one forward in which each rollout's distinct step canvases of that block sit side by
side as noisy copies (the training layout's trick: each copy sees the clean prefix and itself
only), so the cached prefix is never duplicated per canvas. Block size 1 is a single causal forward.
Differentiable: call it with grad enabled to train through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from diffusion_gr2.core.decode.commit import fed_width, leftmost_masked
from diffusion_gr2.core.decode.config import DecodeOutput
from diffusion_gr2.core.decode.runner import left_pad_prompts
from diffusion_gr2.core.model.diffusion import cached_block_hidden, layout_hidden, lm_logits
from diffusion_gr2.core.model.masks import Layout, prompt_response_layout

__all__ = ["replay_batch_logits", "replay_logits", "replay_logprobs"]


def _records(
    outputs: Sequence[DecodeOutput], k: int, mask_token_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Tokens and commit steps `[n, R]` of every block the decoder ran (output, then its tail).

    R is a multiple of k; positions past a row's record are MASK with step -1 (never committed).
    """
    rows = [([*o.tokens, *o.tail_tokens], [*o.commit_steps, *o.tail_steps]) for o in outputs]
    width = max(len(t) for t, _ in rows)
    width += -width % k
    tokens = torch.full((len(rows), width), mask_token_id, dtype=torch.long)
    steps = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, (t, s) in enumerate(rows):
        tokens[i, : len(t)], steps[i, : len(s)] = torch.tensor(t, dtype=torch.long), torch.tensor(s)
    return tokens.to(device), steps.to(device)


def _prefix_cache(cache: DynamicCache, n: int, rows: Tensor) -> DynamicCache:
    """The first `n` positions of `cache`, for the batch rows `rows`."""
    return DynamicCache(
        ddp_cache_data=[(lay.keys[rows, :, :n], lay.values[rows, :, :n]) for lay in cache.layers]
    )


def _canvas_layout(layout: Layout, rows: Tensor, prefix: int, k: int, fed: Tensor) -> Layout:
    """`[clean prefix | canvas 1 | ... | canvas S]` of the block at column `prefix`, for `rows`.

    Canvas c is noisy copy c of the block (same block id and positions); `fed` [n, S, k] marks the
    positions a row's canvas really fed (its window; nothing for a canvas it never ran), the others
    are padding, attended by nobody.
    """
    head = layout.head(prefix + k).rows(rows)
    s = fed.shape[1]
    block_cols = slice(prefix, prefix + k)
    copy = torch.arange(1, s + 1, device=rows.device).repeat_interleave(k).expand(len(rows), -1)
    return Layout(
        torch.cat([head.block[:, :prefix], head.block[:, block_cols].repeat(1, s)], 1),
        torch.cat([head.copy[:, :prefix], copy], 1),
        torch.cat([head.valid[:, :prefix], fed.flatten(1)], 1),
        torch.cat([head.position[:, :prefix], head.position[:, block_cols].repeat(1, s)], 1),
    )


def _step_canvases(
    tokens: Tensor, step_of: Tensor, mask_token_id: int, window: int | None, max_steps: int | None
) -> tuple[Tensor, Tensor]:
    """Every step canvas of one block, per row: `[m, S, k]` tokens (those committed before step s,
    MASK elsewhere) and the positions each fed (S = the most steps a row's block ran; a row feeds
    nothing in canvases it never ran). `tokens`, `step_of` `[m, k]`: the block's record."""
    k = tokens.shape[1]
    n_steps = step_of.max(1).values  # [m]: canvases each row's block ran
    s = torch.arange(1, int(n_steps.max()) + 1, device=tokens.device)[None, :, None]  # canvas c runs step c
    visible = (step_of[:, None, :] >= 0) & (step_of[:, None, :] < s)  # committed before that step
    canvases = torch.where(visible, tokens[:, None, :], mask_token_id)  # [m, S, k]
    fed = (s <= n_steps[:, None, None]).expand(-1, -1, k)  # [m, S, k]: canvases the row ran
    if window is not None:  # the decoder's window, counted from each canvas's leftmost masked position
        width = fed_width(leftmost_masked(~visible), k, window)  # [m, S]
        width = torch.where(s[..., 0] == (max_steps or k), k, width)  # the step cap feeds it all
        fed = fed & (torch.arange(k, device=tokens.device) < width[..., None])
    return canvases, fed


def replay_batch_logits(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[DecodeOutput],
    block_size: int,
    mask_token_id: int,
    window: int | None = None,
    max_steps: int | None = None,
) -> Tensor:
    """Logits `[n, r, v]` (r = longest output): `[i, j]` is the distribution `outputs[i].tokens[j]`
    was committed from. Rows are right-padded; logits past a row's output are meaningless.

    `window` and `max_steps` are the decoder's (`DecodeConfig.window`, `max_steps_per_block`): a
    canvas fed only the positions up to its leftmost masked one plus the window, except at the step
    cap, which feeds the whole block."""
    dev, k = model.device, block_size
    lengths = torch.tensor([len(o.tokens) for o in outputs], device=dev)
    r = int(lengths.max())
    tokens, steps = _records(outputs, k, mask_token_id, dev)
    prompt_ids, prompt_valid = left_pad_prompts(prompts, mask_token_id, dev)
    p = prompt_ids.shape[1]  # every prompt ends in column p - 1
    full = torch.ones_like(tokens, dtype=torch.bool)
    clean_valid = torch.arange(r, device=dev) < lengths[:, None]
    cache = DynamicCache(config=model.config)
    clean = layout_hidden(
        model,
        torch.cat([prompt_ids, tokens[:, :r]], 1),
        prompt_response_layout(prompt_valid, clean_valid, k),
        cache,
    )
    hidden = clean[:, p - 1 : p + r - 1]  # [n, r, h]: the clean prefix predicts every step-0 token
    canvas_layout = prompt_response_layout(prompt_valid, full, k)  # the decoder saw whole blocks
    for start in range(0, r, k):
        block_steps = steps[:, start : start + k]  # [n, k]
        n_steps = block_steps.max(1).values  # canvases each row's block ran
        rows = torch.nonzero((n_steps >= 1) & (lengths > start)).squeeze(1)
        if len(rows) == 0:
            continue
        step_of = block_steps[rows]  # [m, k]
        canvases, fed = _step_canvases(
            tokens[rows, start : start + k], step_of, mask_token_id, window, max_steps
        )
        lay = _canvas_layout(canvas_layout, rows, p + start, k, fed)
        canvas_h = cached_block_hidden(
            model, canvases.flatten(1), lay, _prefix_cache(cache, p + start, rows), full_mask=True
        ).view(len(rows), fed.shape[1], k, -1)
        # token j >= 1 of the block, committed at step s >= 1, is predicted at position j - 1 of canvas
        # s; token 0 always by the clean prefix (also when a fused forward committed it at step 1)
        in_output = start + torch.arange(k, device=dev) < lengths[rows, None]
        from_canvas = (step_of >= 1) & in_output & (torch.arange(k, device=dev) >= 1)
        row, j = torch.nonzero(from_canvas, as_tuple=True)
        hidden = hidden.index_put((rows[row], start + j), canvas_h[row, step_of[row, j] - 1, j - 1])
    return lm_logits(model, hidden)


def replay_logits(
    model: PreTrainedModel,
    prompt_ids: Sequence[int] | Tensor,
    output: DecodeOutput,
    block_size: int,
    mask_token_id: int,
) -> Tensor:
    """Logits `[r, v]` of one rollout: row j is the distribution `output.tokens[j]` was committed from."""
    prompt = torch.as_tensor(prompt_ids).view(-1).tolist()
    return replay_batch_logits(model, [prompt], [output], block_size, mask_token_id)[0]


def replay_logprobs(
    model: PreTrainedModel,
    prompt_ids: Sequence[int] | Tensor,
    output: DecodeOutput,
    block_size: int,
    mask_token_id: int,
    temperature: float = 1.0,
) -> Tensor:
    """[r] log-probs of the decoded tokens, as the decoder's `token_logprobs` recorded them.

    Pass the decoder's temperature when it sampled (it records log-probs of the tempered
    distribution); greedy decoding records temperature-1 log-probs.
    """
    logits = replay_logits(model, prompt_ids, output, block_size, mask_token_id).float() / temperature
    taken = torch.tensor(output.tokens, device=logits.device)
    return torch.log_softmax(logits, -1).gather(-1, taken[:, None]).squeeze(-1)
