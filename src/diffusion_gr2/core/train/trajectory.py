"""Trajectory distillation: a block-diffusion model trained on the canvases of its own decodes.

The converted model commits ~2 tokens per forward: most positions it will write are already its
arg-max several forwards before it commits them, but below tau (docs/experiments.md#trajectory-
distillation). What it is taught here, from its own served decodes on training requests:
* **the canvases it decodes from** (d3LLM's pseudo-trajectories, dParallel's self-distillation): each
  recorded decode keeps the forward of its block that committed every token (`DecodeOutput.commit_steps`),
  so each canvas the decoder ran can be rebuilt, and every position still masked in it is supervised
  with the token the decode finally wrote (`losses.cft_noise`, pattern "trajectory"): the CFT loss on
  the masks serving shows, targets from the model itself;
* **certainty** (dParallel's certainty forcing, LLaDA 2.0's CAP): the entropy of positions already
  predicted right is lowered (`losses.certainty_penalty`), so they clear tau sooner;
* **only answers worth copying** (rejection sampling, as the traces stage keeps teacher traces): a
  decode is kept when its answer is valid, ranks the request's target within `max_target_rank`, at
  least as high as the pre-rank did under `keep` (`no_worse`, `better`: so copying the list is not
  what is paid for; the default `any` keeps every valid one: docs/evaluation.md) and
  (`grounded`) its explanation cites only SIDs its prompt shows: validity checks the list alone, and
  rounds that kept ungrounded explanations taught the model to cite items that do not exist.
  Decoded free by default (`grammar` off; jump-forward and the SID threshold as served): an answer is
  kept only when the model wrote it valid on its own (expert iteration's rule). That raised own
  validity more than decoding under the grammar, whose corrections become targets but whose canvases
  never show the model's own slips (0.488 against 0.424 at tau 0.9:
  docs/experiments.md#expert-iteration-in-the-chain).

Recording is `record_trajectories` (one decode pass, the one decoder); training is the CFT loss of
`stages.supervised_loss` on the kept rows, in the one loop. Rows set aside keep their reason.

The same recording serves **expert iteration** on the AR teacher (`tau` None, `grammar` off): its own
free answers, kept when valid and ranking the target well, join the SFT examples
(`self_training_examples`) and the teacher is fine-tuned on both, so it writes its own valid answers
more often (docs/experiments.md#expert-iteration-on-the-teacher).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.evaluate.metrics import cited_sids, cites_only
from diffusion_gr2.core.rank.rerank import (
    RerankConfig,
    decode_config_for,
    decode_requests,
    request_grammars,
)
from diffusion_gr2.core.text.parser import ParsedAnswer, parse_answer
from diffusion_gr2.core.text.tokenizer import decode_response, response_roles

logger = logging.getLogger(__name__)

__all__ = [
    "EXAMPLE_COLUMNS",
    "TRAJECTORY_COLUMNS",
    "KEEP_RULES",
    "TrajectoryConfig",
    "grounded",
    "kept_trajectories",
    "parsed_answer",
    "rank_reason",
    "record_trajectories",
    "self_training_examples",
    "token_roles",
]

TRAJECTORY_COLUMNS = (
    "user_id",
    "point",
    "prompt_ids",
    "response_ids",  # the decoded answer, `<|im_end|>` included
    "commit_steps",  # per token: the forward of its block that committed it (1 = the first)
    "response_roles",  # per token: 0 explanation, 1 ranking list (`tokenizer.response_roles`)
    "nfe",
    "valid",
    "target_rank",  # 1-based position of the target in the answer's ranking; 0 = not ranked
    "kept",
    "reason",  # why a row was set aside ("" when kept)
)


@dataclass(frozen=True)
class TrajectoryConfig:
    """Which decodes are recorded and which are kept."""

    tau: float | None = 0.75  # commit threshold of the recorded decodes: the served candidate's; None = AR
    requests: int | None = 1024  # training requests decoded (a seeded sample); None = every one
    max_target_rank: int = 10  # keep an answer only if it ranks the target at most here (10: any valid)
    # Against the pre-rank's own rank of the target (`KEEP_RULES`): "any" keeps every answer within
    # `max_target_rank`, which pays for copying the list (a copy is always valid and ranks the target
    # somewhere); "no_worse" keeps an answer ranking the target at least as high as the pre-rank did;
    # "better" also asks it to rank it higher wherever the pre-rank's first item was wrong, so a copy
    # is kept only where the pre-rank was right (docs/evaluation.md#self-training-that-does-not-pay-for-copies)
    keep: str = "any"
    # keep an answer only if every SID its explanation cites is one its prompt shows (the evaluation's
    # `grounded_rate`); the list's validity does not check the explanation
    grounded: bool = True
    seed: int = 0
    # True: under the served answer grammar; False: free decodes, the model's own answers (an invalid
    # one is set aside, so what is kept is valid without the grammar's help)
    grammar: bool = False

    def __post_init__(self) -> None:
        if self.keep not in KEEP_RULES:
            raise ValueError(f"trajectories.keep must be one of {KEEP_RULES}, got {self.keep!r}")


KEEP_RULES = ("any", "no_worse", "better")


def rank_reason(rank: int, prerank_rank: int, config: TrajectoryConfig) -> str:
    """Why a valid answer ranking the target at `rank` is set aside ("" = kept); the pre-rank ranked
    it at `prerank_rank` (1-based)."""
    if not 0 < rank <= config.max_target_rank:
        return f"target_rank>{config.max_target_rank}"
    if config.keep != "any" and rank > prerank_rank:
        return "below_prerank"
    if config.keep == "better" and prerank_rank > 1 and rank == prerank_rank:
        return "not_above_prerank"
    return ""


def token_roles(tokenizer: PreTrainedTokenizerBase, tokens: list[int]) -> list[int]:
    """Per decoded token, its role as SFT examples have it: explanation, or the list from its key on."""
    text, offsets = "", []
    for token in tokens:
        start = len(text)
        text += tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        offsets.append((start, len(text)))
    return response_roles(text, offsets)


def record_trajectories(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    requests: pd.DataFrame,
    decoding: RerankConfig,
    config: TrajectoryConfig,
) -> pd.DataFrame:
    """Decode `config.requests` of `requests` as served and record each decode (`TRAJECTORY_COLUMNS`)."""
    decoding = replace(decoding, constrained=decoding.constrained and config.grammar)
    n = len(requests) if config.requests is None else min(config.requests, len(requests))
    order = np.random.default_rng(config.seed).permutation(len(requests))[:n]
    rows = requests.iloc[np.sort(order)].reset_index(drop=True)
    grammars = request_grammars(tokenizer, rows, decoding.cite_prompt_sids) if decoding.constrained else None
    prompts = [list(p) for p in rows["prompt_ids"]]
    outputs = decode_requests(
        model,
        prompts,
        decode_config_for(model, tokenizer, config.tau, decoding),
        "record trajectories",
        grammars,
    )
    records = []
    for req, out in zip(rows.itertuples(index=False), outputs, strict=True):
        parsed, rank = parsed_answer(tokenizer, out.tokens, req)
        reason = (
            f"invalid:{parsed.reason}"
            if not parsed.valid
            else "ungrounded"
            if config.grounded and not grounded(tokenizer, parsed.explanation, req)
            else rank_reason(rank, [int(i) for i in req.candidates].index(int(req.target)) + 1, config)
        )
        records.append(
            {
                "user_id": int(req.user_id),
                "point": int(req.point),
                "prompt_ids": list(req.prompt_ids),
                "response_ids": list(out.tokens),
                "commit_steps": list(out.commit_steps),
                "response_roles": token_roles(tokenizer, list(out.tokens)),
                "nfe": int(out.nfe),
                "valid": bool(parsed.valid),
                "target_rank": rank,
                "kept": reason == "",
                "reason": reason,
            }
        )
    return pd.DataFrame(records, columns=list(TRAJECTORY_COLUMNS))


def parsed_answer(
    tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int], request: Any
) -> tuple[ParsedAnswer, int]:
    """A decoded answer to `request` (a requests row) parsed, and the 1-based rank it gives the
    request's target (0 = invalid or not ranked)."""
    sids = [str(s) for s in request.candidate_sids]
    parsed = parse_answer(decode_response(tokenizer, tokens), sids)
    target = sids[[int(i) for i in request.candidates].index(int(request.target))]
    rank = parsed.ranking.index(target) + 1 if parsed.valid and target in parsed.ranking else 0
    return parsed, rank


