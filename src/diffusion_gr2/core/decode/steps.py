"""The decoder's three kinds of step, each filling a `Block` of the batch.

* `first_token`: one forward of the clean tokens alone; its last logit is the block's first token.
  AR decoding is this and nothing else, one forward per token (with lossless drafts verified in the
  same forward); `fused=False` runs it before each diffusion block.
* `run_block`: a diffusion block unmasked forward by forward: feed a canvas (`_feed`), choose and
  gate (`_picks`), walk the constraint, commit.
* `jump_forward`: AR, no forward at all: every row's next token is forced by its constraint.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diffusion_gr2.core.decode.commit import (
    choose,
    commit_mask,
    fed_width,
    gate_start,
    needs_step,
    repeat_gated,
    sid_gated,
)
from diffusion_gr2.core.decode.constrain import Step, constrain_commits
from diffusion_gr2.core.decode.drafters import CopyDrafter, agreed, verified_drafts
from diffusion_gr2.core.decode.state import Batch, Block

__all__ = ["ar_drafts", "first_token", "jump_forward", "run_block"]


@dataclass
class _Fed:
    """What one diffusion forward fed: the rows taking part (slot order), each row's leftmost masked
    position and fed width, the block position of the logits' column 0 (`lo`), its copy drafts."""

    rows: list[int]
    leftmost: list[int]
    widths: list[int]
    lo: int
    copies: list[list[int]] | None


def run_block(st: Batch, blk: Block, limit: int) -> None:
    """Unmask `blk` forward by forward; rows whose relevant positions are all committed stop taking part.

    `st.pending` (clean tokens not in the cache yet) rides along in the first forward, whose column
    0 is the block's first token. `limit`: positions of the block that can reach the output. After
    `max_steps_per_block` forwards the rest is filled (the cap feeds the whole block).
    """
    max_steps = st.cfg.max_steps_per_block or len(blk.tokens[0])
    for step in range(1, max_steps + 1):
        # the first forward also writes the clean part: every row takes part in it
        need = [
            st.pending is not None or needs_step(t, m, limit, st.eos)
            for t, m in zip(blk.tokens, blk.masked, strict=True)
        ]
        if not any(need):
            return
        fill = step == max_steps
        fed, logits = _feed(st, blk, st.runner.slots.take_part(need), fill)  # rows done are not computed
        tokens, logps = st.choose(logits)
        cands, chosen, drafts = _picks(st, blk, fed, tokens, logps, fill)
        commits = chosen
        if st.constraints is not None:
            walk = Step(fed.rows, fed.lo, logits, tokens, logps, cands, chosen, fill, drafts)
            commits, fixes = constrain_commits(st, walk)
            for r, fix in zip(fed.rows, fixes, strict=True):
                blk.forced[r] += fix
        for i, r in enumerate(fed.rows):
            blk.apply(r, commits[i], tokens[i], logps[i], step, fed.lo)
            blk.nfe[r] += 1


def _feed(st: Batch, blk: Block, rows: list[int], fill: bool) -> tuple[_Fed, Tensor]:
    """One forward of `rows`' canvases (each up to its window; the whole block at the cap) after the
    clean part; copy drafts go into their masked positions. Logits `[rows, m, v]` of positions lo..."""
    cfg, runner, k = st.cfg, st.runner, len(blk.tokens[0])
    dev = runner.layout.block.device
    leftmost = [blk.leftmost(r) for r in rows]
    fed = [int(fed_width(left, k, None if fill else cfg.window)) for left in leftmost]
    # q: the widest canvas fed; lo: the first position still masked in any row fed (everything
    # left of it is committed in every row, so its logits are not computed)
    q = max(fed)
    lo = 0 if st.pending is not None else max(1, min(min(leftmost), q - 1))
    canvas_rows = [blk.tokens[r][:q] for r in rows]
    copies, reblock = None, None
    if isinstance(st.drafter, CopyDrafter) and not fill:  # drafts fed as tokens, each seen only after it
        committed = [blk.tokens[r][:left] for r, left in zip(rows, leftmost, strict=True)]
        copies = st.drafter.copies([st.active[r] for r in rows], committed, fed, cfg.draft_tokens)
        for row, left, copy in zip(canvas_rows, leftmost, copies, strict=True):
            row[left : left + len(copy)] = copy
        reblock = CopyDrafter.reblock(leftmost, copies)
    canvas = torch.tensor(canvas_rows, device=dev)
    canvas_valid = torch.tensor([[j < f for j in range(q)] for f in fed], device=dev)
    logits = runner.forward(st.pending, canvas, canvas_valid, lo, reblock=reblock)  # [rows, m, v]
    st.pending = None
    return _Fed(rows, leftmost, fed, lo, copies), logits


