"""Replay: the logits each decoded token was committed from, rebuilt from its commit record.

OPD and RL need the student's distribution on the exact canvas it saw when it committed a token
(TraceRL: a one-step mean-field estimate does not match how the model decodes). The canvas of a
token committed at step s of block b is: prompt, clean blocks before b, and block b with the tokens
committed at steps < s visible and the rest MASK. A block's first token (step 0) comes from the
clean prefix, so one block-causal forward of `[prompt | response]` gives it.

Cost: one clean forward (whose KV cache is then shared) plus, per block, one forward of its distinct
step canvases stacked in a batch. Block size 1 is a single causal forward. Differentiable: call it
with grad enabled to train through it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from diffusion_gr2.core.decode.decoder import DecodeOutput
from diffusion_gr2.core.model.diffusion import cached_block_hidden, layout_hidden, lm_logits
from diffusion_gr2.core.model.masks import prompt_response_layout

__all__ = ["replay_logits", "replay_logprobs"]


def _record(output: DecodeOutput, k: int, mask_token_id: int) -> tuple[list[int], list[int]]:
    """Tokens and steps of every block the decoder ran: output, its tail, MASK up to a full block."""
    tokens = [*output.tokens, *output.tail_tokens]
    steps = [*output.commit_steps, *output.tail_steps]
    pad = -len(tokens) % k
    return tokens + [mask_token_id] * pad, steps + [-1] * pad


def _block_canvases(tokens: Tensor, steps: Tensor, mask_token_id: int) -> Tensor:
    """[S, k] canvases of one block from its tokens/steps [k]; row s-1 is what step s ran."""
    s = torch.arange(1, int(steps.max()) + 1, device=steps.device)[:, None]  # [S, 1]
    visible = (steps[None, :] >= 0) & (steps[None, :] < s)  # committed before step s
    return torch.where(visible, tokens[None, :], mask_token_id)


def _prefix_cache(cache: DynamicCache, n: int, rows: int) -> DynamicCache:
    """The first `n` positions of a one-row `cache`, repeated over `rows` rows."""
    data = [
        (lay.keys[:, :, :n].expand(rows, -1, -1, -1), lay.values[:, :, :n].expand(rows, -1, -1, -1))
        for lay in cache.layers
    ]
    return DynamicCache(ddp_cache_data=data)


def replay_logits(
    model: PreTrainedModel,
    prompt_ids: Sequence[int] | Tensor,
    output: DecodeOutput,
    block_size: int,
    mask_token_id: int,
) -> Tensor:
    """Logits `[r, v]`: row j is the distribution `output.tokens[j]` was committed from."""
    dev, k, r = model.device, block_size, len(output.tokens)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long, device=dev).view(1, -1)
    p = prompt.shape[1]
    rec_tokens, rec_steps = (torch.tensor(x, device=dev) for x in _record(output, k, mask_token_id))
    ones = torch.ones(1, p + len(rec_tokens), dtype=torch.bool, device=dev)
    layout = prompt_response_layout(ones[:, :p], ones[:, p:], k)
    cache = DynamicCache(config=model.config)
    clean = layout_hidden(model, torch.cat([prompt, rec_tokens[None, :r]], 1), layout.head(p + r), cache)
    hidden = clean[0, p - 1 : p + r - 1]  # [r, h]: the clean prefix predicts every step-0 token
    for start in range(0, r, k):
        tokens, steps = rec_tokens[start : start + k], rec_steps[start : start + k]
        if int(steps.max()) < 1:
            continue
        canvases = _block_canvases(tokens, steps, mask_token_id)  # [S, k]
        lay = layout.head(p + start + k).rows(torch.zeros(canvases.shape[0], dtype=torch.long, device=dev))
        canvas_h = cached_block_hidden(
            model, canvases, lay, _prefix_cache(cache, p + start, canvases.shape[0])
        )
        i = torch.nonzero((steps >= 1) & (torch.arange(k, device=dev) < r - start)).squeeze(
            1
        )  # block positions
        hidden = hidden.index_put(
            (start + i,), canvas_h[steps[i] - 1, i - 1]
        )  # position i-1 predicts token i
    return lm_logits(model, hidden)


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
