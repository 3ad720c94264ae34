"""One decoder for AR (block size 1) and block diffusion (block size k) (docs/architecture.md#decoding).

Fast-dLLM v2 style with an exact KV cache that only ever holds clean tokens (the prompt and finished
blocks). Read top to bottom:

* `config.py`: what is asked (`DecodeConfig`), what comes back (`DecodeOutput`), what is refused.
* `runner.py` + `kv_cache.py`: forwards of `[clean tokens not cached yet | canvas]` against the cache,
  rows done with their block left out of a forward. `static.py` + `static_cache.py` (opt-in,
  `static_cache`): the same forwards as fixed-shape steps that CUDA graphs capture (`cuda_graphs`).
* `commit.py`: pure functions: the choice, the window, the commit rule (`prefix`, `confident`) and
  the SID gate.
* `constrain.py`: the constraint walk (the answer grammar of `grammar.py` over the token tables of
  `grammar_tokens.py`, jump-forward).
* `drafters.py`: one `Drafter` protocol; lossless AR drafts (prompt lookup, a drafter model) and the
  lossy copy drafts of block diffusion.
* `state.py`: one batch's state; `steps.py`: the three kinds of step; this module: the loop.

Per block (`_decode_batch`): AR writes one token per forward (`steps.first_token`, with drafts
verified in the same forward), or none when the grammar forces every row's next token
(`steps.jump_forward`); block diffusion unmasks the block forward by forward (`steps.run_block`)
until each row's relevant positions are committed, at most `max_steps_per_block` forwards.
* `fused` (default): a finished block rides along in the next block's first forward, so a block
  costs no forward of its own; that canvas is all masks (its first token is being computed in the
  same forward), which CFT trains on (`losses.cft_noise` masks a block's first position too). The
  prompt rides with block 0 the same way. `fused=False` runs each finished block alone first (one
  extra forward per block, `steps.first_token`), then denoises with the first token known.
* `window` (None = the whole block): each row feeds only its canvas up to its leftmost masked position
  plus `window` masked positions; the others are not computed at all. A row's unfed positions are
  keys nobody attends to, so rows never depend on their batch neighbours. The step cap feeds the
  whole block.
* Jump-forward in AR: when every row of the batch has a forced next token, it is written without a
  forward and fed with the next forward (several clean tokens, causal among themselves), which also
  computes the logits that would have predicted it and counts a correction wherever the model would
  have written another: tokens, log-probs and `forced` are exactly those of one forward per token
  (`test_ar_jump_forward_is_exact`). In diffusion a forced position joins the step's run as certain
  (`constrain.py`): the run differs from the one without it, so there `forced == 0` means "every
  committed token was the model's own choice at its commit and no run was ended"; without
  jump-forward (and always for AR) it means token for token the unconstrained decode.

The model's forward (`DecodeConfig.backend`): `lean` (`core/model/lean.py`, the same arithmetic as
the transformers modules in a few tensor ops; the default model's step is bound by operator dispatch,
so this roughly halves it), `eager` (the modules themselves, the reference) or `auto` (default: lean
where it covers the model). AR and diffusion share it, so their ratio stays honest.

Batching: `decode` sorts prompts longest first and decodes them `batch_size` at a time (the one
batching layer; `progress` hears of each batch). Prompts are left-padded (with matching position ids
and masks) and all rows of a batch decode the same block together; rows that reached the end of
output leave the batch. `commit_steps` record the forward of its block that committed each token (0 =
before the block's first forward: AR, or `fused=False`; `replay.py` rebuilds every canvas from it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.config import BACKENDS, COMMIT_RULES, DRAFTS, DecodeConfig, DecodeOutput, check
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.decode.runner import left_pad_prompts, resolved_backend
from diffusion_gr2.core.decode.shards import active_shards
from diffusion_gr2.core.decode.state import Batch, Block
from diffusion_gr2.core.decode.steps import ar_drafts, first_token, jump_forward, run_block

logger = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "COMMIT_RULES",
    "DRAFTS",
    "DecodeConfig",
    "DecodeOutput",
    "decode",
    "left_pad_prompts",
    "resolved_backend",
]


def _next_block(st: Batch) -> tuple[Block, bool]:
    """The batch's next block, filled by the step its settings call for; whether it was jumped."""
    cfg, k = st.cfg, st.cfg.block_size
    blk = jump_forward(st) if k == 1 and cfg.jump_forward else None
    if blk is not None:
        return blk, True
    drafts = ar_drafts(st) if cfg.draft is not None else None  # lossless: AR only (config.check)
    mask_id = cfg.mask_token_id if k > 1 else cfg.pad_token_id
    assert mask_id is not None
    blk = Block.empty(len(st.active), k + max(map(len, drafts or []), default=0), mask_id)
    if k == 1 or not cfg.fused:  # the clean part's forward alone gives the first token
        first_token(st, blk, drafts)
    if k > 1:
        run_block(st, blk, min(k, st.budget(0)))  # the rows of a block have one budget
    return blk, False


