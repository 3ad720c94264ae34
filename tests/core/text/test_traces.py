from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.text.parser import parse_answer
from diffusion_gr2.core.text.prompt import ItemInfo, ItemLookup, PromptConfig
from diffusion_gr2.core.text.tokenizer import REASONING, encode_example
from diffusion_gr2.core.text.traces import (
    FEATURES,
    AnalystConfig,
    RerankExample,
    RuleBasedAnalyst,
    SFTRow,
    build_sft_rows,
    candidate_features,
    dominant_categories,
    examples_from_frame,
    popularity_from_histories,
    rejection_sample,
    sft_frame,
    sft_rows_from_frame,
)


def _info(sid: str, cats: tuple[str, ...], brand: str = "") -> ItemInfo:
    return ItemInfo(sid=sid, title=sid, categories=cats, brand=brand, price=math.nan)


def test_examples_from_frame(candidates: pd.DataFrame) -> None:
    examples = examples_from_frame(candidates)
    assert len(examples) == len(candidates)
    first = candidates.iloc[0]
    assert examples[0].candidates == tuple(first.candidates) and examples[0].target == first.target
    assert examples[0].history == tuple(first.history) and examples[0].split == "train"


def test_features_follow_the_visible_signals() -> None:
    history = [_info("h0", ("Drama",), "A"), _info("h1", ("Comedy",)), _info("h2", ("War",))]
    cands = [
        _info("c0", ("Horror",)),  # shares nothing
        _info("c1", ("Drama",)),  # shares with the oldest item
        _info("c2", ("War",)),  # shares with the latest item
        _info("c3", ("Horror",), "A"),  # same brand as h0
    ]
    f = candidate_features(history, cands, popularity=[0, 10, 0, 0], decay=0.5)
    col = {name: f[:, j] for j, name in enumerate(FEATURES)}
    assert col["category"][0] == 0 and col["category"][2] > col["category"][1] > 0  # recency-weighted
    assert col["recency"][2] == 1.0 and col["recency"][1] == pytest.approx(0.25)
    assert col["brand"][3] > 0 and col["brand"][:3].sum() == 0
    assert col["popularity"].tolist() == [0, 1, 0, 0]
    assert col["position"].tolist() == [1.0, 0.75, 0.5, 0.25]
    assert dominant_categories(history, decay=0.5) == ["War", "Comedy"]


def test_noiseless_analyst_prefers_matching_candidates(
    lookup: ItemLookup, examples: list[RerankExample]
) -> None:
    analyst = RuleBasedAnalyst(lookup, config=AnalystConfig(temperature=0.0))
    ex = examples[0]
    feats, base = analyst.scores(ex)
    _, ranking = analyst.propose(ex, np.random.default_rng(1))
    _, again = analyst.propose(ex, np.random.default_rng(2))
    assert ranking == again  # without noise the seed does not matter
    assert ranking[0] == ex.candidates[int(np.argmax(base))]
    assert sorted(ranking) == sorted(ex.candidates)


@pytest.mark.parametrize("tail", ["prerank", "score", "noisy"])
def test_tail_order_after_the_top_pick(lookup: ItemLookup, examples: list[RerankExample], tail: str) -> None:
    analyst = RuleBasedAnalyst(lookup, config=AnalystConfig(temperature=5.0, tail=tail))
    ex = examples[0]
    _, base = analyst.scores(ex)
    for seed in range(20):
        _, ranking = analyst.propose(ex, np.random.default_rng(seed))
        rest = [c for c in ex.candidates if c != ranking[0]]
        by_score = [
            ex.candidates[j] for j in np.argsort(-base, kind="stable") if ex.candidates[j] != ranking[0]
        ]
        assert sorted(ranking) == sorted(ex.candidates)
        if tail == "prerank":
            assert list(ranking[1:]) == rest  # "promote one item": the rest keep the retriever's order
        elif tail == "score":
            assert list(ranking[1:]) == by_score
        elif list(ranking[1:]) not in (rest, by_score):
            return  # the noisy tail departs from both orders for some seed
    assert tail != "noisy", "a noisy tail never left the pre-rank and score orders"


def test_unknown_tail_order_is_refused() -> None:
    with pytest.raises(ValueError, match="tail"):
        AnalystConfig(tail="random")


def test_proposals_vary_with_noise_and_repeat_with_seed(
    analyst: RuleBasedAnalyst, examples: list[RerankExample], lookup: ItemLookup
) -> None:
    ex = examples[3]
    first = analyst.propose(ex, np.random.default_rng(7))
    assert analyst.propose(ex, np.random.default_rng(7)) == first
    rng = np.random.default_rng(0)
    assert len({tuple(analyst.propose(ex, rng)[1]) for _ in range(20)}) > 1
    trace, ranking = first
    assert trace.startswith("1) History:") and " 2) " in trace and " 3) Pick " in trace
    assert lookup[ranking[0]].sid in trace.split("3) Pick ")[1]  # the final step names the pick
    assert lookup[ex.history[-1]].sid in trace.split(" 2) ")[0]  # step 1 cites the latest item


