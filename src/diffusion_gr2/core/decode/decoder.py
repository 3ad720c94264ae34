"""One decoder for AR (block size 1) and block diffusion (block size k) -- DESIGN §8.

Fast-dLLM v2 style with an exact KV cache that only ever holds clean tokens (the prompt and finished
blocks). Every forward is `[clean tokens not cached yet | canvas of the current block]`
(`_CachedRunner.forward`): the clean part's keys/values enter the cache, its last logit gives the
block's first token, and the canvas's logits (token shift: position i-1 predicts token i) give the
rest; the canvas's keys/values are dropped again. Each forward commits masked positions by the commit
rule (below); after `max_steps_per_block` forwards the rest is filled.

* `fused` (default): a finished block rides along in the next block's first forward, so a block
  costs no forward of its own; that canvas is all masks (its first token is being computed in the
  same forward), which CFT trains on (`losses.cft_noise` masks a block's first position too). The
  prompt rides with block 0 the same way. `fused=False` runs each finished block alone first (one
  extra forward per block), then denoises with the first token known.
* `window` (None = the whole block): each row feeds only its canvas up to its leftmost masked position
  plus `window` masked positions; the others are not computed at all (what the `prefix` rule can
  reach in one forward is what matters). A row's unfed positions are keys nobody attends to, so rows
  never depend on their batch neighbours. The step cap feeds the whole block.

Block size 1 is plain greedy/sampled AR decoding with a KV cache, one forward per token.

The model's forward (`DecodeConfig.backend`): `lean` (`core/model/lean.py`, the same arithmetic as
the transformers modules in a few tensor ops; the default model's step is bound by operator dispatch,
so this roughly halves it), `eager` (the modules themselves, the reference) or `auto` (default: lean
where it covers the model). AR and diffusion share it, so their ratio stays honest. Between forwards
the block's state lives in host lists (`_Block`): a step reads its chosen tokens once and decides
commits in Python, cheaper on a small model than the ~40 tiny tensor ops it replaced.

Commit rules (`DecodeConfig.commit_rule`), each step, among the block's masked positions:
* `confident` (Fast-dLLM v2): every position above tau, plus the most confident one.
* `leftmost`: every position above tau, plus the leftmost one.
* `prefix` (default): the leftmost one, plus the unbroken run right after it that is above tau, so a
  block is written left to right, several tokens per forward where the model is sure. On our
  AR-converted models this kept far more outputs valid at the same tau and about the same tokens per
  forward (cft, tau 0.9, 151 test requests: 35.8% valid, 1.43 tokens/forward, against 6.6% and 1.48
  for `confident`): a confident token far right of the written text is where parallel decoding breaks.

SID threshold (`DecodeConfig.sid_threshold`, any rule): a position whose chosen token is a SID code
joins a step's parallel commits only above this higher tau; the explanation's free text keeps `tau`.
Free answers break at SID codes (rl, tau 0.9, 320 validation requests: all 144 invalid answers first
left the grammar inside the recommendations, as a foreign or repeated ID), so a strict tau there
buys validity at little speed (docs/experiments.md#sid-threshold). With `sid_after` (the ranking
list's key) it holds in the ranking list only and the explanation's cited SIDs keep `tau`: more tokens
per forward, fewer answers the model's own (docs/experiments.md#sid-threshold-scope).

Constraints (`decode(..., constraints=...)`, one `TokenConstraint` per prompt, e.g. the answer
grammar of `grammar.py`): a token is only committed when its row's constraint allows it. The model's
own probability decides how many tokens a step commits: a disallowed choice (the arg-max, or the
sample) is replaced by the best allowed token (or a sample among them) where a commit is due (the
leftmost masked position, the step cap, AR), and ends the step's run anywhere else.
`DecodeOutput.forced` counts every such override: a replaced token, and a run ended at a disallowed
choice (nothing is committed there; when the position comes due it may be counted again), so
without jump-forward `forced == 0` means token for token the unconstrained decode
(`test_accepts_is_what_constrained_decoding_leaves_untouched`). Needs the `prefix` rule: only there
is every committed token's left context committed, which is what the constraint reads.

Jump-forward (`DecodeConfig.jump_forward`, the default; SGLang's name for it): where the constraint
leaves exactly one token (`TokenConstraint.only`: the rest of a SID once its first tokens pin it,
the last candidate, the end token), that token is written without the model's say, at log-prob 0
(certain under the constrained distribution the answer is served from).
* AR: when every row of the batch has a forced next token, it is written without a forward and fed
  with the next forward (several clean tokens, causal among themselves). That forward also computes
  the logits that would have predicted the jumped tokens, and counts a correction wherever the model
  would have written another one: tokens, log-probs and `forced` are exactly those of one forward per
  token (`test_ar_jump_forward_is_exact`); only the forwards are fewer.
* Diffusion: a forced position joins the step's run as certain, so a run goes on through the rest of
  a SID it has begun. A correction is counted at every jumped position where the model's own choice
  differs, whatever its confidence there (below tau, or not due, included). The run differs from the
  one without it, so here `forced == 0` means "every committed token was the model's own choice at
  its commit and no run was ended", not "token for token the unconstrained decode"; without
  jump-forward (and always for AR) it means the latter.

Drafts (`DecodeConfig.draft`, AR only; "prompt" = prompt lookup, `draft.py`), lossless: before a
forward each row drafts up to `draft_tokens` next tokens where its last tokens match its prompt or
its answer so far; the tokens the constraint forces join the draft as they are, and a draft token
the constraint forbids ends the draft there. The draft rides after the clean part of that forward
(`[last token | draft]`, causal), so one forward gives the model's token at every draft position;
each row keeps the longest prefix of its draft the model agrees with plus the model's own next
token, walked through the constraint exactly as one forward per token would walk it. Tokens,
log-probs and `forced` are those of plain AR decoding (`test_prompt_lookup_is_exact`); only the
forwards are fewer. Keys of rejected draft tokens leave the cache (`reject`): the columns no row kept
are cropped, and a row that kept fewer than its neighbours keeps holes there, keys nobody attends to,
with its later positions moved back (the layout has room for them; drafts shrink when it runs out).
* `draft: model` (DFlash's shape, a block-diffusion drafter for an AR target): the drafter, e.g. `rl`
  for `ar_rl`, keeps an exact cache of its own (`_ModelDrafter`) holding the request's clean tokens,
  causal (a layout of block size 1: what was written is text, whatever its blocks were). Before a
  verifying forward it runs once: the tokens written since its last forward, then a canvas of
  `draft_tokens` masks that sees them all and itself (one block); column 0 of the logits (the last
  written token's) and the token shift give one arg-max token per canvas position, the draft. The
  canvas leaves its cache again. Rows of a batch that wrote fewer tokens than the most are padded
  with holes, as above. The verifier is unchanged, so the output is the target's own greedy decode
  (`test_model_drafts_are_exact`), whatever the drafter proposes; `nfe` counts the target's forwards.

State: one batch's decoding is one `_Batch` (runner, config, generator, end ids, each row's
constraint, budget, prompt lookup and record); a step's choices are one `_Step`.

Batching: `decode` sorts prompts longest first and decodes them `batch_size` at a time (the one
batching layer; `progress` hears of each batch). Prompts are left-padded (with matching position ids
and masks) and all rows of a batch decode the same block together. A row that finished its block
waits for the others and is not computed meanwhile: the rows still unmasking are swapped into the
runner's first rows (`_Slots`), so a forward feeds a slice of the cache (a view) rather than a
gathered copy. At batch 16 this cut the rows fed by 26-40% (rl, tau 0.9-0.4, validation). Rows that
reached the end of output leave the batch. `commit_steps` record the forward of its block that
committed each token (0 = before the block's first forward, only with `fused=False`; `replay.py`
rebuilds every canvas from it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.draft import PromptLookup
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.decode.kv_cache import buffer_cache
from diffusion_gr2.core.model.diffusion import cached_block_hidden, layout_hidden, lm_logits
from diffusion_gr2.core.model.lean import LeanForward, lean_unsupported
from diffusion_gr2.core.model.masks import (
    Layout,
    prompt_response_layout,
)

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

COMMIT_RULES = ("prefix", "confident", "leftmost")
BACKENDS = ("auto", "lean", "eager")
DRAFTS = (None, "prompt", "model")


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode; the defaults are greedy AR decoding."""

    block_size: int = 1  # k; 1 = autoregressive
    threshold: float = 0.9  # tau: commit masked positions whose probability exceeds it (Fast-dLLM v2)
    commit_rule: str = "prefix"  # which masked positions a step commits: see COMMIT_RULES / the module doc
    max_new_tokens: int = 256  # per row, end-of-output token included
    max_steps_per_block: int | None = None  # None -> block_size (k - 1 steps always suffice)
    do_sample: bool = False  # False = arg-max
    temperature: float = 1.0  # only when sampling
    eos_token_ids: tuple[int, ...] = ()  # end-of-output tokens (`<|im_end|>`)
    mask_token_id: int | None = None  # required for block_size > 1
    pad_token_id: int = 0  # left padding of prompts (never attended to)
    batch_size: int = 16  # rows decoded together
    seed: int = 0  # sampling generator
    recompute: bool = False  # debugging: no KV cache, re-run the whole sequence at every step
    # A finished block's keys/values are written in the same forward as the next block's first step
    # (its canvas then still has position 0 masked); False = one extra forward per block for it.
    fused: bool = True
    # Masked positions of a block each step feeds, from the leftmost masked one (None = the whole
    # block): positions right of the window are not computed at all (module doc).
    window: int | None = None
    # The model's forward: "lean" (core/model/lean.py: the same arithmetic in a few tensor ops, ~2x
    # faster a step on the default model; Qwen3 only), "eager" (the transformers modules, the
    # reference) or "auto" (lean where it covers the model, e.g. not the pretrained SmolLM2).
    backend: str = "auto"
    # Jump-forward (constrained decoding only): a position the constraint leaves one token is written
    # without the model's say. Diffusion: such positions join the step's run as certain. AR: when
    # every row's next token is forced, it is written without a forward and fed with the next one.
    jump_forward: bool = True
    # Drafts verified in one forward (AR only, greedy): "prompt" = prompt lookup, "model" = a
    # block-diffusion drafter (`decode(..., drafter=...)`) writes them in one forward of its own (module
    # doc); None = one forward per token. Lossless: the tokens are those of plain decoding, only the
    # forwards fewer.
    draft: str | None = None
    # Draft tokens fed per forward at most (transformers' prompt_lookup_num_tokens; for "model" the
    # drafter's canvas, at most its block size). 3: on ar_rl (20 test prompts, batch 1) a fourth
    # prompt-lookup token was kept in 2% (free) / 6% (grammar) of the drafts that had one, and a CPU
    # forward's cost grows with its width (4 tokens ~1.3x one, 11 ~2x).
    draft_tokens: int = 3
    # Block diffusion: a position whose chosen token is a SID code (`sid_token_ids`) commits only above
    # this tau instead (None = `threshold` everywhere). SID codes are where parallel commits break an
    # answer (a foreign or repeated ID); the free text around them is safe at a lower tau.
    sid_threshold: float | None = None
    sid_token_ids: frozenset[int] = frozenset()
    # The SID threshold holds only after this token sequence (the ranking list's key,
    # `grammar.list_key_ids`): the explanation's cited SIDs keep `threshold`. Empty = everywhere.
    sid_after: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecodeOutput:
    """One decoded row. Lists are aligned with `tokens`, which end with (and include) the eos token."""

    tokens: list[int]
    commit_steps: list[int]  # step inside its block (block's first token = 0, first forward = 1, ...)
    nfe: int  # forward passes this row needed (prefill included)
    token_logprobs: list[float]  # log-prob under the distribution the token was committed from
    # Canvas of the final block after the last output token (MASK where never committed) and its
    # commit steps (-1 = never). Tokens committed there were visible to later commits; replay needs them.
    tail_tokens: list[int] = field(default_factory=list)
    tail_steps: list[int] = field(default_factory=list)
    # Overrides by the constraint: tokens replaced or jumped where the model chose another, and runs
    # ended at a disallowed choice. 0 = the unconstrained output token for token, except diffusion
    # with jump-forward (there: only the model's own choices committed; module doc)
    forced: int = 0


