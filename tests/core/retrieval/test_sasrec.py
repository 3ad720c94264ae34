"""SASRec retriever: learns a sequential pattern, never proposes history items, is deterministic."""

from __future__ import annotations

import numpy as np
import pytest

from diffusion_gr2.core.retrieval.evaluation import (
    evaluate_test,
    histories_before_test,
    popularity_counts,
    popularity_scorer,
    top_n,
)
from diffusion_gr2.core.retrieval.sasrec import (
    RetrieverConfig,
    batch_tensors,
    epoch_batches,
    score_users,
    train_retriever,
    training_windows,
)

from .conftest import cyclic_splits

TINY = RetrieverConfig(
    dim=32, heads=2, blocks=1, max_len=8, dropout=0.1, lr=1e-2, batch_size=64, max_epochs=25
)


@pytest.fixture(scope="module")
def trained():
    splits = cyclic_splits(num_users=150, num_items=40, min_len=6, max_len=14)
    return splits, train_retriever(splits, 40, TINY)


def test_learns_a_sequential_pattern_and_beats_popularity(trained) -> None:
    splits, result = trained
    model_metrics = evaluate_test(lambda h: score_users(result.model, h), splits, k=10)
    pop_metrics = evaluate_test(popularity_scorer(popularity_counts(splits, 40)), splits, k=10)
    assert model_metrics["recall@10"] > 0.9 and model_metrics["ndcg@10"] > 0.7
    assert model_metrics["recall@10"] > pop_metrics["recall@10"] + 0.3
    assert result.valid_recall == max(c["valid_recall@10"] for c in result.curve)
    assert result.best_epoch <= len(result.curve)


def test_never_proposes_a_history_item(trained) -> None:
    splits, result = trained
    histories = histories_before_test(splits)
    histories[0] = list(range(30))  # longer than max_len: items it cannot see are still masked
    scores = score_users(result.model, histories)
    assert scores.shape == (len(histories), 40) and scores.dtype == np.float32
    for history, row, top in zip(histories, scores, top_n(scores, 10), strict=True):
        assert np.isneginf(row[history]).all()
        assert not set(top.tolist()) & set(history)


def test_training_is_deterministic_under_a_seed() -> None:
    splits = cyclic_splits(num_users=30, num_items=20, min_len=5, max_len=9)
    config = RetrieverConfig(dim=16, blocks=1, max_len=6, batch_size=16, max_epochs=2, patience=5)
    a, b = train_retriever(splits, 20, config), train_retriever(splits, 20, config)
    assert a.curve == b.curve
    histories = histories_before_test(splits)
    np.testing.assert_array_equal(score_users(a.model, histories), score_users(b.model, histories))


def test_training_windows_cover_every_target_once() -> None:
    history = list(range(10))
    windows = training_windows([history], max_len=4)
    targets = [t for w, skip in windows for t in w[1 : len(w) - skip]]
    assert sorted(targets) == list(range(1, 10))
    assert all(len(w) == 5 for w, _ in windows)  # the oldest window is full length, with a skip
    assert windows[0] == ([5, 6, 7, 8, 9], 0) and windows[-1] == ([0, 1, 2, 3, 4], 3)
    assert training_windows([[3, 4, 5]], max_len=4) == [([3, 4, 5], 0)]


def test_batches_mask_skipped_targets_and_group_lengths() -> None:
    windows = [([1, 2, 3], 0), ([4, 5, 6, 7], 2), ([8, 9], 0)]
    inputs, targets = batch_tensors(windows)
    assert inputs.tolist() == [[0, 2, 3], [5, 6, 7], [0, 0, 9]]  # tokens are ids + 1, left-padded
    assert targets.tolist() == [[-1, 2, 3], [5, -1, -1], [-1, -1, 9]]
    batches = epoch_batches(np.array([5, 2, 5, 2, 5, 2]), batch_size=3, rng=np.random.default_rng(0))
    assert sorted(sorted(b.tolist()) for b in batches) == [[0, 2, 4], [1, 3, 5]]
