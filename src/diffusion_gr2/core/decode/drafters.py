"""Drafts: tokens guessed ahead and checked by the model in the same forward. One protocol
(`Drafter`), three drafters, each with the exactness it promises (`lossless`; `config.check`
admits each only where that promise holds).

* `LookupDrafter` (`DecodeConfig.draft="prompt"`, AR), lossless: prompt lookup (`draft.py`), the
  continuation of the last n-gram's first earlier occurrence in the prompt or the answer so far.
* `ModelDrafter` (`draft="model"`, AR; DFlash's shape), lossless: a block-diffusion model (e.g. `rl`
  for `ar_rl`) writes `draft_tokens` positions in one forward of a canvas of its own.
* `CopyDrafter` (`DecodeConfig.copy_drafts`, block diffusion), LOSSY: prompt lookup's continuations
  of the committed text go into the block's masked positions as tokens
  (docs/experiments.md#copy-drafts).

AR verification (the lossless two): before a forward each row builds its draft through a copy of
its constraint (`verified_drafts`): the tokens the constraint forces join the draft as they are,
and a draft token the constraint forbids ends it. The draft rides after the clean part of that
forward (`[last token | draft]`, causal), so one forward gives the model's token at every draft
position; each row keeps the longest prefix of its draft the model agrees with plus the model's own
next token, walked through the constraint exactly as one forward per token would walk it
(`constrain.py`). Tokens, log-probs and `forced` are those of plain AR decoding
(`test_prompt_lookup_is_exact`, `test_model_drafts_are_exact`); only the forwards are fewer. Keys of
rejected draft tokens leave the cache (`runner.CachedRunner.reject`): the columns no row kept are
cropped, and a row that kept fewer than its neighbours keeps holes there, with its later positions
moved back (the layout has room for them; drafts shrink when it runs out).

Copy drafts are re-blocked so that the logit checking a draft reads the drafts before it and never
itself; a draft the model's own token agrees with is committed as certain, and a run ends where it
leaves a draft: other tokens than plain decoding, hence lossy, chosen on validation like any setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.config import DecodeConfig
from diffusion_gr2.core.decode.draft import PromptLookup
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.decode.runner import CachedRunner, Reblock, lean_forward
from diffusion_gr2.core.model.masks import prompt_response_layout

__all__ = [
    "CopyDrafter",
    "Drafter",
    "LookupDrafter",
    "ModelDrafter",
    "agreed",
    "agrees",
    "drafter_for",
    "verified_drafts",
]


class Drafter(Protocol):
    """Where a batch's drafts come from. Rows are batch rows, prompts index the batch's requests."""

    lossless: ClassVar[bool]  # True: the decode's tokens are plain decoding's, only forwards fewer

    def propose(self, active: Sequence[int]) -> None:
        """Run ahead of this forward's drafts (the batch's requests in row order)."""

    def draft(self, row: int, prompt: int, extra: Sequence[int], m: int) -> list[int]:
        """Up to `m` tokens after the row's text so far plus `extra` (the draft being built)."""
        ...

    def extend(self, prompt: int, tokens: Sequence[int]) -> None:
        """Tokens request `prompt` has written."""

    def keep(self, rows: Sequence[int]) -> None:
        """Only batch rows `rows` go on, in that order."""


class LookupDrafter:
    """`draft="prompt"` (AR): each prompt's n-gram index (`draft.py`), extended as its answer is written."""

    lossless: ClassVar[bool] = True

    def __init__(self, prompts: Sequence[Sequence[int]]) -> None:
        self.lookups = [PromptLookup(p) for p in prompts]

    def propose(self, active: Sequence[int]) -> None:
        """Nothing to run ahead of the drafts: a lookup is a few dict reads (`draft`)."""

    def draft(self, row: int, prompt: int, extra: Sequence[int], m: int) -> list[int]:
        return self.lookups[prompt].draft(extra, m)

    def extend(self, prompt: int, tokens: Sequence[int]) -> None:
        self.lookups[prompt].extend(tokens)

    def keep(self, rows: Sequence[int]) -> None:
        """Indexed by prompt: finished rows need no bookkeeping."""


