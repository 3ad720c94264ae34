"""Candidate lists for the re-ranker: the `candidates` frame of docs/architecture.md.

Rows: `train` from the last `train_prefixes` prefixes of each user's training part (target = the next
training item); `valid` and `test` predict each validation and test point from everything before it
(`evaluation.heldout_points`). `point` tells a user's rows of one split apart: the held-out point (0 =
earliest), the prefix length for train rows; with
(`split`, `user_id`) it is the request's key, on which systems are paired. Two modes
(docs/architecture.md#items-candidates-and-prompts):

* `retrieved`: the retriever's top-N with history masked, in retriever order (the pre-rank); a row is
  kept only when its target is in the top-N, as the Diffusion-GR2 / GR2 papers do.
* `sampled`: the target + N-1 seeded random negatives that are not in the history, shuffled.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from diffusion_gr2.core.retrieval.evaluation import ScoreFn, heldout_points, mask_history, top_n

logger = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
COLUMNS = ("user_id", "split", "point", "history", "target", "candidates", "target_position")


@dataclass(frozen=True)
class CandidateConfig:
    n: int = 10  # candidates per list (the papers use 10)
    mode: Literal["retrieved", "sampled"] = "retrieved"  # retriever top-N, or target + negatives
    train_prefixes: int = 20  # training rows per user: the last prefixes of the training part
    history_cap: int = 20  # most recent history items kept in the `history` column
    seed: int = 0  # fixes the sampled negatives and their shuffle
    score_chunk: int = 2048  # rows scored at once; bounds memory to chunk x catalog floats


@dataclass(frozen=True)
class CandidateSet:
    """The candidates frame plus, per split, the share of users with at least one kept row."""

    frame: pd.DataFrame
    users_kept: dict[str, float]


def candidate_requests(splits: pd.DataFrame, train_prefixes: int) -> pd.DataFrame:
    """One row per (split, user, point) to build a list for: `user_id, split, point, history (uncapped),
    target`, by split, then user, then point."""
    rows: list[tuple[int, str, int, list[int], int]] = []
    for user, train in zip(splits["user_id"], splits["train_items"], strict=True):
        train = [int(x) for x in train]
        # Prefixes need a non-empty history, so the first training item is never a target.
        for j in range(max(1, len(train) - train_prefixes), len(train)):
            rows.append((int(user), "train", j, train[:j], train[j]))
    held_out = [heldout_points(splits, split).assign(split=split) for split in ("valid", "test")]
    frame = pd.concat(
        [pd.DataFrame(rows, columns=["user_id", "split", "point", "history", "target"]), *held_out],
        ignore_index=True,
    )
    order = frame["split"].map({s: k for k, s in enumerate(SPLITS)})
    frame = frame.assign(_order=order).sort_values(["_order", "user_id", "point"], kind="stable")
    return frame.drop(columns="_order").reset_index(drop=True)


def retrieved_lists(histories: Sequence[list[int]], score_fn: ScoreFn, n: int, chunk: int) -> np.ndarray:
    """[rows, n] top-N item ids per history in retriever order, history masked (again, defensively).

    A row whose history leaves fewer than n other items gets -1 in the missing places, so it can never
    be kept with a history item in its list.
    """
    out = np.empty((len(histories), n), dtype=np.int64)
    for start in tqdm(
        range(0, len(histories), chunk), desc="retrieve", leave=False, disable=len(histories) <= chunk
    ):
        part = histories[start : start + chunk]
        scores = mask_history(np.array(score_fn(part), dtype=np.float32), part)  # [rows, i]
        top = top_n(scores, n)  # [rows, n]
        top[np.isneginf(np.take_along_axis(scores, top, axis=1))] = -1
        out[start : start + len(part)] = top
    return out


def sampled_list(
    history: list[int], target: int, n: int, num_items: int, rng: np.random.Generator
) -> list[int]:
    """Target + n-1 distinct random items outside the history, shuffled (rejection sampling)."""
    excluded = {*history, target}
    if num_items - len(excluded) < n - 1:
        raise ValueError(f"catalog of {num_items} items too small for {n - 1} negatives outside the history")
    negatives: list[int] = []
    while len(negatives) < n - 1:
        for item in rng.integers(0, num_items, size=2 * n).tolist():
            if item not in excluded and len(negatives) < n - 1:
                negatives.append(item)
                excluded.add(item)
    items = [target, *negatives]
    rng.shuffle(items)
    return items


def _positions(lists: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """[rows, n] lists, [rows] targets -> [rows] 1-based position of the target, 0 when absent."""
    hit = lists == targets[:, None]
    return np.where(hit.any(1), hit.argmax(1) + 1, 0)


def _lists_for_split(
    requests: pd.DataFrame,
    split_index: int,
    score_fn: ScoreFn | None,
    config: CandidateConfig,
    num_items: int,
) -> np.ndarray:
    """[rows, n] candidate lists for the requests of one split."""
    histories = requests["history"].tolist()
    if config.mode == "retrieved":
        if score_fn is None:
            raise ValueError("mode 'retrieved' needs a score_fn")
        return retrieved_lists(histories, score_fn, config.n, config.score_chunk)
    # One generator per split: valid/test lists do not change when train_prefixes does.
    rng = np.random.default_rng([config.seed, split_index])
    targets = requests["target"].tolist()
    return np.array(
        [sampled_list(h, t, config.n, num_items, rng) for h, t in zip(histories, targets, strict=True)],
        dtype=np.int64,
    ).reshape(len(histories), config.n)


def build_candidates(
    splits: pd.DataFrame, score_fn: ScoreFn | None, config: CandidateConfig, num_items: int
) -> CandidateSet:
    """Build the candidates frame (`user_id, split, point, history, target, candidates, target_position`).

    score_fn: histories -> [rows, num_items] scores (e.g. `lambda h: score_users(model, h)`); unused in
    `sampled` mode. The `history` column is the last `history_cap` items; the retriever sees the full one.
    """
    if config.mode not in ("retrieved", "sampled"):
        raise ValueError(f"mode must be 'retrieved' or 'sampled', got {config.mode!r}")
    requests = candidate_requests(splits, config.train_prefixes)
    parts, users_kept = [], {}
    for split_index, split in enumerate(SPLITS):
        req = requests[requests["split"] == split]
        lists = _lists_for_split(req, split_index, score_fn, config, num_items)
        positions = _positions(lists, req["target"].to_numpy(dtype=np.int64))
        part = pd.DataFrame(
            {
                "user_id": req["user_id"].to_numpy(dtype=np.int64),
                "split": split,
                "point": req["point"].to_numpy(dtype=np.int64),
                "history": [
                    list(h[-config.history_cap :]) if config.history_cap > 0 else [] for h in req["history"]
                ],
                "target": req["target"].to_numpy(dtype=np.int64),
                "candidates": [row.tolist() for row in lists],
                "target_position": positions.astype(np.int64),
            }
        )
        complete = np.array([-1 not in c for c in part["candidates"]], dtype=bool)
        kept = part[(part["target_position"] > 0) & complete]
        users_kept[split] = kept["user_id"].nunique() / max(part["user_id"].nunique(), 1)
        parts.append(kept)
        logger.info(
            "candidates %s (%s): kept %d of %d rows, %.1f%% of users",
            split,
            config.mode,
            len(kept),
            len(part),
            100 * users_kept[split],
        )
    frame = pd.concat(parts, ignore_index=True)[list(COLUMNS)]
    return CandidateSet(frame, users_kept)