def _picks(
    st: Batch, blk: Block, fed: _Fed, tokens: list[list[int]], logps: list[list[float]], fill: bool
) -> tuple[list[list[bool]], list[list[bool]], list[list[int | None]] | None]:
    """Per fed row: the positions open to commit, the commit rule's picks on the (gated) confidences,
    and its copy drafts aligned to the forward's positions (None without copy drafts)."""
    cfg, lo, m = st.cfg, fed.lo, len(tokens[0])
    cands, chosen = [], []
    aligned_rows: list[list[int | None]] = []  # each row's copy drafts at the forward's positions
    for i, r in enumerate(fed.rows):
        cand = [blk.masked[r][j] and j < fed.widths[i] for j in range(lo, lo + m)]
        conf = logps[i]
        if lo == 0:  # column 0, the block's first token, is predicted by the clean part, not the
            # canvas; only this forward predicts it: every rule takes it, as if certain
            cand[0], conf = blk.masked[r][0], [0.0, *conf[1:]]
        cands.append(cand)
        aligned = None
        if fed.copies is not None:  # a draft the model's own token agrees with is certain
            aligned = CopyDrafter.aligned(fed.copies[i], fed.leftmost[i], lo, m)
            conf = CopyDrafter.certain(conf, tokens[i], aligned)
            aligned_rows.append(aligned)
        if cfg.sid_threshold is not None:
            start = _gate_start(st, blk, r, lo, tokens[i])
            conf = sid_gated(conf, tokens[i], cfg.sid_threshold, cfg.sid_token_ids, start)
        if cfg.repeat_gate:
            conf = repeat_gated(conf, tokens[i], cand)
        # constrained rows make their run in the constraint walk (it may extend it)
        cut = st.constraint(r) is None
        pick = commit_mask(cand, conf, cfg.threshold, fill, cfg.commit_rule, cut=cut)
        if aligned is not None and cut:  # the run ends at a draft it leaves: later logits read it
            pick = CopyDrafter.until_disagreement(pick, tokens[i], aligned)
        chosen.append(pick)
    return cands, chosen, None if fed.copies is None else aligned_rows


def _gate_start(st: Batch, blk: Block, row: int, lo: int, chosen: Sequence[int]) -> int:
    """`commit.gate_start` for batch row `row`: its text is its answer so far, the block's tokens
    before `lo`, then this forward's positions (committed tokens, else its choices)."""
    hi = lo + len(chosen)
    ahead = [
        c if m else t for t, m, c in zip(blk.tokens[row][lo:hi], blk.masked[row][lo:hi], chosen, strict=True)
    ]
    return gate_start([*st.written(row), *blk.tokens[row][:lo]], ahead, st.cfg.sid_after)


def first_token(st: Batch, blk: Block, drafts: list[list[int]] | None = None) -> None:
    """One forward of the clean tokens alone; its last logit is the block's first token (step 0).

    `st.jumped`: the clean part's last tokens that AR jump-forward wrote without a forward
    (`jump_forward`); the logits that predict them are computed here too, and where the model would
    have written another token it counts as a correction, exactly as a forward per token would have
    counted it. `drafts` (AR, one per row, `ar_drafts`): fed after the clean part, padded to the
    longest; the logit after each draft token is the model's token there, and a row keeps the run
    that agrees with its draft: its row of `blk` (of width 1 + the longest draft) is cut to the
    tokens written, and the rest leave the cache.
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
        would = choose(logits[:, :jumped], st.cfg.do_sample, st.cfg.temperature, st.gen)[0]
        fixes = (would != st.pending[:, -jumped:]).sum(1).tolist()
        blk.forced = [f + fix for f, fix in zip(blk.forced, fixes, strict=True)]
    st.pending, st.jumped = None, 0
    head = logits[:, jumped:]  # the first token, then the one after each draft token
    tokens, logps = st.choose(head)
    mine = [[] for _ in tokens] if drafts is None else drafts
    cands = [[j <= len(x) for j in range(d + 1)] for x in mine]
    chosen = [[j <= agreed(t, x, st.eos) for j in range(d + 1)] for t, x in zip(tokens, mine, strict=True)]
    commit = chosen
    if st.constraints is not None:
        step = Step(list(range(len(tokens))), 0, head, tokens, logps, cands, chosen, True, drafts)
        commit, fixes = constrain_commits(st, step)
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


def ar_drafts(st: Batch) -> list[list[int]]:
    """Each AR row's draft for the next forward (`drafters.verified_drafts`)."""
    assert st.drafter is not None
    st.drafter.propose(st.active)
    rows = range(len(st.active))
    constraints, budgets = [st.constraint(i) for i in rows], [st.budget(i) for i in rows]
    return verified_drafts(st.drafter, st.active, constraints, budgets, st.draft_room(), st.eos)


def jump_forward(st: Batch) -> Block | None:
    """AR jump-forward: when every row's constraint leaves one next token, its block (no forward).

    The rows of a batch move in step, so one row with a choice to make costs the forward anyway.
    An end token or a row's last allowed token is never jumped: the forward that follows checks
    what the model would have written at jumped positions (`first_token`), and those rows have none.
    """
    if not st.constraints:
        return None
    rows = range(len(st.active))
    only = [
        None if (c := st.constraint(i)) is None or st.budget(i) <= 1 else c.only(st.budget(i)) for i in rows
    ]
    if any(t is None or t in st.eos for t in only):
        return None
    blk = Block.empty(len(st.active), 1, st.cfg.pad_token_id)
    for i, token in zip(rows, only, strict=True):
        constraint = st.constraint(i)
        assert constraint is not None and token is not None
        blk.apply(i, [True], [token], [0.0], 0, 0)  # certain under the constrained distribution
        constraint.advance(token)
    return blk
