"""Evidence in the prompt and the learned analyst: counted without the requesting user, shown as the
levels the teacher cites or as the hint naming its best candidates, and a teacher that beats the
pre-rank where the evidence carries signal."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.text.evidence import (
    SIGNALS,
    Evidence,
    EvidenceConfig,
    EvidenceScale,
    EvidenceTable,
    LinearRanker,
    evidence_from_spec,
    evidence_spec,
    item_years,
    shows_evidence,
    within_ranks,
)
from diffusion_gr2.core.text.learned_analyst import LearnedAnalystConfig, fit_learned_analyst, top_hits
from diffusion_gr2.core.text.prompt import ItemLookup, PromptConfig, PromptEvidence, build_messages
from diffusion_gr2.core.text.traces import RerankExample

AFTER, POP, CO, CO_RECENT = (SIGNALS.index(s) for s in ("after", "pop", "co", "co_recent"))


def _table(sequences: dict[int, list[int]], **kw: int) -> EvidenceTable:
    items = {i for s in sequences.values() for i in s}
    return EvidenceTable(sequences, {i: () for i in items}, {}, EvidenceConfig(**kw))


def test_a_request_never_counts_its_own_sequence() -> None:
    """User 0's own 1 -> 2 is left out: only user 1's pair counts for 2, only user 2's for 3."""
    table = _table({0: [1, 2], 1: [1, 2], 2: [1, 3]}, window=1)
    raw = table.raw(0, [1], [2, 3])
    assert raw[:, AFTER].tolist() == [math.log1p(1), math.log1p(1)]
    assert raw[:, POP].tolist() == [math.log1p(1), math.log1p(1)]  # 2: user 1 only; 3: user 2 only
    # a pair seen only in the requesting user's own sequence (its training target) gives nothing
    assert table.raw(2, [1], [3])[0, AFTER] == 0.0


def test_cowatching_leaves_the_requesting_user_out() -> None:
    """1 and 2 are watched together by users 0 and 1; 3 only by user 2, who never watched 1. Seen from
    user 0, 2 shares one other watcher (user 1) with 1: cosine 1 / sqrt(1 x 1)."""
    table = _table({0: [1, 2], 1: [1, 2], 2: [3, 4]})
    raw = table.raw(0, [1], [2, 3, 99])  # 99: an item nobody watched
    assert raw[:, CO].tolist() == [1.0, 0.0, 0.0]
    assert raw[:, CO_RECENT].tolist() == [1.0, 0.0, 0.0]
    # a user outside the sequences (a served request) counts every watcher: 2 of sqrt(2 x 2)
    assert table.raw(-1, [1], [2])[0, CO] == 1.0
    assert _table({0: [1, 2], 1: [1, 5]}).raw(0, [1], [2])[0, CO] == 0.0  # only the user's own pair


def test_cowatching_with_the_latest_items_weighs_the_newest_most() -> None:
    """2 goes with 1 (old), 4 with 3 (newest): co_recent prefers 4, co weighs both alike."""
    table = _table({0: [1, 2], 1: [3, 4], 2: [1, 3]})
    raw = table.raw(9, [1, 3], [2, 4])
    assert raw[0, CO] == pytest.approx(raw[1, CO])
    assert raw[1, CO_RECENT] > raw[0, CO_RECENT] > 0


def test_within_ranks_put_the_largest_at_one() -> None:
    raw = np.array([[3.0, 0.0], [1.0, 0.0], [2.0, 5.0]])
    assert within_ranks(raw).tolist() == [[1.0, 0.0], [0.0, 0.0], [0.5, 1.0]]
    assert within_ranks(raw[:1]).tolist() == [[1.0, 1.0]]


def test_follows_count_within_the_window_after_the_recent_items() -> None:
    table = _table({0: [1, 9, 2], 1: [5, 5]}, window=2, recent=1)
    assert table.raw(1, [1], [2])[0, AFTER] == math.log1p(1)  # 2 is two positions after 1
    assert _table({0: [1, 9, 2], 1: [5, 5]}, window=1).raw(1, [1], [2])[0, AFTER] == 0.0


def test_genre_fit_reads_the_whole_history_and_year_the_median() -> None:
    cats = {1: ("Drama",), 2: ("Drama",), 3: ("Comedy",), 4: ("Drama",), 5: ("Comedy",)}
    years = {1: 1990.0, 2: 1994.0, 3: 1998.0, 4: 1994.0, 5: math.nan}
    table = EvidenceTable({0: [1, 2, 3]}, cats, years, EvidenceConfig())
    raw = table.raw(9, [1, 2, 3], [4, 5])
    assert raw[:, 0].tolist() == pytest.approx([2 / 3, 1 / 3])  # Drama on 2 of 3 history items
    assert raw[:, 1].tolist() == [0.0, 0.0]  # 1994 is the median; an unknown year is neutral


def test_item_years_are_read_from_the_description() -> None:
    items = pd.DataFrame({"item_id": [0, 1, 2], "description": ["release_year: 1996", "", None]})
    years = item_years(items)
    assert years[0] == 1996.0 and math.isnan(years[1]) and math.isnan(years[2])


def test_levels_cut_at_training_quantiles() -> None:
    raw = np.arange(100, dtype=float)[:, None].repeat(len(SIGNALS), axis=1)
    scale = EvidenceScale.fit(raw, levels=5)
    assert np.bincount(scale.levels(raw)[:, 0]).tolist() == [20, 20, 20, 20, 20]
    assert EvidenceScale.from_dict(scale.to_dict()) == scale
    with pytest.raises(ValueError, match="levels must be in 2..10"):
        EvidenceConfig(levels=11)


