"""The `analyst` rows: the learned analyst's noiseless order as a system of the stage table, whose R@1
is the teacher's ceiling (`trace_report.json` `analyst`, `learned_analyst.top_hits`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.evaluate.rankings import stage_metrics
from diffusion_gr2.core.rank.rerank import (
    NO_MODEL_SYSTEMS,
    RANKING_COLUMNS,
    SYSTEMS,
    analyst_rows,
    prerank_rows,
)
from diffusion_gr2.core.text.evidence import Evidence
from diffusion_gr2.core.text.learned_analyst import (
    LearnedAnalyst,
    LearnedAnalystConfig,
    fit_learned_analyst,
    top_hits,
)
from diffusion_gr2.core.text.prompt import ItemLookup
from diffusion_gr2.core.text.traces import RerankExample
from tests.core.text.test_evidence import _info, _world


@pytest.fixture(scope="module")
def fitted() -> tuple[LearnedAnalyst, list[RerankExample]]:
    """The analyst fit on half of `_world`'s users; the other half (`valid`) are the requests."""
    table, examples = _world(200, seed=3)
    train = [e for e in examples if e.split == "train"]
    valid = [e for e in examples if e.split == "valid"]
    evidence = Evidence.fit(table, [(e.user_id, e.history, e.candidates) for e in train])
    lookup = ItemLookup({i: _info(i) for i in range(100)}, {_info(i).sid: i for i in range(100)})
    analyst, _ = fit_learned_analyst(evidence, lookup, train, valid, LearnedAnalystConfig(cs=(1.0,)))
    return analyst, valid


def _frames(examples: list[RerankExample]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The requests (no history, as `requests.parquet`) and the candidates frame that holds the
    histories, shuffled: rows are joined on (user, split, point), not matched by order."""
    candidates = pd.DataFrame(
        {
            "user_id": [e.user_id for e in examples],
            "split": "valid",
            "point": 0,
            "history": [list(e.history) for e in examples],
            "target": [e.target for e in examples],
            "candidates": [list(e.candidates) for e in examples],
        }
    )
    requests = candidates.drop(columns="history")
    return requests, candidates.sample(frac=1.0, random_state=0)


def test_the_analysts_r_at_1_is_top_hits_on_the_same_requests(fitted) -> None:
    analyst, valid = fitted
    requests, candidates = _frames(valid)
    rows = analyst_rows(requests, candidates, analyst.evidence, "valid")
    assert list(rows.columns) == list(RANKING_COLUMNS)
    assert rows["system"].eq("analyst").all() and rows["split"].eq("valid").all()
    assert rows["valid"].all() and rows["unforced"].all() and rows["tau"].isna().all()
    assert (rows["output_tokens"] == 0).all() and (rows["nfe"] == 0).all() and (rows["forced"] == 0).all()
    assert rows["ranking"].map(list).tolist() == rows["unforced_ranking"].map(list).tolist()
    assert rows["prerank"].map(list).tolist() == requests["candidates"].tolist()
    for ranking, example in zip(rows["ranking"], valid, strict=True):  # best first, ties by position
        order = np.argsort(-analyst.scores(example), kind="stable")
        assert list(ranking) == [example.candidates[k] for k in order]
    (row,) = stage_metrics(rows, n_boot=20)
    (floor,) = stage_metrics(prerank_rows(requests, "valid"), n_boot=20)
    assert row["recall@1"] == pytest.approx(float(top_hits(analyst, valid).mean()))
    assert row["recall@1"] > floor["recall@1"] + 0.3  # the evidence carries the signal
    assert row["valid_rate"] == row["unforced_rate"] == 1.0


def test_the_analyst_sits_beside_the_prerank_and_needs_its_ranker_and_the_histories(fitted) -> None:
    analyst, valid = fitted
    assert SYSTEMS[:2] == NO_MODEL_SYSTEMS == ("prerank", "analyst")  # report order
    requests, candidates = _frames(valid[:4])
    with pytest.raises(ValueError, match="2 requests have no row in the candidates frame"):
        analyst_rows(requests, candidates.iloc[2:], analyst.evidence, "valid")
    bare = Evidence(analyst.evidence.table, analyst.evidence.scale, None)
    with pytest.raises(ValueError, match="learned analyst's ranker"):
        analyst_rows(requests, candidates, bare, "valid")