def grounded(tokenizer: PreTrainedTokenizerBase, explanation: str | None, request: Any) -> bool:
    """Whether every SID an answer's explanation (the parser's) cites is one `request`'s prompt shows
    (history or candidates): the evaluation's `grounded_rate` test, which also asks for a citation."""
    shown = set(cited_sids(tokenizer.decode([int(t) for t in request.prompt_ids])))
    return cites_only(explanation or "", shown)


EXAMPLE_COLUMNS = ["prompt_ids", "response_ids", "response_roles"]


def self_training_examples(examples: pd.DataFrame, trajectories: pd.DataFrame) -> pd.DataFrame:
    """Supervised examples (`EXAMPLE_COLUMNS`) followed by the kept trajectories' answers (none kept,
    or nothing recorded: the examples alone)."""
    kept = trajectories.loc[trajectories["kept"], EXAMPLE_COLUMNS]
    logger.info(
        "self-training: %d examples + %d of %d own answers kept", len(examples), len(kept), len(trajectories)
    )
    if kept.empty:
        return examples[EXAMPLE_COLUMNS].reset_index(drop=True)
    return pd.concat([examples[EXAMPLE_COLUMNS], kept], ignore_index=True)


def kept_trajectories(trajectories: pd.DataFrame) -> pd.DataFrame:
    """The rows distillation trains on; an error naming the counts when rejection sampling kept none."""
    kept = trajectories[trajectories["kept"]].reset_index(drop=True)
    if kept.empty:
        reasons = trajectories["reason"].value_counts().to_dict()
        raise ValueError(f"no recorded trajectory was kept out of {len(trajectories)} (set aside: {reasons})")
    return kept