def test_trace_length_in_tokens(tokenizer: PreTrainedTokenizerFast, sft_rows: list[SFTRow]) -> None:
    lengths, prompts = [], []
    for row in sft_rows:
        ex = encode_example(tokenizer, row.messages, row.response_text)
        lengths.append(ex.response_roles.count(REASONING))
        prompts.append(len(ex.prompt_ids))
    assert 45 <= np.mean(lengths) <= 90 and max(lengths) <= 110
    assert 250 <= np.mean(prompts) <= 400


def test_rejection_sampling_accepts_only_target_picks(
    analyst: RuleBasedAnalyst, examples: list[RerankExample]
) -> None:
    rows, stats = rejection_sample(analyst, examples, max_tries=8, seed=3)
    assert rows and all(r.ranking[0] == r.example.target for r in rows)
    assert all(1 <= r.tries <= 8 for r in rows)
    assert stats.accepted == len(rows) and stats.eligible == len(examples)
    assert stats.acceptance_rate == pytest.approx(len(rows) / len(examples))
    assert sum(stats.tries_histogram.values()) == len(rows)
    assert 1.0 <= stats.mean_tries_accepted <= stats.mean_tries <= 8.0
    again, _ = rejection_sample(analyst, examples, max_tries=8, seed=3)
    assert again == rows  # reproducible from the seed
    _, one_try = rejection_sample(analyst, examples, max_tries=1, seed=3)
    assert one_try.acceptance_rate < stats.acceptance_rate  # retries with fresh noise help


class _Oracle:
    """Puts the target first: always accepted on the first try."""

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]:
        rest = [c for c in example.candidates if c != example.target]
        return "oracle", [example.target, *rest]


class _Contrarian:
    """Never puts the target first; the second proposal is not even a permutation."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]:
        self.calls += 1
        rest = [c for c in example.candidates if c != example.target]
        return ("bad", [example.target]) if self.calls % 2 == 0 else ("no", [*rest, example.target])


def test_rejection_sampling_stats_at_the_extremes(examples: list[RerankExample]) -> None:
    absent = replace(examples[0], target=-1)
    rows, stats = rejection_sample(_Oracle(), [*examples[:5], absent], max_tries=4, seed=0)
    assert (len(rows), stats.examples, stats.eligible, stats.acceptance_rate, stats.mean_tries) == (
        5,
        6,
        5,
        1.0,
        1.0,
    )
    contrarian = _Contrarian()
    rows, stats = rejection_sample(contrarian, examples[:5], max_tries=4, seed=0)
    assert rows == [] and stats.acceptance_rate == 0.0 and stats.mean_tries == 4.0
    assert contrarian.calls == 20 and math.isnan(stats.mean_tries_accepted)


class _Second:
    """Puts the target second (the list unchanged where the target is not a candidate)."""

    def propose(self, example: RerankExample, rng: np.random.Generator) -> tuple[str, list[int]]:
        if example.target not in example.candidates:
            return "second", list(example.candidates)
        rest = [c for c in example.candidates if c != example.target]
        return "second", [rest[0], example.target, *rest[1:]]


def test_keep_within_sets_how_high_the_answer_must_rank_the_target(examples: list[RerankExample]) -> None:
    absent = replace(examples[0], target=-1)
    batch = [*examples[:5], absent]
    for keep_within, accepted, eligible in ((1, 0, 5), (2, 5, 5), (10, 5, 5), (None, 6, 6)):
        rows, stats = rejection_sample(_Second(), batch, max_tries=3, seed=0, keep_within=keep_within)
        assert (len(rows), stats.eligible) == (accepted, eligible), keep_within
        assert all(r.tries == 1 for r in rows)  # accepted on the first proposal or never
    # None keeps the example whose target is not a candidate, with the teacher's answer unchanged
    rows, _ = rejection_sample(_Second(), batch, max_tries=3, seed=0, keep_within=None)
    assert rows[-1].example == absent and rows[-1].ranking == tuple(_Second().propose(absent, None)[1])


def test_sft_rows_parse_back_to_the_teacher_ranking(
    analyst: RuleBasedAnalyst, examples: list[RerankExample], lookup: ItemLookup, prompt_config: PromptConfig
) -> None:
    rows, _ = rejection_sample(analyst, examples[:20], seed=0)
    sft = build_sft_rows(rows, lookup, prompt_config)
    for row, trace in zip(sft, rows, strict=True):
        parsed = parse_answer(row.response_text, lookup.sids(trace.example.candidates))
        assert parsed.valid and parsed.ranking == tuple(lookup.sids(trace.ranking))
        assert parsed.explanation == trace.explanation
        assert lookup.sids([trace.example.target])[0] not in row.messages[1]["content"].split("Candidates")[0]
    assert sft_rows_from_frame(sft_frame(sft)) == sft


def test_popularity_from_histories() -> None:
    assert popularity_from_histories([[1, 2, 2], [2, 3]]) == {1: 1.0, 2: 3.0, 3: 1.0}
