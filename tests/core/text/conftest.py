"""Shared fixtures for the text tests: synthetic MovieLens-like frames, lookup, teacher, tokenizer."""

from __future__ import annotations

import pandas as pd
import pytest
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig
from diffusion_gr2.core.text.tokenizer import build_tokenizer
from diffusion_gr2.core.text.traces import (
    RerankExample,
    RuleBasedAnalyst,
    SFTRow,
    build_sft_rows,
    corpus_texts,
    examples_from_frame,
    popularity_from_histories,
    rejection_sample,
)

from .synthetic import make_candidates, make_items, make_sids, sid_tokens

N_ITEMS = 120


@pytest.fixture(scope="session")
def items() -> pd.DataFrame:
    return make_items(N_ITEMS, seed=0)


@pytest.fixture(scope="session")
def sids() -> pd.DataFrame:
    return make_sids(N_ITEMS, seed=1)


@pytest.fixture(scope="session")
def candidates(items: pd.DataFrame) -> pd.DataFrame:
    return make_candidates(items, n_users=200, seed=2)


@pytest.fixture(scope="session")
def prompt_config() -> PromptConfig:
    return PromptConfig()


@pytest.fixture(scope="session")
def lookup(items: pd.DataFrame, sids: pd.DataFrame, prompt_config: PromptConfig) -> ItemLookup:
    return ItemLookup.from_frames(items, sids, prompt_config)


@pytest.fixture(scope="session")
def examples(candidates: pd.DataFrame) -> list[RerankExample]:
    return examples_from_frame(candidates)


@pytest.fixture(scope="session")
def analyst(
    lookup: ItemLookup, examples: list[RerankExample], prompt_config: PromptConfig
) -> RuleBasedAnalyst:
    popularity = popularity_from_histories(e.history for e in examples)
    return RuleBasedAnalyst(lookup, popularity, prompt_config=prompt_config)


@pytest.fixture(scope="session")
def sft_rows(
    analyst: RuleBasedAnalyst, examples: list[RerankExample], lookup: ItemLookup, prompt_config: PromptConfig
) -> list[SFTRow]:
    rows, _ = rejection_sample(analyst, examples, max_tries=8, seed=0)
    return build_sft_rows(rows, lookup, prompt_config)


@pytest.fixture(scope="session")
def tokenizer(sft_rows: list[SFTRow]) -> PreTrainedTokenizerFast:
    return build_tokenizer(corpus_texts(sft_rows), sid_tokens(), vocab_size=2000)
