"""What one forward commits: the choice, the window, the commit rule and the SID gate, as pure functions.

Commit rules (`DecodeConfig.commit_rule`), each step, among the block's masked positions:
* `prefix` (default): the leftmost one, plus the unbroken run right after it that is above tau, so a
  block is written left to right, several tokens per forward where the model is sure. On our
  AR-converted models this kept far more outputs valid at the same tau and about the same tokens per
  forward (cft, tau 0.9, 151 test requests: 35.8% valid, 1.43 tokens/forward, against 6.6% and 1.48
  for `confident`): a confident token far right of the written text is where parallel decoding breaks.
* `confident` (Fast-dLLM v2): every position above tau, plus the most confident one.

SID gate (`DecodeConfig.sid_threshold`, any rule): a position whose chosen token is a SID code joins
a step's parallel commits only above this higher tau; the explanation's free text keeps `tau`. Free
answers break at SID codes (rl, tau 0.9, 320 validation requests: all 144 invalid answers first left
the grammar inside the recommendations, as a foreign or repeated ID), so a strict tau there buys
validity at little speed (docs/experiments.md#sid-threshold). With `sid_after` (the ranking list's
key) it holds in the ranking list only and the explanation's cited SIDs keep `tau`: more tokens per
forward, fewer answers the model's own (docs/experiments.md#sid-threshold-scope).

Repeat gate (`DecodeConfig.repeat_gate`, any rule): a choice equal to its left neighbour's, both
masked when the forward ran, does not ride along; the next forward decides it with the neighbour
written. Each masked position is predicted on its own, so two can take the token one of them should
write: nearly every adjacent repeat in recorded free decodes was committed by one forward ("listed
listed", `","","`), and half the first slips of invalid answers rode along in a parallel commit
(docs/experiments.md#repeats-and-citations).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "choose",
    "commit_mask",
    "fed_width",
    "find_end",
    "gate_start",
    "leftmost_masked",
    "needs_step",
    "repeat_gated",
    "sid_gated",
]


def choose(
    logits: Tensor, do_sample: bool, temperature: float, gen: torch.Generator
) -> tuple[Tensor, Tensor]:
    """Tokens and their log-probs `[...]` from logits `[..., v]` (arg-max, or a seeded sample)."""
    x = logits.float() / temperature if do_sample else logits.float()
    logp = torch.log_softmax(x, -1)
    if do_sample:
        flat = torch.multinomial(logp.exp().reshape(-1, x.shape[-1]), 1, generator=gen)
        tokens = flat.view(x.shape[:-1])
    else:
        tokens = x.argmax(-1)
    return tokens, logp.gather(-1, tokens[..., None]).squeeze(-1)


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


def needs_step(tokens: list[int], masked: list[bool], limit: int, eos: frozenset[int]) -> bool:
    """Whether a row's block has a masked position that can still reach the output.

    Positions count up to `limit` and up to the first committed eos (anything after it is cut).
    """
    for j in range(limit):
        if masked[j]:
            return True
        if tokens[j] in eos:
            return False
    return False


def commit_mask(
    cand: list[bool], logp: list[float], threshold: float, fill: bool, rule: str, cut: bool = True
) -> list[bool]:
    """Positions of one row to commit among its masked candidates `cand` under commit rule `rule`.

    Every rule commits at least one position of a row with a candidate (guarantees progress). A
    position is confident when its probability is above `threshold`. `cut=False` skips the `prefix`
    rule's cut to one run (the constraint walk, `constrain.py`, makes its own run).
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


def sid_gated(
    conf: list[float], tokens: Sequence[int], threshold: float, sid_ids: frozenset[int], start: int = 0
) -> list[float]:
    """`conf` with every SID-code choice from index `start` on not above `threshold` made unconfident
    (it then commits only where a commit is due: the leftmost masked position, or the step cap)."""
    log_tau = math.log(threshold) if threshold > 0 else -math.inf
    return [
        -math.inf if j >= start and t in sid_ids and c <= log_tau else c
        for j, (c, t) in enumerate(zip(conf, tokens, strict=True))
    ]


def repeat_gated(conf: list[float], tokens: Sequence[int], cand: Sequence[bool]) -> list[float]:
    """`conf` with every choice equal to its left neighbour's, both open in this forward, made
    unconfident: it commits only when due, with the neighbour then written on the canvas. Each
    masked position is predicted on its own, so two of them can both take the token one of them
    should write ("listed listed", a SID entry written twice); seen committed, the model decides."""
    return [
        -math.inf if j > 0 and cand[j] and cand[j - 1] and tokens[j] == tokens[j - 1] else c
        for j, c in enumerate(conf)
    ]


def gate_start(before: Sequence[int], ahead: Sequence[int], marker: Sequence[int]) -> int:
    """Index into `ahead` (this forward's positions: committed tokens, else its choices) from which
    the SID gate holds: 0 without a `marker`; else the first position after the marker ends in the
    row's text `before + ahead` (`before`: its answer so far and the block's committed prefix), and
    none (`len(ahead)`) where it has not been written."""
    if not marker:
        return 0
    text = [*before, *ahead]
    end = find_end(text, marker)
    return len(ahead) if end is None else max(0, end - len(before))


def find_end(seq: list[int], marker: Sequence[int]) -> int | None:
    """Index just after the first occurrence of `marker` in `seq` (None = it does not occur)."""
    n, i, want = len(marker), -1, list(marker)
    while True:
        try:
            i = seq.index(want[0], i + 1)  # the scan runs in C: a decode step calls this per row
        except ValueError:
            return None
        if seq[i : i + n] == want:
            return i + n