def _transposition(n: int, i: int, j: int, device: torch.device) -> Tensor:
    """The permutation of `n` rows that swaps rows i and j."""
    perm = torch.arange(n, device=device)
    perm[i], perm[j] = j, i
    return perm


class _Slots:
    """Which batch row each slot of a runner's batch holds (its cache rows, layout rows).

    A forward feeds only the rows that still need one, and those must be the runner's first rows:
    a slice of the cache is a view, a gather would copy all of it on every step. Rows are moved
    there by swapping two slots, which is cheap, when a row drops out (its block is done).
    """

    def __init__(self, n: int, swap: Callable[[int, int], None]) -> None:
        self.order = list(range(n))  # batch row held by each slot
        self._swap = swap

    def take_part(self, need: Sequence[bool]) -> list[int]:
        """Put the batch rows with `need[row]` in the first slots; returns them, in slot order.

        Rows that drop out of a block never come back before its end, so the rows taking part
        are always within the previous forward's slots and few swaps are needed.
        """
        lo, hi = 0, len(self.order) - 1
        while lo <= hi:
            if need[self.order[lo]]:
                lo += 1
            elif not need[self.order[hi]]:
                hi -= 1
            else:
                self._swap(lo, hi)
                self.order[lo], self.order[hi] = self.order[hi], self.order[lo]
        return self.order[:lo]

    def of(self, rows: Sequence[int]) -> list[int]:
        """The slots holding batch rows `rows`."""
        where = {row: slot for slot, row in enumerate(self.order)}
        return [where[row] for row in rows]

    @property
    def in_order(self) -> bool:
        return all(row == slot for slot, row in enumerate(self.order))