class CopyDrafter(LookupDrafter):
    """`copy_drafts` (block diffusion): prompt lookup fed into the canvas. Lossy (module doc)."""

    lossless: ClassVar[bool] = False

    def copies(
        self, active: Sequence[int], committed: Sequence[Sequence[int]], fed: Sequence[int], m: int
    ) -> list[list[int]]:
        """Each fed row's draft for its masked positions from the leftmost one: the continuation of
        its committed text (the answer so far, then `committed`, the block's committed prefix), at
        most `m` and within what it feeds (`fed`)."""
        return [
            self.draft(i, p, done, min(m, f - len(done)))
            for i, (p, done, f) in enumerate(zip(active, committed, fed, strict=True))
        ]

    @staticmethod
    def reblock(leftmost: Sequence[int], copies: Sequence[Sequence[int]]) -> Reblock:
        """The canvas's block ids for copy drafts: the committed prefix keeps the canvas's id, draft t
        gets id + 1 + t, the masks after the drafts id + 1 + n. Under block order the logit that
        checks draft t (from the position before it) then sees the drafts before it, never draft t
        itself or later ones, nor the masks after them (keys that carry no text); the masks after see
        every draft. A row without drafts keeps one block."""

        def ids(block: Tensor) -> Tensor:  # [r, q]
            block = block.clone()
            for slot, (left, copy) in enumerate(zip(leftmost, copies, strict=True)):
                if copy:
                    base, n = block[slot, 0], len(copy)
                    block[slot, left : left + n] = base + 1 + torch.arange(n, device=block.device)
                    block[slot, left + n :] = base + 1 + n
            return block

        return ids

    @staticmethod
    def aligned(copy: Sequence[int], left: int, lo: int, m: int) -> list[int | None]:
        """A row's drafts at this forward's positions `lo .. lo + m - 1` (None where none)."""
        out: list[int | None] = [None] * m
        for t, token in enumerate(copy):
            out[left + t - lo] = token
        return out

    @staticmethod
    def certain(conf: list[float], tokens: Sequence[int], drafts: Sequence[int | None]) -> list[float]:
        """`conf` with every position whose token agrees with its draft made certain (log-prob 0)."""
        return [0.0 if d is not None and d == t else c for d, t, c in zip(drafts, tokens, conf, strict=True)]

    @staticmethod
    def until_disagreement(
        pick: list[bool], tokens: Sequence[int], drafts: Sequence[int | None]
    ) -> list[bool]:
        """`pick` cut after the first picked position whose token is not its draft (the logits right
        of it were computed reading that draft)."""
        out = list(pick)
        for j, (p, token, d) in enumerate(zip(pick, tokens, drafts, strict=True)):
            if p and d is not None and d != token:
                out[j + 1 :] = [False] * (len(out) - j - 1)
                break
        return out


