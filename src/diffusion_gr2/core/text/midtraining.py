"""Mid-training task: list every candidate exactly once (GR2 mixes such tasks in before SFT).

A model trained from scratch must first learn to *copy* semantic IDs from its prompt: without it, it
writes duplicate and foreign IDs however long SFT runs (measured: 0/32 valid after 2,500 SFT steps).
Short synthetic prompts — N random catalog SIDs, answer = the same SIDs in a random order as the JSON
`recommendations` list — teach exactly that copy-and-cover skill, at a fraction of the cost of full
prompts. Nothing here sees users or targets, so it leaks nothing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import pandas as pd
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.tokenizer import encode_example

COPY_SYSTEM_PROMPT = "List every candidate exactly once as JSON."


def copy_task_messages(candidate_sids: Sequence[str]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": COPY_SYSTEM_PROMPT},
        {"role": "user", "content": "Candidates:\n" + "\n".join(candidate_sids)},
    ]


def copy_task_examples(
    sids: Sequence[str], tokenizer: PreTrainedTokenizerFast, n_examples: int, n_candidates: int, seed: int
) -> pd.DataFrame:
    """`prompt_ids, response_ids, response_roles` of `n_examples` copy-task examples (seeded)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_examples):
        candidates = [sids[i] for i in rng.choice(len(sids), n_candidates, replace=False)]
        answer = [candidates[i] for i in rng.permutation(n_candidates)]
        response = json.dumps({"recommendations": answer}, separators=(",", ":"))
        rows.append(encode_example(tokenizer, copy_task_messages(candidates), response))
    return pd.DataFrame(
        {
            "prompt_ids": [e.prompt_ids for e in rows],
            "response_ids": [e.response_ids for e in rows],
            "response_roles": [e.response_roles for e in rows],
        }
    )
