"""Mid-training task: list every candidate exactly once (GR2 mixes such tasks in before SFT).

A model trained from scratch must first learn to *copy* semantic IDs from its prompt: without it, it
writes duplicate and foreign IDs however long SFT runs (measured: 0/32 valid after 2,500 SFT steps).
Short synthetic prompts — N random catalog SIDs, answer = the same SIDs re-ordered (`ANSWER_ORDERS`) as
the JSON `recommendations` list — teach exactly that copy-and-cover skill, at a fraction of the cost of full
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

# How a copy answer orders the prompt's candidates:
# * "permutation": a uniformly random order (track which IDs are written, with no cue);
# * "promote": one random candidate first, then the others in prompt order with it skipped — the
#   shape of every trace answer with `traces.analyst.tail: prerank`, whose failure is the skip
#   (writing the promoted ID a second time where prompt order reaches it);
# * "mixed": each example draws one of the two.
ANSWER_ORDERS = ("permutation", "promote", "mixed")


def copy_answer_order(rng: np.random.Generator, n_candidates: int, answer_order: str) -> list[int]:
    """Indices into the prompt's candidates, in the order the copy answer lists them."""
    if answer_order not in ANSWER_ORDERS:
        raise ValueError(f"copy-task answer_order must be one of {ANSWER_ORDERS}, got {answer_order!r}")
    if answer_order == "mixed":
        answer_order = ANSWER_ORDERS[int(rng.integers(2))]
    if answer_order == "permutation":
        return [int(i) for i in rng.permutation(n_candidates)]
    promoted = int(rng.integers(n_candidates))
    return [promoted, *(i for i in range(n_candidates) if i != promoted)]


def copy_task_messages(candidate_sids: Sequence[str]) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": COPY_SYSTEM_PROMPT},
        {"role": "user", "content": "Candidates:\n" + "\n".join(candidate_sids)},
    ]


def copy_task_examples(
    sids: Sequence[str],
    tokenizer: PreTrainedTokenizerFast,
    n_examples: int,
    n_candidates: int,
    seed: int,
    answer_order: str,
) -> pd.DataFrame:
    """`prompt_ids, response_ids, response_roles` of `n_examples` copy-task examples (seeded)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_examples):
        candidates = [sids[i] for i in rng.choice(len(sids), n_candidates, replace=False)]
        answer = [candidates[i] for i in copy_answer_order(rng, n_candidates, answer_order)]
        response = json.dumps({"recommendations": answer}, separators=(",", ":"))
        rows.append(encode_example(tokenizer, copy_task_messages(candidates), response))
    return pd.DataFrame(
        {
            "prompt_ids": [e.prompt_ids for e in rows],
            "response_ids": [e.response_ids for e in rows],
            "response_roles": [e.response_roles for e in rows],
        }
    )