class _CachedRunner:
    """Forwards against an exact KV cache that holds the prompt and the committed (clean) blocks.

    One primitive, `forward(clean, canvas)`: the clean tokens not yet cached (the prompt, or a
    finished block) and a noisy canvas of the next block run in one forward. The clean part's
    keys/values enter the cache; the canvas's are dropped again, so the cache stays exact.
    """

    def __init__(self, model: PreTrainedModel, layout: Layout, lean: LeanForward | None = None) -> None:
        self.model, self.layout, self.lean = model, layout, lean
        self.cache = buffer_cache(model, layout.length)
        self.n = 0  # columns held by the cache
        self.slots = _Slots(layout.block.shape[0], self._swap)

    def _swap(self, i: int, j: int) -> None:
        for layer in self.cache.layers:
            layer.swap_rows(i, j)
        self.layout = self.layout.rows(
            _transposition(self.layout.block.shape[0], i, j, self.layout.block.device)
        )

    def forward(
        self,
        clean: Tensor | None,
        canvas: Tensor | None,
        canvas_valid: Tensor | None,
        lo: int = 0,
        checked: int = 0,
        order: bool = False,
    ) -> Tensor:
        """Logits `[b, m, v]` of the block's tokens `lo .. q - 1` (q = canvas length; m >= 1).

        With `clean` ([b, c]) lo must be 0: column 0 comes from the clean part's last position (the
        block's first token), column j >= 1 from canvas position j - 1 (the token shift). Without it
        lo >= 1: tokens before `lo` are committed in every row, so their logits are not computed
        (the LM head is a large share of a small model's step). `canvas_valid`
        [b, q] marks the canvas positions each row really feeds (its window); the others are keys
        nobody attends to, so a row's result never depends on its batch neighbours' windows.
        `checked` (clean part alone): also the logits that predicted the clean part's last `checked`
        tokens, first (AR: jump-forward checks what the model would have written there, and a
        draft's tokens are verified by the logits that predicted them). `order`: the canvas's block
        ids differ (copy drafts, `_draft_order`), so its mask must read them.
        """
        c = 0 if clean is None else clean.shape[1]
        q = 0 if canvas is None else canvas.shape[1]
        ids = canvas if clean is None else clean if canvas is None else torch.cat([clean, canvas], 1)
        end = self.n + c + q
        lay = self.layout.head(end, rows=ids.shape[0])  # the rows taking part hold the first slots
        if canvas_valid is not None:
            lay = replace(lay, valid=torch.cat([lay.valid[:, : self.n + c], canvas_valid], 1))
        # The prompt needs the predicate's mask (causal, padded queries); a clean block beside a canvas
        # (it must not see it) and several clean tokens (AR jump-forward: causal) need block order;
        # anything else sees every valid key: a broadcast row.
        full_mask, block_order = self.n == 0, order or c > 1 or (c > 0 and q > 0)
        hidden = cached_block_hidden(
            self.model, ids, lay, self.cache, full_mask=full_mask, lean=self.lean, block_order=block_order
        )
        if q:
            self.cache.crop(-q)  # negative = number of tokens to drop (transformers 5)
        self.n += c
        cols = slice(c - 1 - checked, c + q - 1 if q else c) if c else slice(lo - 1, q - 1)
        return lm_logits(self.model, hidden[:, cols])

    def keep(self, rows: Sequence[int]) -> None:
        """Keep batch rows `rows` only, in that order (the slots are back in row order)."""
        index = torch.tensor(self.slots.of(rows), device=self.layout.block.device)
        self.cache.batch_select_indices(index)
        self.layout = self.layout.rows(index)
        self.slots = _Slots(len(rows), self._swap)

    def reject(self, kept: Sequence[int], fed: int) -> None:
        """Of the last forward's last `fed` clean columns (a draft), batch row i keeps the first `kept[i]`.

        Columns no row kept are cropped off the cache; a row that kept fewer than the most leaves
        holes (`_with_holes`).
        """
        top = max(kept)
        if top < fed:
            self.cache.crop(top - fed)  # negative = number of tokens to drop (transformers 5)
            self.n -= fed - top
        self.layout = _with_holes(self.layout, self.n, _per_slot(self.slots, [top - k for k in kept]))


class _RecomputeRunner:
    """Debugging twin of `_CachedRunner`: no cache, the whole sequence is re-run with the full mask."""

    def __init__(self, model: PreTrainedModel, layout: Layout) -> None:
        self.model, self.layout = model, layout
        self.seq: Tensor | None = None  # every clean token so far
        self.slots = _Slots(layout.block.shape[0], self._swap)

    def _swap(self, i: int, j: int) -> None:
        perm = _transposition(self.layout.block.shape[0], i, j, self.layout.block.device)
        assert self.seq is not None
        self.seq, self.layout = self.seq[perm], self.layout.rows(perm)

    def forward(
        self,
        clean: Tensor | None,
        canvas: Tensor | None,
        canvas_valid: Tensor | None,
        lo: int = 0,
        checked: int = 0,
        order: bool = False,  # the predicate's mask reads block ids anyway
    ) -> Tensor:
        if clean is not None:
            self.seq = clean if self.seq is None else torch.cat([self.seq, clean], 1)
        assert self.seq is not None, "the first forward carries the prompt"
        rows = (clean if canvas is None else canvas).shape[0]
        n, q = self.seq.shape[1], 0 if canvas is None else canvas.shape[1]
        lay = self.layout.head(n + q, rows=rows)
        if canvas_valid is not None:
            lay = replace(lay, valid=torch.cat([lay.valid[:, :n], canvas_valid], 1))
        seq = self.seq[:rows]
        ids = seq if canvas is None else torch.cat([seq, canvas], 1)
        hidden = layout_hidden(self.model, ids, lay)
        cols = (
            slice(n - 1 - checked, n + q - 1 if q else n)
            if clean is not None
            else slice(n + lo - 1, n + q - 1)
        )
        return lm_logits(self.model, hidden[:, cols])

    def keep(self, rows: Sequence[int]) -> None:
        assert self.seq is not None
        index = torch.tensor(self.slots.of(rows), device=self.seq.device)
        self.seq, self.layout = self.seq[index], self.layout.rows(index)
        self.slots = _Slots(len(rows), self._swap)

    @property
    def n(self) -> int:
        """Clean columns so far (the cached runner's cache length)."""
        return 0 if self.seq is None else self.seq.shape[1]

    def reject(self, kept: Sequence[int], fed: int) -> None:
        """`_CachedRunner.reject`: the columns no row kept leave the sequence, the others are holes."""
        assert self.seq is not None
        top = max(kept)
        self.seq = self.seq[:, : self.n - (fed - top)]
        self.layout = _with_holes(self.layout, self.n, _per_slot(self.slots, [top - k for k in kept]))


def _per_slot(slots: _Slots, values: Sequence[int]) -> list[int]:
    """`values` of batch rows 0, 1, ... rearranged into the order of the slots that hold them."""
    out = [0] * len(values)
    for slot, value in zip(slots.of(range(len(values))), values, strict=True):
        out[slot] = value
    return out


def _with_holes(layout: Layout, end: int, holes: Sequence[int]) -> Layout:
    """`layout` with the `holes[s]` columns before column `end` of slot s invalid (keys nobody
    attends to: rejected draft tokens) and the positions of its later columns moved back as many.

    Later tokens then sit at the RoPE positions plain decoding gives them, and attend to the same
    keys: the holes change no logit (masked keys weigh exactly zero).
    """
    if not any(holes):
        return layout
    dev = layout.valid.device
    h = torch.tensor(holes, device=dev)[:, None]  # [b, 1]
    col = torch.arange(layout.length, device=dev)  # [l]
    hole = (col >= end - h) & (col < end)  # [b, l]
    return replace(
        layout, valid=layout.valid & ~hole, position=layout.position - torch.where(col >= end, h, 0)
    )


class _LookupDrafter:
    """Draft "prompt": each prompt's n-gram index (`draft.py`), extended as its answer is written."""

    def __init__(self, prompts: Sequence[Sequence[int]]) -> None:
        self.lookups = [PromptLookup(p) for p in prompts]

    def propose(self, active: Sequence[int]) -> None:
        """Nothing to run ahead of the drafts: a lookup is a few dict reads (`draft`)."""

    def draft(self, row: int, prompt: int, extra: Sequence[int], m: int) -> list[int]:
        """Up to `m` tokens after the answer so far plus `extra` (the draft being built)."""
        return self.lookups[prompt].draft(extra, m)

    def extend(self, prompt: int, tokens: Sequence[int]) -> None:
        self.lookups[prompt].extend(tokens)

    def keep(self, rows: Sequence[int]) -> None:
        """Indexed by prompt: finished rows need no bookkeeping."""