def test_the_prompt_shows_each_candidates_levels_and_the_hint(lookup: ItemLookup) -> None:
    ids = sorted(lookup.items)[:3]
    shown = PromptEvidence(("fit 1 year 2", "fit 4 year 0"), favoured=(1, 0))
    lines = build_messages(ids[:1], ids[1:], lookup, PromptConfig(), shown)[1]["content"].splitlines()
    assert lines[-3].endswith("| fit 1 year 2") and lines[-2].endswith("| fit 4 year 0")
    assert lines[-1] == f"Evidence favours: {lookup[ids[2]].sid} {lookup[ids[1]].sid}"
    hint_only = build_messages(ids[:1], ids[1:], lookup, PromptConfig(), PromptEvidence(favoured=(0,)))
    plain = build_messages(ids[:1], ids[1:], lookup, PromptConfig())[1]["content"].splitlines()
    assert hint_only[1]["content"].splitlines()[:-1] == plain  # the candidates' lines untouched
    with pytest.raises(ValueError, match="1 evidence texts for 2 candidates"):
        build_messages(ids[:1], ids[1:], lookup, PromptConfig(), PromptEvidence(("fit 1",)))


def test_the_spec_carries_the_ranker_and_says_whether_prompts_show_evidence() -> None:
    table, examples = _world(40, seed=1)
    evidence = Evidence.fit(table, [(e.user_id, e.history, e.candidates) for e in examples])
    s = len(SIGNALS)
    ranker = LinearRanker((0.0,) * s, (2.0,) * s, tuple(range(2 * s + 10)), -1.0, 10)
    spec = evidence_spec(Evidence(evidence.table, evidence.scale, ranker))
    sequences = pd.DataFrame(
        {"user_id": list(table.sequences), "train_items": list(table.sequences.values())}
    )
    items = pd.DataFrame({"item_id": range(100), "categories": [[]] * 100, "description": [""] * 100})
    back = evidence_from_spec(spec, sequences, items)
    assert back.ranker == ranker and back.scale == evidence.scale
    hidden = {**spec, "in_prompt": False}
    assert shows_evidence(spec) and not shows_evidence(hidden) and not shows_evidence(None)
    assert shows_evidence({**hidden, "hint": 2})
    with pytest.raises(ValueError, match="needs the learned analyst's ranker"):
        Evidence(
            table,
            evidence.scale,
            None,
        ).favoured(0, (1,), (50, 51))


def _world(n_users: int, seed: int, hint: int = 0) -> tuple[EvidenceTable, list[RerankExample]]:
    """Users whose next item is the one most often following their last item elsewhere; the pre-rank
    puts it first only by chance (a random position)."""
    rng = np.random.default_rng(seed)
    successor = {a: (a * 7 + 3) % 50 + 50 for a in range(50)}  # item a is mostly followed by this one
    sequences = {u: [a, successor[a]] for u, a in enumerate(rng.integers(0, 50, 400))}
    table = EvidenceTable(
        sequences,
        {i: () for i in range(100)},
        {},
        EvidenceConfig(in_prompt=not hint, recent=1, window=1, hint=hint),
    )
    examples = []
    for u in range(1000, 1000 + n_users):
        last = int(rng.integers(0, 50))
        target = successor[last]
        others = [int(i) for i in rng.permutation([i for i in range(50, 100) if i != target])[:9]]
        cands = others[:]
        cands.insert(int(rng.integers(0, 10)), target)
        split = "train" if u < 1000 + n_users // 2 else "valid"
        examples.append(RerankExample(u, split, (last,), tuple(cands), target))
    return table, examples


@pytest.mark.parametrize("hint", [0, 3])
def test_the_learned_analyst_beats_the_prerank_where_the_evidence_carries_signal(hint: int) -> None:
    table, examples = _world(300, seed=0, hint=hint)
    evidence = Evidence.fit(
        table, [(e.user_id, e.history, e.candidates) for e in examples if e.split == "train"]
    )
    ids = range(100)
    lookup = ItemLookup({i: _info(i) for i in ids}, {_info(i).sid: i for i in ids})
    train = [e for e in examples if e.split == "train"]
    valid = [e for e in examples if e.split == "valid"]
    analyst, by_c = fit_learned_analyst(evidence, lookup, train, valid, LearnedAnalystConfig(cs=(0.1, 1.0)))
    hits = top_hits(analyst, valid)
    prerank = np.mean([e.candidates[0] == e.target for e in valid])
    assert hits.mean() > prerank + 0.3 and set(by_c) == {0.1, 1.0}
    trace, ranking = analyst.propose(valid[0], np.random.default_rng(0))
    shown = analyst.evidence.for_prompt(valid[0].user_id, valid[0].history, valid[0].candidates)
    assert shown is not None
    pick = valid[0].candidates.index(ranking[0])
    if hint:  # the hint names the analyst's noiseless best first; its trace cites signals by name
        assert len(shown.favoured) == 3 and shown.lines is None
        assert shown.favoured[0] == int(np.argmax(analyst.scores(valid[0])))
        assert "follows the latest items" in trace or "watched with" in trace
    else:  # its trace cites the level the prompt shows for its pick
        assert shown.lines is not None and not shown.favoured
        level = shown.lines[pick].split("after ")[1].split()[0]
        assert f"after {level}" in trace or "co" in trace


def _info(i: int):  # noqa: ANN202 (an ItemInfo)
    from diffusion_gr2.core.text.prompt import ItemInfo

    return ItemInfo(sid=f"<a_{i}><b_0><c_0><d_0>", title=f"item {i}", categories=(), brand="", price=math.nan)
