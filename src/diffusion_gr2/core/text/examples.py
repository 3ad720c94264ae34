"""Token-level datasets every model stage reads: re-ranking requests and SFT examples.

`requests` (one row per candidate-list row, every split): what a re-ranker is asked — the prompt ids
plus the facts needed to score its answer (candidates in pre-rank order, their SIDs, the target).
`sft_examples` (accepted teacher traces): prompt ids, response ids and per-token roles.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean

import pandas as pd
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.evidence import Evidence
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, build_messages
from diffusion_gr2.core.text.tokenizer import ANSWER, encode_example, encode_prompt
from diffusion_gr2.core.text.traces import SFTRow


def encode_requests(
    candidates: pd.DataFrame,
    lookup: ItemLookup,
    tokenizer: PreTrainedTokenizerFast,
    config: PromptConfig,
    evidence: Evidence | None = None,
) -> pd.DataFrame:
    """`user_id, split, point, target, target_position, candidates, candidate_sids, prompt_ids` per row
    (the prompt with `evidence` per candidate where given)."""
    prompts, cand_sids = [], []
    for row in candidates.itertuples(index=False):
        history, cands = list(row.history), list(row.candidates)
        shown = None if evidence is None else evidence.for_prompt(int(row.user_id), history, cands)
        messages = build_messages(history, cands, lookup, config, shown)
        prompts.append(encode_prompt(tokenizer, messages))
        cand_sids.append(lookup.sids(row.candidates))
    return pd.DataFrame(
        {
            "user_id": candidates["user_id"].astype("int64").to_numpy(),
            "split": candidates["split"].astype(str).to_numpy(),
            "point": candidates["point"].astype("int64").to_numpy(),
            "target": candidates["target"].astype("int64").to_numpy(),
            "target_position": candidates["target_position"].astype("int64").to_numpy(),
            "candidates": [[int(i) for i in c] for c in candidates["candidates"]],
            "candidate_sids": cand_sids,
            "prompt_ids": prompts,
        }
    )


def encode_sft(rows: Sequence[SFTRow], tokenizer: PreTrainedTokenizerFast) -> pd.DataFrame:
    """`user_id, split, target, prompt_ids, response_ids, response_roles` per accepted trace."""
    encoded = [encode_example(tokenizer, r.messages, r.response_text) for r in rows]
    return pd.DataFrame(
        {
            "user_id": [r.user_id for r in rows],
            "split": [r.split for r in rows],
            "target": [r.target for r in rows],
            "prompt_ids": [e.prompt_ids for e in encoded],
            "response_ids": [e.response_ids for e in encoded],
            "response_roles": [e.response_roles for e in encoded],
        }
    )


def length_report(sft_examples: pd.DataFrame, requests: pd.DataFrame) -> dict[str, float]:
    """Mean prompt / trace (reasoning) / answer lengths in tokens, as the issue asks to report."""
    roles = list(sft_examples["response_roles"])
    return {
        "mean_prompt_tokens": fmean(len(p) for p in requests["prompt_ids"]) if len(requests) else 0.0,
        "mean_trace_tokens": fmean(sum(x != ANSWER for x in r) for r in roles) if roles else 0.0,
        "mean_answer_tokens": fmean(sum(x == ANSWER for x in r) for r in roles) if roles else 0.0,
        "mean_response_tokens": fmean(len(r) for r in roles) if roles else 0.0,
        "max_prompt_tokens": float(max((len(p) for p in requests["prompt_ids"]), default=0)),
    }