def _decode_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    cfg: DecodeConfig,
    gen: torch.Generator,
    constraints: Sequence[TokenConstraint | None] | None = None,
    drafter: PreTrainedModel | None = None,
) -> list[DecodeOutput]:
    """Decode one batch of prompts (each with its own constraint when given); outputs in order."""
    st = Batch.start(model, prompts, cfg, gen, constraints, drafter)
    while True:
        blk, jumped = _next_block(st)
        keep = st.record_block(blk)
        if not keep:
            break
        # what the cache lacks of each row: a block, or AR's last token (a draft it kept was fed)
        written = torch.tensor(
            [blk.tokens[i][-1:] if cfg.block_size == 1 else blk.tokens[i] for i in keep], device=model.device
        )
        if jumped:  # no row ends on a jumped token: the batch is unchanged, the token waits in `pending`
            assert st.pending is not None and len(keep) == len(st.active)
            st.pending, st.jumped = torch.cat([st.pending, written], 1), st.jumped + 1
            continue
        st.pending = written
        if len(keep) < len(st.active) or not st.runner.slots.in_order:  # finished rows leave the batch
            st.keep(keep)
    return [r.output() for r in st.records]


@torch.inference_mode()
def decode(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    config: DecodeConfig,
    constraints: Sequence[TokenConstraint] | None = None,
    progress: Callable[[int], object] | None = None,
    drafter: PreTrainedModel | None = None,
) -> list[DecodeOutput]:
    """Decode every prompt (token ids) with `model`; one `DecodeOutput` per prompt, in order.

    The one batching layer: prompts are batched `config.batch_size` at a time, longest first (less
    left padding); greedy results do not depend on the batching. `constraints` (one per prompt,
    copied, never mutated) restrict what each row may write (`constrain.py`). `progress` is called
    with the number of prompts of each batch once it is decoded (a progress bar's `update`).
    `drafter`: the block-diffusion model that writes the drafts of `config.draft == "model"`
    (`drafters.py`).
    """
    check(config, len(prompts), None if constraints is None else len(constraints), drafter)
    gen = torch.Generator(device=model.device).manual_seed(config.seed)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    batches = [order[start : start + config.batch_size] for start in range(0, len(order), config.batch_size)]
    # Sampling draws from one generator across the batches: shared, it would draw other numbers.
    shards = None if config.do_sample else active_shards()
    outputs: list[DecodeOutput | None] = [None] * len(prompts)
    for b, chunk in enumerate(batches):
        if shards is not None and not shards.owns(b):
            continue
        rows = None if constraints is None else [constraints[i].copy() for i in chunk]
        decoded = _decode_batch(model, [list(prompts[i]) for i in chunk], config, gen, rows, drafter)
        for i, out in zip(chunk, decoded, strict=True):
            outputs[i] = out
        if progress is not None:
            progress(len(chunk))
    if shards is not None:  # every process gets every output, in prompt order
        mine = {i: out for i, out in enumerate(outputs) if out is not None}
        for theirs in shards.gather(mine):
            for i, out in theirs.items():
                outputs[i] = out
    logger.debug("decoded %d prompts with block size %d", len(prompts), config.block_size)
    return outputs  # type: ignore[return-value]