class _ModelDrafter:
    """Draft "model": a block-diffusion model proposes each row's next `draft_tokens` in one forward.

    Its own exact cache holds every row's clean tokens, causal (module doc, drafts); `propose` feeds
    what was written since its last forward (the prompt, first) with a canvas of masks after it and
    keeps the canvas's arg-max tokens as the rows' proposals; `draft` hands them out. A batch's rows
    are its runner's rows in `_Batch.active` order (`keep` drops finished ones alongside the target's).
    When its layout runs out of columns (holes use them up) it proposes nothing for the rest of the
    batch: decoding goes on one token a forward.
    """

    def __init__(self, model: PreTrainedModel, ids: Tensor, valid: Tensor, cfg: DecodeConfig) -> None:
        b, self.m = ids.shape[0], cfg.draft_tokens
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else model.config.mask_token_id
        self.mask_id, self.pad_id = int(mask_id), cfg.pad_token_id
        width = (cfg.max_new_tokens + self.m) * (1 if b == 1 else 2)  # batch 1 never leaves holes
        resp = torch.ones(b, width, dtype=torch.bool, device=ids.device)
        layout = prompt_response_layout(valid, resp, 1)
        self.runner = _CachedRunner(model, layout, _lean_forward(model, cfg.backend, layout.length))
        self.prompt: Tensor | None = ids  # fed with the first canvas
        self.written: dict[int, list[int]] = {}  # by prompt: tokens written, not fed yet
        self.proposals: list[list[int]] = [[] for _ in range(b)]
        self.spent = False  # out of columns

    def propose(self, active: Sequence[int]) -> None:
        """One drafter forward: each row's unfed tokens (right-padded with holes), then the canvas."""
        runner, m = self.runner, self.m
        if self.prompt is not None:
            clean, self.prompt = self.prompt, None
            last = [clean.shape[1] - 1] * clean.shape[0]  # left-padded: every row ends in the last column
        else:
            new = [self.written.pop(r, []) for r in active]
            c = max(map(len, new))
            if self.spent or runner.n + c + m > runner.layout.length:
                self.spent, self.proposals = True, [[] for _ in active]
                return
            clean = torch.tensor(
                [[*x, *[self.pad_id] * (c - len(x))] for x in new], device=runner.model.device
            )
            runner.layout = _with_holes(runner.layout, runner.n + c, [c - len(x) for x in new])
            last = [len(x) - 1 for x in new]
        c, start, first = clean.shape[1], runner.n + clean.shape[1], min(last)
        # the canvas is one block: its columns share the id of its last one (block order, masks.py)
        causal = runner.layout
        block = causal.block.clone()
        block[:, start : start + m] = causal.block[:, start + m - 1 : start + m]
        runner.layout = replace(causal, block=block)
        canvas = torch.full((clean.shape[0], m), self.mask_id, device=clean.device)
        # columns: clean `first` .. c - 1 (each row's first draft token is its last written one's
        # logit), then canvas 0 .. m - 2 (the token shift)
        logits = runner.forward(clean, canvas, None, checked=c - 1 - first)
        runner.layout = causal
        tokens = logits.argmax(-1).tolist()
        shift = c - first
        self.proposals = [
            [row[j - first], *row[shift : shift + m - 1]] for row, j in zip(tokens, last, strict=True)
        ]

    def draft(self, row: int, prompt: int, extra: Sequence[int], m: int) -> list[int]:
        """The rest of batch row `row`'s proposal after `extra`, while `extra` is its beginning."""
        proposal = self.proposals[row]
        if list(proposal[: len(extra)]) != list(extra):  # the draft left it (a forced token)
            return []
        return proposal[len(extra) : len(extra) + m]

    def extend(self, prompt: int, tokens: Sequence[int]) -> None:
        self.written.setdefault(prompt, []).extend(tokens)

    def keep(self, rows: Sequence[int]) -> None:
        self.runner.keep(rows)


