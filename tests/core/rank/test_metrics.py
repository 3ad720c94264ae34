"""Ranking metrics and bootstrap intervals against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from diffusion_gr2.core.rank import metrics as M
from diffusion_gr2.core.rank.rerank import stage_metrics

PRE = [10, 11, 12, 13, 14, 15]
ROWS = [
    {"target": 10, "ranking": [10, 11, 12, 13, 14, 15], "valid": True},  # rank 1
    {"target": 12, "ranking": [11, 10, 12, 13, 14, 15], "valid": True},  # rank 3
    {"target": 15, "ranking": PRE, "valid": False},  # invalid -> pre-rank fallback, rank 6
    {"target": 13, "ranking": [11, 13, 10, 12, 14, 15], "valid": True},  # rank 2
]


def test_per_user_metrics_by_hand() -> None:
    ranks = [1, 3, 6, 2, 0]  # 0 = target absent
    assert M.recall_at_k(ranks, 3).tolist() == [1, 1, 0, 1, 0]
    assert M.ndcg_at_k(ranks, 3) == pytest.approx([1.0, 0.5, 0.0, 1 / math.log2(3), 0.0])
    assert M.reciprocal_rank(ranks) == pytest.approx([1.0, 1 / 3, 1 / 6, 0.5, 0.0])
    assert M.target_rank([5, 6, 7], 7) == 3 and M.target_rank([5, 6], 7) == 0 and M.target_rank(None, 7) == 0


def test_system_metrics_by_hand() -> None:
    out = M.system_metrics(ROWS, n_boot=200, seed=1)
    expected = {
        "recall@1": 0.25, "recall@3": 0.75, "recall@5": 0.75,
        "ndcg@3": (1 + 0.5 + 1 / math.log2(3)) / 4, "ndcg@5": (1 + 0.5 + 1 / math.log2(3)) / 4,
        "mrr": (1 + 1 / 3 + 1 / 6 + 1 / 2) / 4, "valid_rate": 0.75, "fallback_rate": 0.25,
    }  # fmt: skip
    assert out["n"] == 4
    for key, value in expected.items():
        assert out[key] == pytest.approx(value), key
        low, high = out["ci"][key]
        assert low <= value + 1e-12 and value - 1e-12 <= high
    assert set(out["ci"]) == set(M.METRICS)
    assert M.system_metrics(pd.DataFrame(ROWS), n_boot=200, seed=1) == out  # frame or rows, same result


def test_grammar_corrected_answers_count_as_unforced_failures_and_unforced_fallbacks() -> None:
    # Served by a constrained decoder: all valid; the second and third were corrected by the grammar.
    rows = [
        {"target": 11, "ranking": [11, 10, 12], "prerank": [10, 11, 12], "valid": True, "forced": 0},
        {"target": 10, "ranking": [12, 10, 11], "prerank": [10, 11, 12], "valid": True, "forced": 2},
        {"target": 12, "ranking": [12, 10, 11], "prerank": [10, 11, 12], "valid": True, "forced": 1},
    ]
    out = M.system_metrics(rows, n_boot=10)
    assert out["valid_rate"] == 1.0 and out["fallback_rate"] == 0.0
    assert out["unforced_rate"] == pytest.approx(1 / 3)
    assert out["recall@1"] == pytest.approx(2 / 3)  # rows 1 and 3, as served
    # Serving only unforced answers, rows 2 and 3 get the pre-rank: rows 1 (model) and 2 (pre-rank) hit.
    assert out["recall@1_unforced"] == pytest.approx(2 / 3)
    rows[1]["target"] = 11  # now the pre-rank misses row 2 as well
    assert M.system_metrics(rows, n_boot=10)["recall@1_unforced"] == pytest.approx(1 / 3)
    unconstrained = [dict(r, forced=0) for r in rows[:1]]  # no `forced` -> free decoding: rates agree
    assert M.system_metrics(unconstrained, n_boot=10)["unforced_rate"] == 1.0


def test_missing_ranking_falls_back_to_prerank() -> None:
    rows = [{"target": 12, "ranking": None, "prerank": PRE, "valid": False}]
    out = M.system_metrics(rows, n_boot=10)
    assert out["recall@3"] == 1.0 and out["mrr"] == pytest.approx(1 / 3) and out["fallback_rate"] == 1.0


def test_bootstrap_matches_loop_reference_and_is_seeded(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {"x": np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.2]), "y": np.arange(7.0)}
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 7, size=(300, 7))
    ref_x = np.percentile([values["x"][row].mean() for row in idx], [2.5, 97.5])
    monkeypatch.setattr(M, "_CHUNK_ELEMENTS", 20)  # force several chunks: same draws as one shot
    ci = M.bootstrap_ci(values, n_boot=300, seed=3)
    assert ci["x"] == pytest.approx(list(ref_x))
    assert ci == M.bootstrap_ci(values, n_boot=300, seed=3)
    assert ci != M.bootstrap_ci(values, n_boot=300, seed=4)
    assert M.bootstrap_ci({"c": np.full(9, 0.4)})["c"] == pytest.approx([0.4, 0.4])


def test_paired_bootstrap() -> None:
    a = np.array([1.0, 0.0, 1.0, 1.0] * 10)
    b = np.array([0.0, 0.0, 1.0, 0.0] * 10)
    res = M.paired_bootstrap(a, b, n_boot=500, seed=0)
    assert res.mean_diff == pytest.approx(0.5) and 0 < res.low <= 0.5 <= res.high and res.p_value == 0.0
    same = M.paired_bootstrap(a, a)
    assert (same.mean_diff, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    noisy = M.paired_bootstrap([1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], n_boot=500)
    assert noisy.p_value > 0.5 and noisy.low < 0 < noisy.high
    with pytest.raises(ValueError):
        M.paired_bootstrap([1.0], [1.0, 0.0])


def test_full_catalog_ranks_and_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    scores = np.array([[0.9, 0.1, 0.5], [0.2, 0.2, 0.2], [-np.inf, 0.3, 0.3]])
    targets = [2, 1, 1]
    assert M.target_ranks(scores, targets).tolist() == [2, 2, 1]  # ties broken by item index
    assert M.recall_ndcg_at_k(scores, targets, 1) == pytest.approx({"recall@1": 1 / 3, "ndcg@1": 1 / 3})
    two = M.recall_ndcg_at_k(torch.tensor(scores), targets, 2)
    assert two == pytest.approx({"recall@2": 1.0, "ndcg@2": (2 / math.log2(3) + 1) / 3})
    big = np.random.default_rng(0).normal(size=(50, 40))
    tg = np.random.default_rng(1).integers(0, 40, size=50)
    full = M.target_ranks(big, tg)
    monkeypatch.setattr(M, "_CHUNK_ELEMENTS", 100)  # several user chunks give the same ranks
    assert M.target_ranks(big, tg).tolist() == full.tolist()
    assert full.tolist() == [int((big[u] > big[u, t]).sum()) + 1 for u, t in enumerate(tg)]


def test_stage_metrics_rows() -> None:
    frame = pd.DataFrame(
        [{**r, "system": "cft", "tau": 0.9} for r in ROWS] + [{**ROWS[0], "system": "prerank", "tau": 1.0}]
    )
    rows = stage_metrics(frame, n_boot=50)  # no split / window columns: test, whole block
    assert [(r["system"], r["tau"], r["n"]) for r in rows] == [("cft", 0.9, 4), ("prerank", 1.0, 1)]
    assert all(r["split"] == "test" and r["window"] is None for r in rows)
    assert rows[0]["recall@1"] == 0.25 and set(rows[1]["ci"]) == set(M.METRICS)
