"""Full-catalog metrics, history masking and the popularity baseline."""

from __future__ import annotations

import numpy as np
import pandas as pd

from diffusion_gr2.core.retrieval.evaluation import (
    evaluate_test,
    histories_before_test,
    mask_history,
    popularity_counts,
    popularity_scorer,
    recall_ndcg,
    target_ranks,
    top_n,
)


def test_target_ranks_match_a_plain_loop_and_top_n_order() -> None:
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, size=(30, 12)).astype(np.float32)  # many ties on purpose
    targets = rng.integers(0, 12, size=30)
    ranks = target_ranks(scores, targets)
    order = top_n(scores, 12)
    for u in range(30):
        assert ranks[u] == list(order[u]).index(targets[u]) + 1
        assert ranks[u] == 1 + sum(
            s > scores[u, targets[u]] or (s == scores[u, targets[u]] and i < targets[u])
            for i, s in enumerate(scores[u])
        )


def test_recall_and_ndcg_values() -> None:
    metrics = recall_ndcg(np.array([1, 3, 11]), k=10)
    assert metrics["recall@10"] == 2 / 3
    assert np.isclose(metrics["ndcg@10"], (1.0 + 1.0 / np.log2(4)) / 3)


def test_mask_history_sets_every_history_item_to_minus_inf() -> None:
    scores = np.zeros((2, 5), dtype=np.float32)
    mask_history(scores, [[0, 3], []])
    assert np.isneginf(scores[0, [0, 3]]).all() and np.isfinite(scores[0, [1, 2, 4]]).all()
    assert np.isfinite(scores[1]).all()


def test_popularity_counts_train_parts_only_and_never_proposes_history() -> None:
    splits = pd.DataFrame(
        {
            "user_id": [0, 1],
            "train_items": [[0, 1], [1, 2]],
            "valid_item": [3, 3],
            "valid_items": [[3], [3]],
            "test_item": [4, 0],
            "test_items": [[4], [0]],
        }
    )
    counts = popularity_counts(splits, num_items=5)
    np.testing.assert_array_equal(counts, [1, 2, 1, 0, 0])
    scores = popularity_scorer(counts)(histories_before_test(splits))
    assert np.isneginf(scores[0, [0, 1, 3]]).all() and np.isneginf(scores[1, [1, 2, 3]]).all()
    # user 1: the test item 0 is the most popular item outside the history
    assert target_ranks(scores, np.array([4, 0]))[1] == 1
    assert evaluate_test(popularity_scorer(counts), splits, k=1)["recall@1"] == 0.5
