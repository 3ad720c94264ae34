"""A small synthetic world for the rank and decode tests: a trained tokenizer and test requests."""

from __future__ import annotations

import pandas as pd
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.examples import encode_requests
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, build_messages, render_answer
from diffusion_gr2.core.text.tokenizer import build_tokenizer
from tests.core.text.synthetic import make_candidates, make_items, make_sids, sid_tokens


def make_world(
    n_users: int = 6, seed: int = 2, splits: tuple[str, ...] = ("test",)
) -> tuple[PreTrainedTokenizerFast, pd.DataFrame]:
    """A tokenizer trained on synthetic prompts/answers and the `requests` of `n_users` users per split."""
    items, sids = make_items(40, seed=0), make_sids(40, seed=1)
    cands = pd.concat(
        [
            make_candidates(items, n_users, seed + 100 * i, history_len=5).assign(split=split)
            for i, split in enumerate(splits)
        ],
        ignore_index=True,
    )
    config = PromptConfig(history_in_prompt=10, title_words=6)  # the prompt the golden dump saw
    lookup = ItemLookup.from_frames(items, sids, config)
    texts = []
    for row in cands.itertuples(index=False):
        texts += [
            m["content"] for m in build_messages(list(row.history), list(row.candidates), lookup, config)
        ]
        texts.append(
            render_answer("The user watches dramas, so drama comes first.", lookup.sids(row.candidates))
        )
    tokenizer = build_tokenizer(texts, sid_tokens(), vocab_size=400)
    return tokenizer, encode_requests(cands, lookup, tokenizer, config)