def _choose(logits: Tensor, cfg: DecodeConfig, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """Tokens and their log-probs `[...]` from logits `[..., v]` (arg-max, or a seeded sample)."""
    x = logits.float() / cfg.temperature if cfg.do_sample else logits.float()
    logp = torch.log_softmax(x, -1)
    if cfg.do_sample:
        flat = torch.multinomial(logp.exp().reshape(-1, x.shape[-1]), 1, generator=gen)
        tokens = flat.view(x.shape[:-1])
    else:
        tokens = x.argmax(-1)
    return tokens, logp.gather(-1, tokens[..., None]).squeeze(-1)


@dataclass
class _Batch:
    """One batch's decoding: what every step reads, and what its rows have written so far.

    Batch row i holds prompt `active[i]`; `records` and `constraints` are indexed by
    prompt, so a finished row leaves `active` (and the runner) and nothing else moves.
    """

    runner: _CachedRunner | _RecomputeRunner
    cfg: DecodeConfig
    gen: torch.Generator
    eos: frozenset[int]
    records: list[_Record]
    constraints: Sequence[TokenConstraint | None] | None  # this batch's copies, advanced as tokens commit
    drafter: _LookupDrafter | _ModelDrafter | None  # where drafts come from (`cfg.draft`); None = none
    active: list[int]
    pending: Tensor | None  # clean tokens the cache does not hold yet: the prompt, then each block
    jumped: int = 0  # AR: tokens at the end of `pending` written by jump-forward, not by a forward

    @classmethod
    def start(
        cls,
        model: PreTrainedModel,
        prompts: Sequence[Sequence[int]],
        cfg: DecodeConfig,
        gen: torch.Generator,
        constraints: Sequence[TokenConstraint | None] | None,
        drafter: PreTrainedModel | None = None,
    ) -> _Batch:
        """The batch before its first forward: prompts left-padded, the cache empty (`drafter`: the
        model of `cfg.draft == "model"`)."""
        k, dev = cfg.block_size, model.device
        ids, valid = left_pad_prompts(prompts, cfg.pad_token_id, dev)
        # drafts need columns for what they feed, and a batch room for its rows' holes (module doc)
        room = (
            0
            if cfg.draft is None or k > 1
            else cfg.draft_tokens + (cfg.max_new_tokens if len(prompts) > 1 else 0)
        )
        width = math.ceil(cfg.max_new_tokens / k) * k + room
        layout = prompt_response_layout(
            valid, torch.ones(len(prompts), width, dtype=torch.bool, device=dev), k
        )
        runner: _CachedRunner | _RecomputeRunner
        if cfg.recompute:
            runner = _RecomputeRunner(model, layout)
        else:
            runner = _CachedRunner(model, layout, _lean_forward(model, cfg.backend, layout.length))
        return cls(
            runner=runner,
            cfg=cfg,
            gen=gen,
            eos=frozenset(cfg.eos_token_ids),
            records=[_Record() for _ in prompts],
            constraints=constraints,
            drafter=(
                None
                if cfg.draft is None
                else _LookupDrafter(prompts)
                if cfg.draft == "prompt"
                else _ModelDrafter(drafter, ids, valid, cfg)  # type: ignore[arg-type]  # `_check`ed
            ),
            active=list(range(len(prompts))),
            pending=ids,
        )

    def constraint(self, row: int) -> TokenConstraint | None:
        """Batch row `row`'s constraint (None: unconstrained)."""
        return None if self.constraints is None else self.constraints[self.active[row]]

    def written(self, row: int) -> list[int]:
        """The tokens batch row `row` has written so far (its finished blocks)."""
        return self.records[self.active[row]].tokens

    def budget(self, row: int) -> int:
        """Tokens batch row `row` may still write."""
        return self.cfg.max_new_tokens - len(self.written(row))

    def choose(self, logits: Tensor) -> tuple[list[Any], list[Any]]:
        """`_choose` as host lists: tokens and log-probs `[...]` of logits `[..., v]`."""
        tokens, logps = _choose(logits, self.cfg, self.gen)
        return tokens.tolist(), logps.tolist()

    def draft_room(self) -> int:
        """Draft tokens the next forward may feed: the layout's columns left after its clean part,
        less what the row with the most budget may still need (one column a token, its last never
        fed), so that row can always finish one token a forward."""
        assert self.pending is not None
        left = self.runner.layout.length - self.runner.n - self.pending.shape[1]
        most = max(self.budget(i) for i in range(len(self.active)))
        return min(self.cfg.draft_tokens, left - most + 1)


@dataclass
class _Step:
    """One forward's choices for the batch rows `rows` that took part, at block positions lo, lo + 1, ...

    `logits` [r, m, v]; `tokens`/`logps` [r][m] the arg-max (or sample) and its log-prob, which the
    constraint may replace in place; `cands` [r][m] the positions open to commit; `chosen` [r][m]
    those the commit rule picked.
    """

    rows: list[int]
    lo: int
    logits: Tensor
    tokens: list[list[int]]
    logps: list[list[float]]
    cands: list[list[bool]]
    chosen: list[list[bool]]
    must_commit: bool  # every candidate is due (AR, the step cap), not only the run's first
    # a run ends where its token leaves the draft: AR verification, or copy drafts (diffusion: per
    # position of the step, None where nothing was drafted)
    drafts: Sequence[Sequence[int | None]] | None = None


def _agrees(draft: Sequence[int | None], j: int, token: int, eos: frozenset[int]) -> bool:
    """Whether a verified run goes on past position j: the model's token there is the draft's (the
    draft token was fed, so the next logits follow it), and not an end token. Copy drafts (aligned
    to the step's positions) hold None where nothing was drafted: no draft to leave there."""
    return j < len(draft) and draft[j] in (token, None) and token not in eos


def _constrain_commits(st: _Batch, step: _Step) -> tuple[list[list[bool]], list[int]]:
    """Each row's commits under its constraint, and the corrections per row (`step.tokens`/`logps`
    in place).

    `step.chosen` holds the commit rule's picks before its prefix cut for rows with a constraint
    (`_commit_mask(..., cut=False)`; a row without one keeps the rule's run). Under the `prefix`
    rule a row's commits are one run from its first candidate, walked left to right through its
    constraint (`st.budget(row) - lo` = tokens the row may still write at the step's first position):
    * a position the constraint leaves one token (`only`, with `cfg.jump_forward`) joins the run as
      certain (log-prob 0 under the constrained distribution), whatever the model's confidence;
    * any other position joins while the rule chose it. A disallowed token is replaced by the best
      allowed one where a commit is due (the run's first position, or every position when
      `step.must_commit`) and cuts the run elsewhere;
    * with `step.drafts` (AR verification) the run goes on only while the committed token is the
      draft's (`_agrees`).
    A correction is counted wherever the constraint overrides the model's choice: a replaced token,
    a jumped token the model would not have chosen (whatever its confidence), and a disallowed choice
    that ends the run (nothing is committed there). A row with none wrote only its own choices and
    had no run ended. Log-probs become those of the constrained (renormalised) distribution.

    The automaton walk is plain Python per committed token; the tensor work (renormalised log-probs)
    is one batched pass over every constrained commit of the step, however long the runs are.
    """
    cfg, logits, tokens, logps = st.cfg, step.logits, step.tokens, step.logps
    forced = [0] * len(step.rows)
    commits = [[False] * len(row) for row in step.chosen]
    where: list[tuple[int, int]] = []  # constrained commits, and the masks they were checked against
    masks: list[Tensor] = []
    for i, r in enumerate(step.rows):
        constraint, budget = st.constraint(r), st.budget(r) - step.lo
        cand, row, commit, first = step.cands[i], step.chosen[i], commits[i], True
        for j in range(len(cand)):
            if not cand[j]:  # committed before the run, or past the row's window (masked
                if first:  # positions are one suffix of the block, so the run ends there)
                    continue
                break
            due = first or step.must_commit
            if constraint is None:  # nothing to check: the rule's own run (`_commit_mask` cut it)
                commit[:] = row
                break
            only = constraint.only(budget - j) if cfg.jump_forward else None
            if only is not None:  # certain: the one token the constraint allows
                forced[i] += int(tokens[i][j] != only)  # the model's own choice was another token
                tokens[i][j], logps[i][j] = only, 0.0
            else:
                if not (due or row[j]):  # neither chosen nor certain: the run ends here
                    break
                allowed = constraint.allowed(budget - j)
                if allowed is not None:
                    if not bool(allowed[tokens[i][j]]):
                        forced[i] += 1
                        if not due:  # not due here: end the run before it
                            break
                        x = logits[i, j].masked_fill(~allowed.to(logits.device), -math.inf)
                        tokens[i][j] = int(_choose(x, cfg, st.gen)[0])  # the best allowed (or a sample)
                    where.append((i, j))
                    masks.append(allowed)
                # allowed None = any token: nothing to correct, the log-prob stays the model's
            commit[j], first = True, False
            constraint.advance(tokens[i][j])
            if step.drafts is not None and not _agrees(step.drafts[i], j, tokens[i][j], st.eos):
                break
    if where:
        r, c = (torch.tensor(idx, device=logits.device) for idx in zip(*where, strict=True))
        picked = torch.tensor([tokens[i][j] for i, j in where], device=logits.device)
        x = logits[r, c].float() / (cfg.temperature if cfg.do_sample else 1.0)
        x = x.masked_fill(~torch.stack(masks).to(logits.device), -math.inf)  # the constrained distribution
        renormalised = torch.log_softmax(x, -1).gather(1, picked[:, None]).squeeze(1).tolist()
        for (i, j), logp in zip(where, renormalised, strict=True):
            logps[i][j] = logp
    return commits, forced


def _commit_mask(
    cand: list[bool], logp: list[float], threshold: float, fill: bool, rule: str, cut: bool = True
) -> list[bool]:
    """Positions of one row to commit among its masked candidates `cand` under commit rule `rule`.

    Every rule commits at least one position of a row with a candidate (guarantees progress). A
    position is confident when its probability is above `threshold`. `cut=False` skips the `prefix`
    rule's cut to one run (the constrained walk, `_constrain_commits`, makes its own run).
    """
    if fill or not any(cand):  # step cap reached: fill every remaining position
        return list(cand)
    # the extra position: the most confident candidate (first of equals), or the leftmost one
    cands = [j for j, c in enumerate(cand) if c]
    extra = max(cands, key=lambda j: logp[j]) if rule == "confident" else cands[0]
    log_tau = math.log(threshold) if threshold > 0 else -math.inf
    chosen = [c and (logp[j] > log_tau or j == extra) for j, c in enumerate(cand)]
    if rule == "prefix" and cut:  # only the unbroken run of chosen positions from the leftmost masked one
        run = True
        for j, c in enumerate(cand):
            run = run and (chosen[j] or not c)  # committed positions do not break the run
            chosen[j] = chosen[j] and run
    return chosen


def _sid_gated(
    conf: list[float], tokens: Sequence[int], threshold: float, sid_ids: frozenset[int], start: int = 0
) -> list[float]:
    """`conf` with every SID-code choice from index `start` on not above `threshold` made unconfident
    (it then commits only where a commit is due: the leftmost masked position, or the step cap)."""
    log_tau = math.log(threshold) if threshold > 0 else -math.inf
    return [
        -math.inf if j >= start and t in sid_ids and c <= log_tau else c
        for j, (c, t) in enumerate(zip(conf, tokens, strict=True))
    ]


def _gate_start(st: _Batch, blk: _Block, row: int, lo: int, chosen: Sequence[int]) -> int:
    """Index into this forward's positions `lo ..` of batch row `row` from which the SID threshold
    holds: 0 without `cfg.sid_after`; else the first position after that sequence ends in the row's
    text (its answer so far, the block's committed tokens, then this forward's choices), and none
    (`len(chosen)`) where it has not been written."""
    marker = st.cfg.sid_after
    if not marker:
        return 0
    hi = lo + len(chosen)
    ahead = [
        c if m else t for t, m, c in zip(blk.tokens[row][lo:hi], blk.masked[row][lo:hi], chosen, strict=True)
    ]
    text = [*st.written(row), *blk.tokens[row][:lo], *ahead]
    end = _find_end(text, marker)
    return len(chosen) if end is None else max(0, end - (len(text) - len(ahead)))


def _find_end(seq: list[int], marker: Sequence[int]) -> int | None:
    """Index just after the first occurrence of `marker` in `seq` (None = it does not occur)."""
    n, i, want = len(marker), -1, list(marker)
    while True:
        try:
            i = seq.index(want[0], i + 1)  # the scan runs in C: a decode step calls this per row
        except ValueError:
            return None
        if seq[i : i + n] == want:
            return i + n


def _needs_step(tokens: list[int], masked: list[bool], limit: int, eos: frozenset[int]) -> bool:
    """Whether a row's block has a masked position that can still reach the output.

    Positions count up to `limit` and up to the first committed eos (anything after it is cut).
    """
    for j in range(limit):
        if masked[j]:
            return True
        if tokens[j] in eos:
            return False
    return False


@dataclass
class _Block:
    """Canvas of the current block for every active row, with its commit record; all `[b][k]` lists.

    Host lists, not tensors: a step touches a few positions of a few rows, and on the CPU each tensor
    op costs more than the Python it replaces (about 40 small ops a step, ~15% of a batch-1 step).
    """

    tokens: list[list[int]]
    steps: list[list[int]]  # forward of the block that committed the position (0 = before it), -1 = masked
    logps: list[list[float]]
    masked: list[list[bool]]
    nfe: list[int]  # forwards each row took part in
    forced: list[int]  # the constraint's overrides so far (`DecodeOutput.forced`)

    @classmethod
    def empty(cls, b: int, k: int, mask_id: int) -> _Block:
        return cls(
            [[mask_id] * k for _ in range(b)],
            [[-1] * k for _ in range(b)],
            [[0.0] * k for _ in range(b)],
            [[True] * k for _ in range(b)],
            [0] * b,
            [0] * b,
        )

    def trim(self, row: int, n: int) -> None:
        """Keep the first `n` positions of batch row `row` (an AR row's verified run, `_first_token`)."""
        for lists in (self.tokens, self.steps, self.logps, self.masked):
            del lists[row][n:]

    def apply(
        self, row: int, commit: list[bool], tokens: list[int], logps: list[float], step: int, lo: int
    ) -> None:
        """Commit positions `lo + j` of batch row `row` where `commit[j]` is set."""
        for j, due in enumerate(commit):
            if due:
                self.tokens[row][lo + j], self.logps[row][lo + j] = tokens[j], logps[j]
                self.steps[row][lo + j], self.masked[row][lo + j] = step, False


def leftmost_masked(masked: Tensor) -> Tensor:
    """[...] index of the leftmost masked position along the last dim of `masked` [..., k] (k if none)."""
    return torch.where(masked.any(-1), masked.long().argmax(-1), masked.shape[-1])


def fed_width(leftmost: Tensor | int, k: int, window: int | None) -> Tensor | int:
    """Canvas positions fed: up to the leftmost masked one plus `window` (all k if None).

    The one window rule: the decoder applies it per row (ints), replay rebuilds the canvases from it
    (tensors `[...]`).
    """
    if isinstance(leftmost, Tensor):
        return torch.full_like(leftmost, k) if window is None else (leftmost + window).clamp(max=k)
    return k if window is None else min(leftmost + window, k)


def _run_block(st: _Batch, blk: _Block, limit: int) -> None:
    """Unmask `blk` forward by forward; rows whose relevant positions are all committed stop taking part.

    `st.pending` (clean tokens not in the cache yet) rides along in the first forward, whose column
    0 is the block's first token. `limit`: positions of the block that can reach the output.
    """
    cfg, runner = st.cfg, st.runner
    k = len(blk.tokens[0])
    max_steps = cfg.max_steps_per_block or k
    dev = runner.layout.block.device
    for step in range(1, max_steps + 1):
        # the first forward also writes the clean part: every row takes part in it
        need = [
            st.pending is not None or _needs_step(t, m, limit, st.eos)
            for t, m in zip(blk.tokens, blk.masked, strict=True)
        ]
        if not any(need):
            return
        fill = step == max_steps  # the cap: every remaining position is filled, so the whole block is fed
        rows = runner.slots.take_part(need)  # rows done with this block are not computed
        leftmost = [next((j for j, m in enumerate(blk.masked[r]) if m), k) for r in rows]
        fed = [int(fed_width(left, k, None if fill else cfg.window)) for left in leftmost]
        # q: the widest canvas fed; lo: the first position still masked in any row fed (everything
        # left of it is committed in every row, so its logits are not computed)
        q = max(fed)
        lo = 0 if st.pending is not None else max(1, min(min(leftmost), q - 1))
        canvas_rows = [blk.tokens[r][:q] for r in rows]
        copies = None if st.drafter is None or fill else _copy_drafts(st, blk, rows, leftmost, fed)
        layout = runner.layout
        if copies is not None:  # drafts are fed as tokens, each seen only by the positions after it
            for row, left, copy in zip(canvas_rows, leftmost, copies, strict=True):
                row[left : left + len(copy)] = copy
            runner.layout = _draft_order(
                layout, runner.n + (0 if st.pending is None else st.pending.shape[1]), leftmost, copies, q
            )
        canvas = torch.tensor(canvas_rows, device=dev)
        canvas_valid = torch.tensor([[j < f for j in range(q)] for f in fed], device=dev)
        logits = runner.forward(
            st.pending, canvas, canvas_valid, lo, order=copies is not None
        )  # [rows, m, v]
        runner.layout = layout
        st.pending = None
        tokens, logps = st.choose(logits)
        m = logits.shape[1]
        cands, chosen, drafts = [], [], None if copies is None else []
        for i, r in enumerate(rows):
            cand = [blk.masked[r][j] and j < fed[i] for j in range(lo, lo + m)]
            conf = logps[i]
            if lo == 0:  # column 0, the block's first token, is predicted by the clean part, not the
                # canvas; only this forward predicts it: every rule takes it, as if certain
                cand[0], conf = blk.masked[r][0], [0.0, *conf[1:]]
            cands.append(cand)
            if copies is not None:  # a draft the model's own token agrees with is certain
                aligned = [None] * m
                for t, token in enumerate(copies[i]):
                    aligned[leftmost[i] + t - lo] = token
                conf = [
                    0.0 if d is not None and d == tok else c
                    for d, tok, c in zip(aligned, tokens[i], conf, strict=True)
                ]
                drafts.append(aligned)
            if cfg.sid_threshold is not None:
                start = _gate_start(st, blk, r, lo, tokens[i])
                conf = _sid_gated(conf, tokens[i], cfg.sid_threshold, cfg.sid_token_ids, start)
            # constrained rows make their run in the constraint walk (it may extend it)
            cut = st.constraint(r) is None
            pick = _commit_mask(cand, conf, cfg.threshold, fill, cfg.commit_rule, cut=cut)
            if copies is not None and cut:  # the run ends at a draft it leaves: later logits read it
                pick = _until_disagreement(pick, tokens[i], drafts[-1])
            chosen.append(pick)
        commits = chosen
        if st.constraints is not None:
            commits, fixes = _constrain_commits(
                st, _Step(rows, lo, logits, tokens, logps, cands, chosen, fill, drafts)
            )
            for r, fix in zip(rows, fixes, strict=True):
                blk.forced[r] += fix
        for i, r in enumerate(rows):
            blk.apply(r, commits[i], tokens[i], logps[i], step, lo)
            blk.nfe[r] += 1


def _copy_drafts(
    st: _Batch, blk: _Block, rows: Sequence[int], leftmost: Sequence[int], fed: Sequence[int]
) -> list[list[int]]:
    """Copy drafts (diffusion, draft "prompt"): each row's prompt-lookup continuation of its
    committed text (the answer so far, then the block's committed prefix), for its masked positions
    from the leftmost one, at most `draft_tokens`, within what it feeds."""
    assert st.drafter is not None
    return [
        st.drafter.draft(i, st.active[r], blk.tokens[r][:left], min(st.cfg.draft_tokens, f - left))
        for i, (r, left, f) in enumerate(zip(rows, leftmost, fed, strict=True))
    ]


def _draft_order(
    layout: Layout, start: int, leftmost: Sequence[int], copies: Sequence[Sequence[int]], q: int
) -> Layout:
    """`layout` with the canvas (columns `start .. start + q` of each fed slot) re-blocked for copy
    drafts: the committed prefix keeps the canvas's id, draft t gets id + 1 + t, the masks after
    the drafts id + 1 + n. Under block order the logit that checks draft t (from the position before
    it) then sees the drafts before it, never draft t itself or later ones, nor the masks after
    them (keys that carry no text); the masks after see every draft. A row without drafts keeps one
    block."""
    block = layout.block.clone()
    for slot, (left, copy) in enumerate(zip(leftmost, copies, strict=True)):
        if copy:
            base = block[slot, start]
            n = len(copy)
            block[slot, start + left : start + left + n] = base + 1 + torch.arange(n, device=block.device)
            block[slot, start + left + n : start + q] = base + 1 + n
    return replace(layout, block=block)


def _until_disagreement(pick: list[bool], tokens: Sequence[int], drafts: Sequence[int | None]) -> list[bool]:
    """`pick` cut after the first picked position whose token is not its draft (the logits right of
    it were computed reading that draft)."""
    out = list(pick)
    for j, (p, token, d) in enumerate(zip(pick, tokens, drafts, strict=True)):
        if p and d is not None and d != token:
            out[j + 1 :] = [False] * (len(out) - j - 1)
            break
    return out


def _first_token(st: _Batch, blk: _Block, drafts: list[list[int]] | None = None) -> None:
    """One forward of the clean tokens alone; its last logit is the block's first token (step 0).

    AR decoding is this and nothing else, one forward per token, so it is kept free of the canvas
    bookkeeping of `_run_block`. `st.jumped`: the clean part's last tokens that AR jump-forward wrote
    without a forward (`_jump_forward`); the logits that predict them are computed here too, and
    where the model would have written another token it counts as a correction, exactly as a
    forward per token would have counted it. `drafts` (AR, one per row, `_drafts`): fed after the
    clean part, padded to the longest; the logit after each draft token is the model's token there,
    and a row keeps the run that agrees with its draft (module doc): its row of `blk` (of width
    1 + the longest draft) is cut to the tokens written, and the rest leave the cache.
    """
    d = 0 if drafts is None else max(map(len, drafts), default=0)
    clean, jumped = st.pending, st.jumped
    assert clean is not None
    if d:
        assert drafts is not None
        fill = [[*x, *[st.cfg.pad_token_id] * (d - len(x))] for x in drafts]  # padding: rejected anyway
        clean = torch.cat([clean, torch.tensor(fill, device=clean.device)], 1)
    logits = st.runner.forward(clean, None, None, checked=jumped + d)  # [b, jumped + d + 1, v]
    if jumped:
        would = _choose(logits[:, :jumped], st.cfg, st.gen)[0]
        fixes = (would != st.pending[:, -jumped:]).sum(1).tolist()
        blk.forced = [f + fix for f, fix in zip(blk.forced, fixes, strict=True)]
    st.pending, st.jumped = None, 0
    head = logits[:, jumped:]  # the first token, then the one after each draft token
    tokens, logps = st.choose(head)
    mine = [[] for _ in tokens] if drafts is None else drafts
    cands = [[j <= len(x) for j in range(d + 1)] for x in mine]
    chosen = [[j <= _agreed(t, x, st.eos) for j in range(d + 1)] for t, x in zip(tokens, mine, strict=True)]
    commit = chosen
    if st.constraints is not None:
        step = _Step(list(range(len(tokens))), 0, head, tokens, logps, cands, chosen, True, drafts)
        commit, fixes = _constrain_commits(st, step)
        blk.forced = [f + fix for f, fix in zip(blk.forced, fixes, strict=True)]
    for r in range(len(tokens)):
        blk.apply(r, commit[r], tokens[r], logps[r], 0, 0)
        blk.nfe[r] += 1
    if drafts is not None:
        runs = [sum(c) for c in commit]
        if d:
            st.runner.reject([n - 1 for n in runs], d)  # each row's agreeing draft prefix stays cached
        for r, n in enumerate(runs):
            blk.trim(r, n)


def _agreed(tokens: Sequence[int], draft: Sequence[int], eos: frozenset[int]) -> int:
    """Draft tokens a row without a constraint keeps: its leading run of `_agrees` positions."""
    n = 0
    while _agrees(draft, n, tokens[n], eos):
        n += 1
    return n


def _drafts(st: _Batch) -> list[list[int]]:
    """Each row's draft of its next tokens (prompt lookup), as long as its budget and the layout allow.

    Built token by token through a copy of the row's constraint: a forced token joins the draft as
    it is (it will be accepted), a looked-up token the constraint forbids ends the draft, and so
    does an end token. The continuation of one match is used until it runs out or a forced token
    departs from it; then the lookup runs again on the extended tail.
    """
    assert st.drafter is not None
    st.drafter.propose(st.active)
    room, eos = st.draft_room(), st.eos
    drafts = []
    for i, r in enumerate(st.active):
        budget, original = st.budget(i), st.constraint(i)
        state = None if original is None else original.copy()
        n = min(room, budget - 1)  # the forward writes one token more than the draft
        draft: list[int] = []
        follow: list[int] = []  # the current match's continuation, not used yet
        while len(draft) < n and (not draft or draft[-1] not in eos):
            token = None if state is None else state.only(budget - len(draft))
            if token is None:
                follow = follow or st.drafter.draft(i, r, draft, n - len(draft))
                allowed = None if state is None or not follow else state.allowed(budget - len(draft))
                if not follow or (allowed is not None and not bool(allowed[follow[0]])):
                    break
                token = follow[0]
            follow = follow[1:] if follow and follow[0] == token else []
            draft.append(token)
            if state is not None:
                state.advance(token)
        drafts.append(draft)
    return drafts


def _jump_forward(st: _Batch) -> _Block | None:
    """AR jump-forward: when every row's constraint leaves one next token, its block (no forward).

    The rows of a batch move in step, so one row with a choice to make costs the forward anyway.
    An end token or a row's last allowed token is never jumped: the forward that follows checks
    what the model would have written at jumped positions (`_first_token`), and those rows have none.
    """
    if not st.constraints:
        return None
    rows = range(len(st.active))
    only = [
        None if (c := st.constraint(i)) is None or st.budget(i) <= 1 else c.only(st.budget(i)) for i in rows
    ]
    if any(t is None or t in st.eos for t in only):
        return None
    blk = _Block.empty(len(st.active), 1, st.cfg.pad_token_id)
    for i, token in zip(rows, only, strict=True):
        constraint = st.constraint(i)
        assert constraint is not None and token is not None
        blk.apply(i, [True], [token], [0.0], 0, 0)  # certain under the constrained distribution
        constraint.advance(token)
    return blk


def left_pad_prompts(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """Left-padded ids and validity `[b, p]`: every row's last prompt token sits in the last column."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        valid[i, width - len(p) :] = True
    return ids.to(device), valid.to(device)


@dataclass
class _Record:
    """What one row has produced so far."""

    tokens: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    nfe: int = 0  # forwards, the prefill included
    tail_tokens: list[int] = field(default_factory=list)
    tail_steps: list[int] = field(default_factory=list)
    forced: int = 0

    def add_block(
        self, tokens: list[int], steps: list[int], logps: list[float], limit: int, eos: frozenset[int]
    ) -> bool:
        """Append a finished block, cut after the first eos / at `limit`; True when an eos was hit."""
        cut = next((i for i, t in enumerate(tokens[:limit]) if t in eos), None)
        end = limit if cut is None else cut + 1
        self.tokens += tokens[:end]
        self.steps += steps[:end]
        self.logps += logps[:end]
        self.tail_tokens, self.tail_steps = tokens[end:], steps[end:]
        return cut is not None

    def output(self) -> DecodeOutput:
        return DecodeOutput(
            self.tokens, self.steps, self.nfe, self.logps, self.tail_tokens, self.tail_steps, self.forced
        )


def _record_block(st: _Batch, blk: _Block) -> list[int]:
    """Store each active row's block (cut at its budget and first eos); the rows that continue."""
    keep = []
    for i, r in enumerate(st.active):
        record = st.records[r]
        limit, before = min(len(blk.tokens[i]), st.budget(i)), len(record.tokens)
        record.nfe += blk.nfe[i]
        record.forced += blk.forced[i]
        ended = record.add_block(blk.tokens[i], blk.steps[i], blk.logps[i], limit, st.eos)
        if st.drafter is not None:
            st.drafter.extend(r, record.tokens[before:])
        if not ended and len(record.tokens) < st.cfg.max_new_tokens:
            keep.append(i)
    return keep


def resolved_backend(model: PreTrainedModel, backend: str) -> str:
    """The forward `backend` runs `model` with: "lean" or "eager" ("auto": lean where it covers it)."""
    if backend == "auto":
        return "eager" if lean_unsupported(model) is not None else "lean"
    return backend


def _lean_forward(model: PreTrainedModel, backend: str, positions: int) -> LeanForward | None:
    """The lean forward of `model` when `backend` asks for it (auto: where it covers the model)."""
    if resolved_backend(model, backend) == "eager":
        return None
    return LeanForward(model, positions)  # backend "lean" on a model it does not cover: refused


def _decode_batch(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    cfg: DecodeConfig,
    gen: torch.Generator,
    constraints: Sequence[TokenConstraint | None] | None = None,
    drafter: PreTrainedModel | None = None,
) -> list[DecodeOutput]:
    """Decode one batch of prompts (each with its own constraint when given); outputs in order."""
    st = _Batch.start(model, prompts, cfg, gen, constraints, drafter)
    k = cfg.block_size
    mask_id = cfg.mask_token_id if k > 1 else cfg.pad_token_id
    assert mask_id is not None
    while True:
        blk = _jump_forward(st) if k == 1 and cfg.jump_forward else None
        jump = blk is not None
        if blk is None:
            drafts = _drafts(st) if cfg.draft is not None and k == 1 else None  # diffusion: copy drafts
            blk = _Block.empty(len(st.active), k + max(map(len, drafts or []), default=0), mask_id)
            if k == 1 or not cfg.fused:  # the clean part's forward alone gives the first token
                _first_token(st, blk, drafts)
            if k > 1:
                _run_block(st, blk, min(k, st.budget(0)))  # the rows of a block have one budget
        keep = _record_block(st, blk)
        if not keep:
            break
        # what the cache lacks of each row: a block, or AR's last token (a draft it kept was fed)
        written = torch.tensor(
            [blk.tokens[i][-1:] if k == 1 else blk.tokens[i] for i in keep], device=model.device
        )
        if jump:  # no row ends on a jumped token: the batch is unchanged, the token waits in `pending`
            assert st.pending is not None and len(keep) == len(st.active)
            st.pending, st.jumped = torch.cat([st.pending, written], 1), st.jumped + 1
            continue
        st.pending = written
        if len(keep) < len(st.active) or not st.runner.slots.in_order:  # finished rows leave the batch
            st.runner.keep(keep)
            if st.drafter is not None:
                st.drafter.keep(keep)
            st.active = [st.active[i] for i in keep]
    return [r.output() for r in st.records]


def _check(
    config: DecodeConfig, prompts: int, constraints: int | None, drafter: PreTrainedModel | None = None
) -> None:
    """Refuse a config (or a constraint count, a drafter) the decoder cannot honour, with the reason."""
    if config.block_size > 1 and config.mask_token_id is None:
        raise ValueError("block_size > 1 needs mask_token_id")
    if config.window is not None and config.window < 1:
        raise ValueError(f"window must be >= 1 (or None for the whole block), got {config.window}")
    if config.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {config.backend!r}")
    if config.commit_rule not in COMMIT_RULES:
        raise ValueError(f"commit_rule must be one of {COMMIT_RULES}, got {config.commit_rule!r}")
    if config.draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {config.draft!r}")
    diffusion_copies = config.block_size > 1 and config.draft == "prompt" and config.commit_rule == "prefix"
    if (
        config.draft is not None
        and not diffusion_copies
        and (config.block_size > 1 or config.do_sample or config.draft_tokens < 1)
    ):
        raise ValueError(
            "drafts need AR greedy decoding (block_size 1, do_sample False) and draft_tokens >= 1, or "
            "copy drafts (draft 'prompt') in block diffusion under the prefix rule, got "
            f"block_size {config.block_size}, do_sample {config.do_sample}, draft {config.draft!r}, "
            f"commit_rule {config.commit_rule!r}, draft_tokens {config.draft_tokens}"
        )
    if (config.draft == "model") != (drafter is not None):
        raise ValueError(
            f"a drafter model goes with draft 'model' and only with it, got draft {config.draft!r}"
        )
    if drafter is not None:
        block = getattr(drafter.config, "block_size", None)
        if block is None or (
            config.mask_token_id is None and getattr(drafter.config, "mask_token_id", None) is None
        ):
            raise ValueError(
                "the drafter must be a block-diffusion model (config.block_size and mask_token_id)"
            )
        if config.draft_tokens > int(block):
            raise ValueError(f"draft_tokens {config.draft_tokens} exceeds the drafter's block size {block}")
    if constraints is not None:
        if constraints != prompts:
            raise ValueError(f"{prompts} prompts but {constraints} constraints")
        if config.block_size > 1 and config.commit_rule != "prefix":
            raise ValueError(
                "constrained decoding needs commit_rule='prefix' (a constraint reads the committed "
                f"tokens left of the one it checks), got {config.commit_rule!r}"
            )


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
    copied, never mutated) restrict what each row may write (module doc). `progress` is called with
    the number of prompts of each batch once it is decoded (a progress bar's `update`). `drafter`:
    the block-diffusion model that writes the drafts of `config.draft == "model"` (module doc).
    """
    _check(config, len(prompts), None if constraints is None else len(constraints), drafter)
    gen = torch.Generator(device=model.device).manual_seed(config.seed)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    outputs: list[DecodeOutput | None] = [None] * len(prompts)
    for start in range(0, len(order), config.batch_size):
        chunk = order[start : start + config.batch_size]
        rows = None if constraints is None else [constraints[i].copy() for i in chunk]
        decoded = _decode_batch(model, [list(prompts[i]) for i in chunk], config, gen, rows, drafter)
        for i, out in zip(chunk, decoded, strict=True):
            outputs[i] = out
        if progress is not None:
            progress(len(chunk))
    logger.debug("decoded %d prompts with block size %d", len(prompts), config.block_size)
    return outputs  # type: ignore[return-value]
