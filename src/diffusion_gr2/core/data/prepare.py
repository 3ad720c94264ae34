"""From a `RawDataset` to the validated frames every later stage reads (docs/architecture.md#data,
"Preparation").

Order of operations: optional rating filter (off by default) → stable chronological sort (ties keep
file order) → drop repeated (user, item) pairs keeping the earliest → iterative k-core on users and
items → remap ids (items with a seeded shuffle) → hold-out split (the last `test_points` interactions
of each user are test requests, the `valid_points` before them validation, the rest train) → schema
validation → statistics.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pandas as pd

from diffusion_gr2.core.data.raw import RawDataset, check_reject_share
from diffusion_gr2.core.data.schemas import interactions_schema, items_schema, splits_schema, validate

logger = logging.getLogger(__name__)

__all__ = [
    "PrepConfig",
    "PreparedData",
    "data_stats",
    "k_core_mask",
    "leave_one_out",
    "prepare",
    "remap_items",
    "points_per_user",
    "valid_points_per_user",
]

# The `data_prep` keys that name what is read, not how it is prepared (`prepare_dataset` reads them).
READ_KEYS = frozenset({"dataset", "raw_root"})
MIN_USER_INTERACTIONS = 3  # leave-one-out needs one train, one validation and one test interaction


@dataclass(frozen=True)
class PrepConfig:
    """Preparation parameters (defaults reproduce the papers' Beauty statistics)."""

    dedup: bool = True  # drop repeated (user, item) pairs, keeping the earliest
    k_core: int = 5  # iterative: every kept user and item has >= k interactions
    history_cap: int = 20  # max history length shown downstream (candidates, prompts); splits stay uncapped
    seed: int = 42  # seeds the item-id shuffle
    max_reject_share: float | None = 0.05  # per raw file; above it preparation stops (None: never)
    min_rating: float | None = None  # keep only ratings >= this; None = no rating filter (the default)
    test_points: int = 1  # last interactions of each user held out as test requests (1 = leave-one-out)
    valid_points: int = 1  # interactions before the test points held out as validation requests

    def __post_init__(self) -> None:
        for name in ("test_points", "valid_points"):
            if getattr(self, name) < 1:
                raise ValueError(f"data_prep.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> PrepConfig:
        """From `params["data_prep"]`; the reader's keys (`READ_KEYS`) are skipped, any other key this
        class does not hold is refused (a typo would otherwise leave a setting at its default).

        A key left out keeps its default above: the preparation of docs/architecture.md#data, which conf/base
        states in full (there with 7 test and validation points per user, not leave-one-out).
        """
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(params) - names - READ_KEYS)
        if unknown:
            raise ValueError(f"data_prep: unknown keys {unknown} (its settings: {sorted(names | READ_KEYS)})")
        return cls(**{key: value for key, value in params.items() if key in names})


@dataclass(frozen=True)
class PreparedData:
    """Validated outputs of `prepare` (frames as in docs/architecture.md) and ``data_stats.json``."""

    interactions: pd.DataFrame
    items: pd.DataFrame
    splits: pd.DataFrame
    stats: dict[str, Any]


def rating_filter(frame: pd.DataFrame, min_rating: float | None, source: str) -> pd.DataFrame:
    """Keep interactions rated >= ``min_rating`` (all of them when None; unrated rows fail a set bound).

    A filter that cannot work (no ratings at all) or keeps nothing stops here, naming the filter, so
    the error does not surface later as an empty k-core.
    """
    if min_rating is None:
        return frame
    rated = frame["rating"].notna()
    if not rated.any():
        raise ValueError(
            f"{source}: data_prep.min_rating={min_rating} is set but none of the {len(frame)} interactions "
            "has a rating; set data_prep.min_rating: null for data without ratings"
        )
    kept = frame[frame["rating"] >= min_rating]
    if kept.empty:
        low, high = frame["rating"].min(), frame["rating"].max()
        raise ValueError(
            f"{source}: data_prep.min_rating={min_rating} keeps none of the {len(frame)} interactions "
            f"(ratings range {low}..{high})"
        )
    logger.info(
        "rating filter (>= %s) dropped %d rows (%d of them unrated)",
        min_rating,
        len(frame) - len(kept),
        int((~rated).sum()),
    )
    return kept


def chronological_dedup(frame: pd.DataFrame, dedup: bool) -> pd.DataFrame:
    """Sort by time (stable: ties keep file order) and optionally keep the first of repeated pairs.

    ``order`` (the row's position in the raw files) is added to break timestamp ties later on.
    """
    frame = frame.assign(order=np.arange(len(frame), dtype=np.int64))
    frame = frame.sort_values("timestamp", kind="stable")
    if dedup:
        before = len(frame)
        frame = frame.drop_duplicates(["raw_user_id", "raw_item_id"], keep="first")
        logger.info("dedup dropped %d repeated (user, item) rows", before - len(frame))
    return frame


def k_core_mask(users: np.ndarray, items: np.ndarray, k_user: int, k_item: int) -> np.ndarray:
    """Rows that survive iterative k-core filtering: users with >= k_user and items with >= k_item rows.

    ``users``/``items``: [n] integer codes. Repeats until nothing changes, because dropping a sparse
    item can push a user below the threshold and vice versa.
    """
    keep = np.ones(len(users), dtype=bool)
    for rounds in range(1, len(users) + 2):
        user_counts = np.bincount(users[keep], minlength=users.max(initial=-1) + 1)
        item_counts = np.bincount(items[keep], minlength=items.max(initial=-1) + 1)
        new_keep = keep & (user_counts[users] >= k_user) & (item_counts[items] >= k_item)
        if new_keep.sum() == keep.sum():
            logger.info("k-core converged after %d round(s)", rounds)
            break
        keep = new_keep
    return keep


def apply_k_core(frame: pd.DataFrame, k: int) -> pd.DataFrame:
    """Iterative k-core on ``raw_user_id``/``raw_item_id``; users also need enough rows to split."""
    users = pd.factorize(frame["raw_user_id"])[0]
    items = pd.factorize(frame["raw_item_id"])[0]
    keep = k_core_mask(users, items, max(k, MIN_USER_INTERACTIONS), k)
    logger.info("k-core (k=%d) kept %d of %d interactions", k, int(keep.sum()), len(frame))
    return frame[keep]


def remap_items(raw_ids: pd.Series, seed: int) -> dict[str, int]:
    """Raw item id → 0..I-1 by a seeded shuffle of the sorted raw ids.

    A shuffle rather than numbering in order of appearance: consecutive ids along user histories leak
    the next item to a model that reads ids (a known flaw of public pipelines: docs/architecture.md#data).
    Sorting first makes the mapping independent of row order.
    """
    ordered = np.sort(raw_ids.unique().astype(str))
    permutation = np.random.default_rng(seed).permutation(len(ordered))
    return dict(zip(ordered.tolist(), permutation.tolist(), strict=True))


def remap_users(raw_ids: pd.Series) -> dict[str, int]:
    """Raw user id → 0..U-1 in sorted raw-id order (deterministic, independent of row order)."""
    ordered = np.sort(raw_ids.unique().astype(str))
    return {raw: index for index, raw in enumerate(ordered.tolist())}


def remapped_interactions(frame: pd.DataFrame, users: dict[str, int], items: dict[str, int]) -> pd.DataFrame:
    """The ``interactions`` frame: integer ids, sorted by user then time, ties by file order."""
    out = pd.DataFrame(
        {
            "user_id": frame["raw_user_id"].map(users).to_numpy(np.int64),
            "item_id": frame["raw_item_id"].map(items).to_numpy(np.int64),
            "timestamp": frame["timestamp"].to_numpy(np.int64),
            "rating": frame["rating"].to_numpy(np.float64),
        }
    )
    order = np.lexsort((frame["order"].to_numpy(), out["timestamp"].to_numpy(), out["user_id"].to_numpy()))
    return out.iloc[order].reset_index(drop=True)


def catalogue(raw: RawDataset, items: dict[str, int]) -> pd.DataFrame:
    """The ``items`` frame for the kept items, by item id; empty text fields when there is no metadata."""
    kept = pd.DataFrame({"raw_item_id": list(items), "item_id": np.fromiter(items.values(), np.int64)})
    if raw.has_metadata:
        frame = kept.merge(raw.items, on="raw_item_id", how="left", validate="one_to_one")
    else:
        logger.warning("%s has no item metadata: titles, categories and descriptions are empty", raw.source)
        frame = kept.assign(title="", brand="", price=np.nan, description="")
        frame["categories"] = [[] for _ in range(len(frame))]
    columns = ["item_id", "raw_item_id", "title", "categories", "brand", "price", "description"]
    return frame[columns].sort_values("item_id").reset_index(drop=True)


def points_per_user(lengths: np.ndarray, test_points: int) -> np.ndarray:
    """[u] interactions per user -> [u] test points per user: min(test_points, n - 2).

    The rule for short users: every user keeps at least one train and one validation interaction, so a
    user with fewer than test_points + 2 interactions gives fewer test points (counted in `data_stats`).
    """
    return np.minimum(int(test_points), np.asarray(lengths, dtype=np.int64) - 2)


def valid_points_per_user(lengths: np.ndarray, test_points: int, valid_points: int) -> np.ndarray:
    """[u] interactions per user -> [u] validation points per user: min(valid_points, n - t - 1),
    t = `points_per_user`.

    Test points are taken first, so the reported split does not depend on `valid_points`; validation
    takes what is left but one, so every user keeps at least one train interaction (and, since
    t <= n - 2, at least one validation point). Users short of `valid_points` are counted in
    `data_stats`.
    """
    n = np.asarray(lengths, dtype=np.int64)
    return np.minimum(int(valid_points), n - points_per_user(n, test_points) - 1)


def leave_one_out(interactions: pd.DataFrame, test_points: int = 1, valid_points: int = 1) -> pd.DataFrame:
    """The ``splits`` frame: per user, the last t = `points_per_user` interactions are test points,
    the v = `valid_points_per_user` before them validation points, the rest train.

    ``test_items``/``test_timestamps`` hold the t test points in time order, ``valid_items``/
    ``valid_timestamps`` the v validation points. Each point is asked with the history a server would
    have had (everything before it): validation point k's history is the train part + validation
    points 0..k-1, test point k's the train part + every validation point + test points 0..k-1; no
    model trains on a held-out point. ``valid_item``/``test_item`` (and their timestamps) are point 0
    of each: with ``test_points=1, valid_points=1`` this is leave-one-out, column for column.
    ``interactions`` must be sorted by user then time with >= 3 rows per user.
    """
    users = interactions["user_id"].to_numpy()
    items = interactions["item_id"].to_numpy()
    times = interactions["timestamp"].to_numpy()
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if len(users) else np.array([], int)
    ends = np.r_[starts[1:], len(users)].astype(int)
    lengths = ends - starts
    firsts = ends - points_per_user(lengths, test_points)  # [u] index of each user's test point 0
    valids = firsts - valid_points_per_user(lengths, test_points, valid_points)  # [u] validation point 0
    spans = list(zip(starts, valids, firsts, ends, strict=True))
    return pd.DataFrame(
        {
            "user_id": users[starts].astype(np.int64),
            "train_items": [items[s:v].tolist() for s, v, _, _ in spans],
            "train_timestamps": [times[s:v].tolist() for s, v, _, _ in spans],
            "valid_item": items[valids].astype(np.int64),
            "valid_timestamp": times[valids].astype(np.int64),
            "valid_items": [items[v:f].tolist() for _, v, f, _ in spans],
            "valid_timestamps": [times[v:f].tolist() for _, v, f, _ in spans],
            "test_item": items[firsts].astype(np.int64),
            "test_timestamp": times[firsts].astype(np.int64),
            "test_items": [items[f:e].tolist() for _, _, f, e in spans],
            "test_timestamps": [times[f:e].tolist() for _, _, f, e in spans],
        }
    )


def data_stats(
    raw: RawDataset, interactions: pd.DataFrame, num_items: int, test_points: int = 1, valid_points: int = 1
) -> dict[str, Any]:
    """``data_stats.json``: the keys of docs/architecture.md#names-and-report-files as plain Python numbers,
    plus ``test_points`` and ``valid_points`` (points asked per user, and how many users had too few
    interactions to give them all); ``splits`` counts interactions, so validation and test count held-out
    points."""
    lengths = interactions.groupby("user_id").size()
    n_users, n_rows = int(lengths.size), len(interactions)
    points = points_per_user(lengths.to_numpy(), test_points)
    valids = valid_points_per_user(lengths.to_numpy(), test_points, valid_points)
    n_test, n_valid = int(points.sum()), int(valids.sum())
    return {
        "users": n_users,
        "items": int(num_items),
        "interactions": int(n_rows),
        "mean_history": round(float(lengths.mean()), 4) if n_users else 0.0,
        "median_history": float(lengths.median()) if n_users else 0.0,
        "splits": {"train": n_rows - n_valid - n_test, "valid": n_valid, "test": n_test},
        "test_points": {"per_user": int(test_points), "users_with_fewer": int((points < test_points).sum())},
        "valid_points": {
            "per_user": int(valid_points),
            "users_with_fewer": int((valids < valid_points).sum()),
        },
        "rows_read": int(raw.rows_read),
        "rows_rejected": len(raw.rejects),
        "rejected_by_reason": raw.rejected_by_reason(),
    }


def prepare(raw: RawDataset, config: PrepConfig | None = None) -> PreparedData:
    """Optional rating filter, dedup, iterative k-core, chronological sort, seeded remap, hold-out
    split (`test_points`, `valid_points`), schema validation; see the module docstring for the order."""
    config = config or PrepConfig()
    check_reject_share(raw, config.max_reject_share)
    if raw.interactions.empty:
        raise ValueError(
            f"{raw.source}: no valid interaction rows were read ({raw.rows_read} read, {len(raw.rejects)} "
            f"rejected: {raw.rejected_by_reason()})"
        )
    filtered = rating_filter(raw.interactions, config.min_rating, raw.source)
    frame = chronological_dedup(filtered, config.dedup)
    frame = apply_k_core(frame, config.k_core)
    if frame.empty:
        raise ValueError(f"{raw.source}: no interactions left after {config.k_core}-core filtering")
    item_map = remap_items(frame["raw_item_id"], config.seed)
    interactions = remapped_interactions(frame, remap_users(frame["raw_user_id"]), item_map)
    num_items = len(item_map)
    interactions = validate(interactions, interactions_schema(num_items, config.dedup), "interactions")
    items = validate(catalogue(raw, item_map), items_schema(num_items), "items")
    splits = leave_one_out(interactions, config.test_points, config.valid_points)
    splits = validate(splits, splits_schema(num_items, not config.dedup), "splits")
    stats = data_stats(raw, interactions, num_items, config.test_points, config.valid_points)
    logger.info("prepared %s: %s", raw.source, stats)
    return PreparedData(interactions=interactions, items=items, splits=splits, stats=stats)
