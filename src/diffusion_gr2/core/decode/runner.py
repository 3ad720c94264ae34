"""The runner: forwards of clean tokens and a canvas against an exact KV cache (`kv_cache.py`).

Every forward is `[clean tokens not cached yet | canvas of the current block]`: the clean part's
keys/values enter the cache, its last logit gives the block's first token, and the canvas's logits
(token shift: position i-1 predicts token i) give the rest; the canvas's keys/values are dropped
again, so the cache only ever holds clean tokens (the prompt and finished blocks) and stays exact.

A batch row that finished its block waits for the others and is not computed meanwhile: the rows
still unmasking are swapped into the runner's first rows (`Slots`), so a forward feeds a slice of
the cache (a view) rather than a gathered copy. At batch 16 this cut the rows fed by 26-40% (rl,
tau 0.9-0.4, validation). Rejected draft tokens leave holes (`with_holes`): keys nobody attends to.

`RecomputeRunner` is the reference: no cache, the whole sequence re-run with the full mask; the
equivalence tests decode with both. Every runner (these two and `static.StaticRunner`) is a
`BaseRunner`: one forward (what is fed, under which layout, which columns' logits come back) and one
set of row bookkeeping, each runner saying only how it computes hidden states against its store of
clean columns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
from torch import Tensor
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.kv_cache import buffer_cache
from diffusion_gr2.core.model.diffusion import cached_block_hidden, layout_hidden, lm_logits
from diffusion_gr2.core.model.lean import LeanForward, lean_unsupported
from diffusion_gr2.core.model.masks import Layout

__all__ = [
    "BaseRunner",
    "CachedRunner",
    "RecomputeRunner",
    "Runner",
    "Slots",
    "lean_forward",
    "left_pad_prompts",
    "logit_columns",
    "resolved_backend",
    "with_holes",
]

# The canvas's block ids `[r, q]` -> the ids one forward uses instead (drafts re-block their canvas)
Reblock = Callable[[Tensor], Tensor]


def _transposition(n: int, i: int, j: int, device: torch.device) -> Tensor:
    """The permutation of `n` rows that swaps rows i and j."""
    perm = torch.arange(n, device=device)
    perm[i], perm[j] = j, i
    return perm


class Slots:
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

    def per_slot(self, values: Sequence[int]) -> list[int]:
        """`values` of batch rows 0, 1, ... rearranged into the order of the slots that hold them."""
        out = [0] * len(values)
        for slot, value in zip(self.of(range(len(values))), values, strict=True):
            out[slot] = value
        return out

    @property
    def in_order(self) -> bool:
        return all(row == slot for slot, row in enumerate(self.order))


def _fed_layout(
    layout: Layout, end: int, rows: int, start: int, canvas_valid: Tensor | None, reblock: Reblock | None
) -> Layout:
    """The first `end` columns of the first `rows` slots, with the canvas (columns `start ..`) fed
    only where `canvas_valid` says and re-blocked by `reblock`."""
    lay = layout.head(end, rows=rows)
    if canvas_valid is not None:
        lay = replace(lay, valid=torch.cat([lay.valid[:, :start], canvas_valid], 1))
    if reblock is not None:
        lay = replace(lay, block=torch.cat([lay.block[:, :start], reblock(lay.block[:, start:])], 1))
    return lay


def logit_columns(c: int, q: int, lo: int, checked: int) -> slice:
    """The columns of a forward's fed part `[clean c | canvas q]` whose logits it returns.

    With a clean part: its last position (it predicts the block's first token) after the `checked`
    before it, then every canvas position but the last (token shift: position i - 1 predicts token
    i). Without one: canvas positions `lo - 1 .. q - 2` (the block's tokens `lo .. q - 1`).
    """
    if c:
        return slice(c - 1 - checked, c + q - 1 if q else c)
    return slice(lo - 1, q - 1)


class BaseRunner(ABC):
    """What every runner does alike: the forward's layout and logits, the rows' bookkeeping.

    A runner holds the clean columns fed so far (`n` of them: the prompt, finished blocks) in a
    store of its own: a KV cache, a static cache, or the token sequence itself. Its `_hidden` says
    how a forward's hidden states are computed against that store, and `_keep_rows`, `_swap_rows`,
    `_drop_columns` how the store follows the slots and loses rejected draft columns.
    """

    model: PreTrainedModel
    layout: Layout  # the slots' rows: every column a batch can reach
    n: int  # clean columns held (a KV cache's length)
    slots: Slots

    def forward(
        self,
        clean: Tensor | None,
        canvas: Tensor | None,
        canvas_valid: Tensor | None,
        lo: int = 0,
        checked: int = 0,
        reblock: Reblock | None = None,
    ) -> Tensor:
        """Logits `[b, m, v]` of the block's tokens `lo .. q - 1` (q = canvas length; m >= 1).

        With `clean` ([b, c]) lo must be 0: column 0 comes from the clean part's last position (the
        block's first token), column j >= 1 from canvas position j - 1 (the token shift). Without it
        lo >= 1: tokens before `lo` are committed in every row, so their logits are not computed
        (the LM head is a large share of a small model's step). `canvas_valid` [b, q] marks the
        canvas positions each row really feeds (its window); the others are keys nobody attends to,
        so a row's result never depends on its batch neighbours' windows. `checked` (clean part
        alone): also the logits that predicted the clean part's last `checked` tokens, first (AR:
        jump-forward checks what the model would have written there, and a draft's tokens are
        verified by the logits that predicted them). `reblock`: the canvas's block ids for this
        forward only (drafts), which the mask then reads. The clean part stays in the store, the
        canvas does not.
        """
        c = 0 if clean is None else clean.shape[1]
        q = 0 if canvas is None else canvas.shape[1]
        ids = canvas if clean is None else clean if canvas is None else torch.cat([clean, canvas], 1)
        lay = _fed_layout(self.layout, self.n + c + q, ids.shape[0], self.n + c, canvas_valid, reblock)
        hidden = self._hidden(ids, lay, c, reblock)  # [b, >= c + q, h]: the fed columns first
        self.n += c
        return lm_logits(self.model, hidden[:, logit_columns(c, q, lo, checked)])

    @abstractmethod
    def _hidden(self, ids: Tensor, lay: Layout, c: int, reblock: Reblock | None) -> Tensor:
        """Hidden states of `ids` (`[clean c | canvas]`, fed after the `n` clean columns) under `lay`,
        the layout's first `n + c + q` columns; the store takes the clean part only."""

    @abstractmethod
    def _keep_rows(self, index: Tensor) -> None:
        """The store keeps slots `index`, in that order, as its first rows."""

    @abstractmethod
    def _swap_rows(self, i: int, j: int, perm: Tensor) -> None:
        """The store exchanges slots i and j (`perm`: that transposition of every slot)."""

    @abstractmethod
    def _drop_columns(self, drop: int) -> None:
        """The store loses its last `drop` clean columns (`n` still counts them)."""

    def _swap(self, i: int, j: int) -> None:
        perm = _transposition(self.layout.block.shape[0], i, j, self.layout.block.device)
        self._swap_rows(i, j, perm)
        self.layout = self.layout.rows(perm)

    def keep(self, rows: Sequence[int]) -> None:
        """Keep batch rows `rows` only, in that order (the slots are back in row order)."""
        index = torch.tensor(self.slots.of(rows), device=self.layout.block.device)
        self._keep_rows(index)
        self.layout = self.layout.rows(index)
        self.slots = Slots(len(rows), self._swap)

    def reject(self, kept: Sequence[int], fed: int) -> None:
        """Of the last forward's last `fed` clean columns (a draft), batch row i keeps the first `kept[i]`.

        Columns no row kept leave the store; a row that kept fewer than the most leaves holes
        (`with_holes`).
        """
        top = max(kept)
        if top < fed:
            self._drop_columns(fed - top)
            self.n -= fed - top
        self.layout = with_holes(self.layout, self.n, self.slots.per_slot([top - k for k in kept]))

    def leave_holes(self, c: int, holes: Sequence[int]) -> None:
        """Before feeding `c` clean columns, right-padded per slot: the last `holes[s]` of slot s are
        holes (a drafter's rows that wrote fewer tokens than the most)."""
        self.layout = with_holes(self.layout, self.n + c, holes)


class CachedRunner(BaseRunner):
    """Forwards against an exact KV cache that holds the prompt and the committed (clean) blocks."""

    def __init__(self, model: PreTrainedModel, layout: Layout, lean: LeanForward | None = None) -> None:
        self.model, self.layout, self.lean = model, layout, lean
        self.cache = buffer_cache(model, layout.length)
        self.n = 0
        self.slots = Slots(layout.block.shape[0], self._swap)

    def _hidden(self, ids: Tensor, lay: Layout, c: int, reblock: Reblock | None) -> Tensor:
        q = ids.shape[1] - c
        # The prompt needs the predicate's mask (causal, padded queries); a clean block beside a canvas
        # (it must not see it) and several clean tokens (AR jump-forward: causal) need block order;
        # anything else sees every valid key: a broadcast row.
        full_mask = self.n == 0
        block_order = reblock is not None or c > 1 or (c > 0 and q > 0)
        hidden = cached_block_hidden(
            self.model, ids, lay, self.cache, full_mask=full_mask, lean=self.lean, block_order=block_order
        )
        if q:
            self.cache.crop(-q)  # negative = number of tokens to drop (transformers 5)
        return hidden

    def _keep_rows(self, index: Tensor) -> None:
        self.cache.batch_select_indices(index)

    def _swap_rows(self, i: int, j: int, perm: Tensor) -> None:
        for layer in self.cache.layers:
            layer.swap_rows(i, j)

    def _drop_columns(self, drop: int) -> None:
        self.cache.crop(-drop)  # negative = number of tokens to drop (transformers 5)


class RecomputeRunner(BaseRunner):
    """The reference twin of `CachedRunner`: no cache, the whole sequence re-run with the full mask."""

    def __init__(self, model: PreTrainedModel, layout: Layout) -> None:
        self.model, self.layout = model, layout
        self.seq: Tensor | None = None  # every clean token so far
        self.n = 0
        self.slots = Slots(layout.block.shape[0], self._swap)

    def _hidden(self, ids: Tensor, lay: Layout, c: int, reblock: Reblock | None) -> Tensor:
        """The whole sequence computed from scratch (the predicate's mask reads block ids anyway)."""
        if c:
            clean = ids[:, :c]
            self.seq = clean if self.seq is None else torch.cat([self.seq, clean], 1)
        assert self.seq is not None, "the first forward carries the prompt"
        seq = self.seq[: ids.shape[0]]
        whole = seq if ids.shape[1] == c else torch.cat([seq, ids[:, c:]], 1)
        return layout_hidden(self.model, whole, lay)[:, self.n :]

    def _keep_rows(self, index: Tensor) -> None:
        assert self.seq is not None
        self.seq = self.seq[index]

    def _swap_rows(self, i: int, j: int, perm: Tensor) -> None:
        assert self.seq is not None
        self.seq = self.seq[perm]

    def _drop_columns(self, drop: int) -> None:
        assert self.seq is not None
        self.seq = self.seq[:, : self.n - drop]


Runner = CachedRunner | RecomputeRunner


def with_holes(layout: Layout, end: int, holes: Sequence[int]) -> Layout:
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


def resolved_backend(model: PreTrainedModel, backend: str) -> str:
    """The forward `backend` runs `model` with: "lean" or "eager" ("auto": lean where it covers it)."""
    if backend == "auto":
        return "eager" if lean_unsupported(model) is not None else "lean"
    return backend


def lean_forward(model: PreTrainedModel, backend: str, positions: int) -> LeanForward | None:
    """The lean forward of `model` when `backend` asks for it (auto: where it covers the model)."""
    if resolved_backend(model, backend) == "eager":
        return None
    return LeanForward(model, positions)  # backend "lean" on a model it does not cover: refused


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
