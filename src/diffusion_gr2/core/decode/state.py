"""One batch's decoding state: the batch (`Batch`), the block being unmasked (`Block`), each row's
record (`Record`).

Between forwards the block's state lives in host lists: a step reads its chosen tokens once and
decides commits in Python, cheaper on a small model than the ~40 tiny tensor ops it replaced (~15% of
a batch-1 step on the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel

from diffusion_gr2.core.decode.commit import choose
from diffusion_gr2.core.decode.config import DecodeConfig, DecodeOutput
from diffusion_gr2.core.decode.drafters import Drafter, drafter_for
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.decode.runner import (
    CachedRunner,
    RecomputeRunner,
    Runner,
    lean_forward,
    left_pad_prompts,
)
from diffusion_gr2.core.decode.static import StaticRunner
from diffusion_gr2.core.model.masks import prompt_response_layout

__all__ = ["Batch", "Block", "Record"]


@dataclass
class Record:
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


@dataclass
class Block:
    """Canvas of the current block for every active row, with its commit record; all `[b][k]` lists."""

    tokens: list[list[int]]
    steps: list[list[int]]  # forward of the block that committed the position (0 = before it), -1 = masked
    logps: list[list[float]]
    masked: list[list[bool]]
    nfe: list[int]  # forwards each row took part in
    forced: list[int]  # the constraint's overrides so far (`DecodeOutput.forced`)

    @classmethod
    def empty(cls, b: int, k: int, mask_id: int) -> Block:
        return cls(
            [[mask_id] * k for _ in range(b)],
            [[-1] * k for _ in range(b)],
            [[0.0] * k for _ in range(b)],
            [[True] * k for _ in range(b)],
            [0] * b,
            [0] * b,
        )

    def leftmost(self, row: int) -> int:
        """Row `row`'s leftmost masked position (k if none)."""
        return next((j for j, m in enumerate(self.masked[row]) if m), len(self.masked[row]))

    def trim(self, row: int, n: int) -> None:
        """Keep the first `n` positions of batch row `row` (an AR row's verified run)."""
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


@dataclass
class Batch:
    """One batch's decoding: what every step reads, and what its rows have written so far.

    Batch row i holds prompt `active[i]`; `records` and `constraints` are indexed by
    prompt, so a finished row leaves `active` (and the runner) and nothing else moves.
    """

    runner: Runner | StaticRunner
    cfg: DecodeConfig
    gen: torch.Generator
    eos: frozenset[int]
    records: list[Record]
    constraints: Sequence[TokenConstraint | None] | None  # this batch's copies, advanced as tokens commit
    drafter: Drafter | None  # where drafts come from (`cfg.draft`); None = none
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
    ) -> Batch:
        """The batch before its first forward: prompts left-padded, the cache empty (`drafter`: the
        model of `cfg.draft == "model"`)."""
        k, dev = cfg.block_size, model.device
        ids, valid = left_pad_prompts(prompts, cfg.pad_token_id, dev)
        # AR drafts need columns for what they feed, and a batch room for its rows' holes
        room = 0 if cfg.draft is None else cfg.draft_tokens + (cfg.max_new_tokens if len(prompts) > 1 else 0)
        width = math.ceil(cfg.max_new_tokens / k) * k + room
        layout = prompt_response_layout(
            valid, torch.ones(len(prompts), width, dtype=torch.bool, device=dev), k
        )
        runner: Runner | StaticRunner
        if cfg.recompute:
            runner = RecomputeRunner(model, layout)
        elif cfg.static_cache:  # the same step in fixed shapes (static.py); graphs on CUDA
            runner = StaticRunner(model, layout, k, cfg.cuda_graphs)
        else:
            runner = CachedRunner(model, layout, lean_forward(model, cfg.backend, layout.length))
        return cls(
            runner=runner,
            cfg=cfg,
            gen=gen,
            eos=frozenset(cfg.eos_token_ids),
            records=[Record() for _ in prompts],
            constraints=constraints,
            drafter=drafter_for(cfg, prompts, ids, valid, drafter),
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
        """`commit.choose` as host lists: tokens and log-probs `[...]` of logits `[..., v]`."""
        tokens, logps = choose(logits, self.cfg.do_sample, self.cfg.temperature, self.gen)
        return tokens.tolist(), logps.tolist()

    def draft_room(self) -> int:
        """Draft tokens the next forward may feed: the layout's columns left after its clean part,
        less what the row with the most budget may still need (one column a token, its last never
        fed), so that row can always finish one token a forward."""
        assert self.pending is not None
        left = self.runner.layout.length - self.runner.n - self.pending.shape[1]
        most = max(self.budget(i) for i in range(len(self.active)))
        return min(self.cfg.draft_tokens, left - most + 1)

    def record_block(self, blk: Block) -> list[int]:
        """Store each active row's block (cut at its budget and first eos); the rows that continue."""
        keep = []
        for i, r in enumerate(self.active):
            record = self.records[r]
            limit, before = min(len(blk.tokens[i]), self.budget(i)), len(record.tokens)
            record.nfe += blk.nfe[i]
            record.forced += blk.forced[i]
            ended = record.add_block(blk.tokens[i], blk.steps[i], blk.logps[i], limit, self.eos)
            if self.drafter is not None:
                self.drafter.extend(r, record.tokens[before:])
            if not ended and len(record.tokens) < self.cfg.max_new_tokens:
                keep.append(i)
        return keep

    def keep(self, rows: list[int]) -> None:
        """Only batch rows `rows` go on (the others finished), in that order."""
        self.runner.keep(rows)
        if self.drafter is not None:
            self.drafter.keep(rows)
        self.active = [self.active[i] for i in rows]
