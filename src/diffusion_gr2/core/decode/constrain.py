"""The constraint walk: each row's commits of one forward, walked left to right through its constraint.

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

Jump-forward (`DecodeConfig.jump_forward`; SGLang's name for it): where the constraint leaves exactly
one token (`TokenConstraint.only`), that token is written without the model's say, at log-prob 0
(certain under the constrained distribution the answer is served from). In block diffusion a forced
position joins the step's run as certain, and a correction is counted wherever the model's own
choice differs, whatever its confidence there; AR jumps are `steps.jump_forward`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from diffusion_gr2.core.decode.commit import choose
from diffusion_gr2.core.decode.drafters import agrees
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.decode.state import Batch

__all__ = ["Step", "constrain_commits"]


@dataclass
class Step:
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


def constrain_commits(st: Batch, step: Step) -> tuple[list[list[bool]], list[int]]:
    """Each row's commits under its constraint, and the corrections per row (`step.tokens`/`logps`
    in place).

    `step.chosen` holds the commit rule's picks before its prefix cut for rows with a constraint
    (`commit_mask(..., cut=False)`; a row without one keeps the rule's run). Under the `prefix`
    rule a row's commits are one run from its first candidate (`_walk_row`). Log-probs become those
    of the constrained (renormalised) distribution: the automaton walk is plain Python per committed
    token; the tensor work is one batched pass over every constrained commit of the step.
    """
    forced = [0] * len(step.rows)
    commits = [[False] * len(row) for row in step.chosen]
    where: list[tuple[int, int]] = []  # constrained commits, and the masks they were checked against
    masks: list[Tensor] = []
    for i, r in enumerate(step.rows):
        constraint = st.constraint(r)
        if constraint is None:  # nothing to check: the rule's own run (`commit_mask` cut it)
            if any(step.cands[i]):
                commits[i][:] = step.chosen[i]
            continue
        forced[i] = _walk_row(st, step, i, constraint, commits[i], where, masks)
    if where:
        _renormalise(st, step, where, masks)
    return commits, forced


def _walk_row(
    st: Batch,
    step: Step,
    i: int,
    constraint: TokenConstraint,
    commit: list[bool],
    where: list[tuple[int, int]],
    masks: list[Tensor],
) -> int:
    """Row i's run through its constraint (`commit` and `step.tokens[i]` in place); its corrections.

    `st.budget(row) - lo` = tokens the row may still write at the step's first position.
    * a position the constraint leaves one token (`only`, with jump-forward) joins the run as
      certain (log-prob 0 under the constrained distribution), whatever the model's confidence;
    * any other position joins while the rule chose it. A disallowed token is replaced by the best
      allowed one where a commit is due (the run's first position, or every position when
      `step.must_commit`) and cuts the run elsewhere;
    * with `step.drafts` the run goes on only while the committed token is the draft's (`agrees`).
    A correction: a replaced token, a jumped token the model would not have chosen, and a disallowed
    choice that ends the run (nothing is committed there).
    """
    cfg, tokens, logps = st.cfg, step.tokens[i], step.logps[i]
    budget, cand, row = st.budget(step.rows[i]) - step.lo, step.cands[i], step.chosen[i]
    forced, first = 0, True
    for j in range(len(cand)):
        if not cand[j]:  # committed before the run, or past the row's window (masked
            if first:  # positions are one suffix of the block, so the run ends there)
                continue
            break
        due = first or step.must_commit
        only = constraint.only(budget - j) if cfg.jump_forward else None
        if only is not None:  # certain: the one token the constraint allows
            forced += int(tokens[j] != only)  # the model's own choice was another token
            tokens[j], logps[j] = only, 0.0
        else:
            if not (due or row[j]):  # neither chosen nor certain: the run ends here
                break
            allowed = constraint.allowed(budget - j)
            if allowed is not None:
                if not bool(allowed[tokens[j]]):
                    forced += 1
                    if not due:  # not due here: end the run before it
                        break
                    x = step.logits[i, j].masked_fill(~allowed.to(step.logits.device), -math.inf)
                    tokens[j] = int(choose(x, cfg.do_sample, cfg.temperature, st.gen)[0])  # best allowed
                where.append((i, j))
                masks.append(allowed)
            # allowed None = any token: nothing to correct, the log-prob stays the model's
        commit[j], first = True, False
        constraint.advance(tokens[j])
        if step.drafts is not None and not agrees(step.drafts[i], j, tokens[j], st.eos):
            break
    return forced


def _renormalise(st: Batch, step: Step, where: list[tuple[int, int]], masks: list[Tensor]) -> None:
    """The constrained commits' log-probs under the constrained distribution, in one batched pass."""
    logits, cfg = step.logits, st.cfg
    r, c = (torch.tensor(idx, device=logits.device) for idx in zip(*where, strict=True))
    picked = torch.tensor([step.tokens[i][j] for i, j in where], device=logits.device)
    x = logits[r, c].float() / (cfg.temperature if cfg.do_sample else 1.0)
    x = x.masked_fill(~torch.stack(masks).to(logits.device), -math.inf)  # the constrained distribution
    renormalised = torch.log_softmax(x, -1).gather(1, picked[:, None]).squeeze(1).tolist()
    for (i, j), logp in zip(where, renormalised, strict=True):
        step.logps[i][j] = logp
