"""Full-catalog evaluation of first-stage retrievers, the popularity baseline, and history masking.

Shapes: `u` users, `i` items in the catalog. Every scorer here returns [u, i] scores in which the
user's history items are -inf, so no retriever can ever propose an item the user already has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
import pandas as pd

from diffusion_gr2.core.evaluate.metrics import ndcg_at_k, recall_at_k, target_ranks

ScoreFn = Callable[[Sequence[Sequence[int]]], np.ndarray]  # histories -> [u, i] scores, history at -inf


def histories_before_valid(splits: pd.DataFrame) -> list[list[int]]:
    """Per user, the training part (chronological): the history that predicts validation point 0."""
    return [[int(x) for x in items] for items in splits["train_items"]]


def histories_before_test(splits: pd.DataFrame) -> list[list[int]]:
    """Per user, train part + every validation point: the history that predicts test point 0."""
    return [
        h + [int(v) for v in valid]
        for h, valid in zip(histories_before_valid(splits), splits["valid_items"], strict=True)
    ]


def heldout_points(splits: pd.DataFrame, split: Literal["valid", "test"] = "test") -> pd.DataFrame:
    """Every held-out point of `split`: `user_id, point, history, target`, by user then point (0 =
    earliest).

    Point k's history is everything the user did before it: the train part and points 0..k-1 (for a
    test point also every validation point) -- what a server would have seen, none of it trained on.
    """
    if split not in ("valid", "test"):
        raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
    befores = histories_before_valid(splits) if split == "valid" else histories_before_test(splits)
    rows = [
        (int(user), k, [*before, *map(int, points[:k])], int(points[k]))
        for user, before, points in zip(splits["user_id"], befores, splits[f"{split}_items"], strict=True)
        for k in range(len(points))
    ]
    return pd.DataFrame(rows, columns=["user_id", "point", "history", "target"])


def mask_history(scores: np.ndarray, histories: Sequence[Sequence[int]]) -> np.ndarray:
    """Set scores[u, item] = -inf for every item in user u's history; scores: [u, i] float, in place."""
    lengths = np.fromiter((len(h) for h in histories), dtype=np.int64, count=len(histories))
    rows = np.repeat(np.arange(len(histories)), lengths)
    cols = np.fromiter((int(x) for h in histories for x in h), dtype=np.int64, count=int(lengths.sum()))
    scores[rows, cols] = -np.inf
    return scores


def popularity_counts(splits: pd.DataFrame, num_items: int) -> np.ndarray:
    """[i] interaction counts over the training parts only (validation/test items are never counted)."""
    items = np.fromiter((int(x) for h in splits["train_items"] for x in h), dtype=np.int64)
    return np.bincount(items, minlength=num_items).astype(np.float32)


def popularity_scorer(counts: np.ndarray) -> ScoreFn:
    """A ScoreFn that ranks by training popularity, history masked."""

    def score(histories: Sequence[Sequence[int]]) -> np.ndarray:
        scores = np.tile(counts.astype(np.float32), (len(histories), 1))  # [u, i]
        return mask_history(scores, histories)

    return score


def top_n(scores: np.ndarray, n: int) -> np.ndarray:
    """[u, i] -> [u, n] item ids in descending score order (ties by lower id, as in `target_ranks`)."""
    return np.argsort(-scores, axis=1, kind="stable")[:, :n]


def recall_ndcg(ranks: np.ndarray, k: int) -> dict[str, float]:
    """Recall@k and NDCG@k with one relevant item per user (the one metrics module computes them)."""
    return {
        f"recall@{k}": float(recall_at_k(ranks, k).mean()),
        f"ndcg@{k}": float(ndcg_at_k(ranks, k).mean()),
    }


def evaluate_scorer(
    score_fn: ScoreFn, histories: Sequence[Sequence[int]], targets: np.ndarray, k: int = 10
) -> dict[str, float]:
    """Full-catalog Recall@k / NDCG@k of `score_fn` for the given histories and held-out targets."""
    scores = score_fn(histories)
    return recall_ndcg(target_ranks(scores, np.asarray(targets, dtype=np.int64)), k)


def evaluate_test(score_fn: ScoreFn, splits: pd.DataFrame, k: int = 10) -> dict[str, float]:
    """Metrics over every test point, each with everything before it as history (`heldout_points`)."""
    points = heldout_points(splits)
    return evaluate_scorer(score_fn, points["history"].tolist(), points["target"].to_numpy(), k)


def retrieval_report(
    retriever: dict[str, float],
    popularity: dict[str, float],
    candidate_mode: str,
    users_kept: dict[str, float],
) -> dict:
    """The `retrieval_report.json` object of docs/architecture.md (exact keys)."""
    return {
        "retriever": dict(retriever),
        "popularity": dict(popularity),
        "candidate_mode": candidate_mode,
        "users_kept": dict(users_kept),
    }