class ModelDrafter:
    """`draft="model"` (AR target): a block-diffusion model proposes each row's next `draft_tokens` in
    one forward. Lossless: the target verifies every proposal (module doc).

    Its own exact cache holds every row's clean tokens, causal (a layout of block size 1: what was
    written is text, whatever its blocks were); `propose` feeds what was written since its last
    forward (the prompt, first) with a canvas of masks after it that sees them all and itself (one
    block); column 0 of the logits (the last written token's) and the token shift give one arg-max
    token per canvas position. The canvas leaves its cache again. A batch's rows are its runner's
    rows in `Batch.active` order. When its layout runs out of columns (holes use them up) it proposes
    nothing for the rest of the batch: decoding goes on one token a forward.
    """

    lossless: ClassVar[bool] = True

    def __init__(self, model: PreTrainedModel, ids: Tensor, valid: Tensor, cfg: DecodeConfig) -> None:
        b, self.m = ids.shape[0], cfg.draft_tokens
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else model.config.mask_token_id
        self.mask_id, self.pad_id = int(mask_id), cfg.pad_token_id
        width = (cfg.max_new_tokens + self.m) * (1 if b == 1 else 2)  # batch 1 never leaves holes
        resp = torch.ones(b, width, dtype=torch.bool, device=ids.device)
        layout = prompt_response_layout(valid, resp, 1)
        self.runner = CachedRunner(model, layout, lean_forward(model, cfg.backend, layout.length))
        self.prompt: Tensor | None = ids  # fed with the first canvas
        self.written: dict[int, list[int]] = {}  # by prompt: tokens written, not fed yet
        self.proposals: list[list[int]] = [[] for _ in range(b)]
        self.spent = False  # out of columns

    def _unfed(self, active: Sequence[int]) -> tuple[Tensor, list[int]] | None:
        """Each row's tokens not fed yet, right-padded with holes, and the index of its last one;
        None when the layout has no room left for them and a canvas."""
        if self.prompt is not None:
            clean, self.prompt = self.prompt, None
            return clean, [clean.shape[1] - 1] * clean.shape[0]  # left-padded: each ends in the last column
        runner, new = self.runner, [self.written.pop(r, []) for r in active]
        c = max(map(len, new))
        if self.spent or runner.n + c + self.m > runner.layout.length:
            return None
        clean = torch.tensor([[*x, *[self.pad_id] * (c - len(x))] for x in new], device=runner.model.device)
        runner.leave_holes(c, [c - len(x) for x in new])
        return clean, [len(x) - 1 for x in new]

    def propose(self, active: Sequence[int]) -> None:
        """One drafter forward: each row's unfed tokens, then the canvas; its arg-max, the proposals."""
        unfed = self._unfed(active)
        if unfed is None:
            self.spent, self.proposals = True, [[] for _ in active]
            return
        clean, last = unfed
        c, m, first = clean.shape[1], self.m, min(last)
        canvas = torch.full((clean.shape[0], m), self.mask_id, device=clean.device)
        # the canvas is one block: its columns share the id of its last one (block order, masks.py);
        # columns: clean `first` .. c - 1 (each row's first draft token is its last written one's
        # logit), then canvas 0 .. m - 2 (the token shift)
        logits = self.runner.forward(
            clean, canvas, None, checked=c - 1 - first, reblock=lambda block: block[:, -1:].expand_as(block)
        )
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


def drafter_for(
    cfg: DecodeConfig,
    prompts: Sequence[Sequence[int]],
    ids: Tensor,
    valid: Tensor,
    model: PreTrainedModel | None,
) -> Drafter | None:
    """The batch's drafter for `cfg.copy_drafts` or `cfg.draft` (`config.check` admits at most one;
    `ids`/`valid`: its left-padded prompts; `model`: the drafter model of draft "model")."""
    if cfg.copy_drafts:
        return CopyDrafter(prompts)
    if cfg.draft == "model":
        assert model is not None  # `config.check`ed
        return ModelDrafter(model, ids, valid, cfg)
    return LookupDrafter(prompts) if cfg.draft == "prompt" else None


def agrees(draft: Sequence[int | None], j: int, token: int, eos: frozenset[int]) -> bool:
    """Whether a verified run goes on past position j: the model's token there is the draft's (the
    draft token was fed, so the next logits follow it), and not an end token. Copy drafts (aligned
    to the step's positions) hold None where nothing was drafted: no draft to leave there."""
    return j < len(draft) and draft[j] in (token, None) and token not in eos


def agreed(tokens: Sequence[int], draft: Sequence[int], eos: frozenset[int]) -> int:
    """Draft tokens a row without a constraint keeps: its leading run of `agrees` positions."""
    n = 0
    while agrees(draft, n, tokens[n], eos):
        n += 1
    return n


def verified_drafts(
    drafter: Drafter,
    active: Sequence[int],
    constraints: Sequence[TokenConstraint | None],
    budgets: Sequence[int],
    room: int,
    eos: frozenset[int],
) -> list[list[int]]:
    """Each AR row's draft of its next tokens, as long as its budget and `room` (the layout) allow.

    Built token by token through a copy of the row's constraint: a forced token joins the draft as
    it is (it will be accepted), a drafted token the constraint forbids ends the draft, and so does
    an end token. The continuation of one proposal is used until it runs out or a forced token
    departs from it; then the drafter is asked again on the extended tail.
    """
    drafts = []
    for i, r in enumerate(active):
        budget, original = budgets[i], constraints[i]
        state = None if original is None else original.copy()
        n = min(room, budget - 1)  # the forward writes one token more than the draft
        draft: list[int] = []
        follow: list[int] = []  # the current proposal's continuation, not used yet
        while len(draft) < n and (not draft or draft[-1] not in eos):
            token = None if state is None else state.only(budget - len(draft))
            if token is None:
                follow = follow or drafter.draft(i, r, draft, n - len(draft))
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
