"""A small synthetic world for the rank and decode tests: a trained tokenizer and test requests."""

from __future__ import annotations

from typing import Any

import pandas as pd
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.evidence import Evidence, EvidenceTable, evidence_spec
from diffusion_gr2.core.text.examples import encode_requests
from diffusion_gr2.core.text.learned_analyst import LearnedAnalystConfig, fit_learned_analyst
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, build_messages, render_answer
from diffusion_gr2.core.text.tokenizer import build_tokenizer
from diffusion_gr2.core.text.traces import examples_from_frame
from tests.core.text.synthetic import make_candidates, make_items, make_sids, sid_tokens

PROMPT = PromptConfig(history_in_prompt=10, title_words=6)  # the prompt the golden dump saw


def world_frames(
    n_users: int = 6, seed: int = 2, splits: tuple[str, ...] = ("test",)
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The world's `items`, `sids` and `candidates` frames (`n_users` users per split)."""
    items, sids = make_items(40, seed=0), make_sids(40, seed=1)
    cands = pd.concat(
        [
            make_candidates(items, n_users, seed + 100 * i, history_len=5).assign(split=split)
            for i, split in enumerate(splits)
        ],
        ignore_index=True,
    )
    return items, sids, cands


def make_world(
    n_users: int = 6, seed: int = 2, splits: tuple[str, ...] = ("test",)
) -> tuple[PreTrainedTokenizerFast, pd.DataFrame]:
    """A tokenizer trained on synthetic prompts/answers and the `requests` of `n_users` users per split."""
    items, sids, cands = world_frames(n_users, seed, splits)
    lookup = ItemLookup.from_frames(items, sids, PROMPT)
    texts = []
    for row in cands.itertuples(index=False):
        texts += [
            m["content"] for m in build_messages(list(row.history), list(row.candidates), lookup, PROMPT)
        ]
        texts.append(
            render_answer("The user watches dramas, so drama comes first.", lookup.sids(row.candidates))
        )
    tokenizer = build_tokenizer(texts, sid_tokens(), vocab_size=400)
    return tokenizer, encode_requests(cands, lookup, tokenizer, PROMPT)


def analyst_inputs(n_users: int = 6, seed: int = 2, splits: tuple[str, ...] = ("test",)) -> dict[str, Any]:
    """What the `analyst` rows read beside `make_world`'s requests (the same arguments): `items`,
    `splits` (each user's training sequence: their first request's history), `candidates` and the
    `evidence` spec with a learned analyst fit on these requests."""
    items, sids, cands = world_frames(n_users, seed, splits)
    first = cands.drop_duplicates("user_id")
    sequences = pd.DataFrame({"user_id": first["user_id"], "train_items": first["history"].map(list)})
    table = EvidenceTable.from_frames(sequences, items)
    evidence = Evidence.fit(table, zip(cands["user_id"], cands["history"], cands["candidates"], strict=True))
    examples = examples_from_frame(cands)
    lookup = ItemLookup.from_frames(items, sids, PROMPT)
    analyst, _ = fit_learned_analyst(evidence, lookup, examples, examples, LearnedAnalystConfig(cs=(1.0,)))
    return {
        "items": items,
        "splits": sequences,
        "candidates": cands,
        "evidence": evidence_spec(analyst.evidence),
    }
