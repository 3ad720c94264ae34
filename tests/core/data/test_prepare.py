"""prepare(): dedup, k-core, chronological order, seeded remap, leave-one-out — and ml-100k's statistics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusion_gr2.core.data.prepare import PrepConfig, data_stats, k_core_mask, prepare, remap_items
from diffusion_gr2.core.data.raw import DataQualityError, RawDataset, Rejects, build_raw_dataset
from diffusion_gr2.core.data.readers import read_dataset

MakeRaw = Callable[..., RawDataset]
# few users and items so that most examples survive the k-core filter
rows_strategy = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(0, 30)), min_size=10, max_size=80
)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def test_ml100k_statistics(tmp_path: Path) -> None:
    raw = read_dataset("ml-100k", tmp_path)
    prepared = prepare(raw, PrepConfig())
    stats = prepared.stats
    assert set(stats) == {
        "users", "items", "interactions", "mean_history", "median_history", "splits", "test_points",
        "valid_points", "rows_read", "rows_rejected", "rejected_by_reason",
    }  # fmt: skip
    assert (stats["users"], stats["items"], stats["interactions"]) == (943, 1349, 99287)
    assert stats["splits"] == {"train": 99287 - 2 * 943, "valid": 943, "test": 943}
    assert stats["test_points"] == stats["valid_points"] == {"per_user": 1, "users_with_fewer": 0}
    # the default run's split (conf/base: 7 + 7): every ml-100k user has >= 19 interactions, none short
    base = data_stats(raw, prepared.interactions, 1349, 7, 7)
    assert base["splits"] == {"train": 99287 - 14 * 943, "valid": 7 * 943, "test": 7 * 943}
    assert base["valid_points"] == {"per_user": 7, "users_with_fewer": 0}
    assert stats["mean_history"] == pytest.approx(99287 / 943, abs=1e-4)
    assert stats["rows_read"] == 100000 + 1682 and stats["rows_rejected"] == 0
    assert len(prepared.items) == 1349 and len(prepared.splits) == 943
    toy_story = prepared.items.set_index("raw_item_id").loc["1"]
    assert toy_story["title"] == "Toy Story" and "Animation" in toy_story["categories"]


def _reference_k_core(pairs: list[tuple[int, int]], k_user: int, k_item: int) -> list[bool]:
    """Plain-loop iterative k-core to check the vectorised one against."""
    keep = [True] * len(pairs)
    changed = True
    while changed:
        users = Counter(u for (u, _), kept in zip(pairs, keep, strict=True) if kept)
        items = Counter(i for (_, i), kept in zip(pairs, keep, strict=True) if kept)
        new = [
            kept and users[u] >= k_user and items[i] >= k_item
            for (u, i), kept in zip(pairs, keep, strict=True)
        ]
        changed, keep = new != keep, new
    return keep


@FAST
@given(rows=rows_strategy, k=st.integers(1, 4))
def test_k_core_property(rows: list[tuple[int, int, int]], k: int) -> None:
    pairs = [(u, i) for u, i, _ in rows]
    users = np.array([u for u, _ in pairs], dtype=np.int64)
    items = np.array([i for _, i in pairs], dtype=np.int64)
    keep = k_core_mask(users, items, k, k)
    user_counts, item_counts = Counter(users[keep].tolist()), Counter(items[keep].tolist())
    assert all(count >= k for count in user_counts.values())
    assert all(count >= k for count in item_counts.values())
    assert keep.tolist() == _reference_k_core(pairs, k, k)  # and it is the largest such subset


@FAST
@given(rows=rows_strategy, k=st.integers(1, 3), dedup=st.booleans())
def test_split_property(make_raw: MakeRaw, rows: list[tuple[int, int, int]], k: int, dedup: bool) -> None:
    raw = make_raw(rows)
    try:
        prepared = prepare(raw, PrepConfig(k_core=k, dedup=dedup))
    except ValueError as err:  # nothing survives the filter: the only allowed failure
        assert "no interactions left" in str(err)
        return
    history = prepared.interactions.groupby("user_id")
    assert len(prepared.splits) == history.ngroups
    for row in prepared.splits.itertuples(index=False):
        user = history.get_group(row.user_id)
        assert row.train_items + [row.valid_item, row.test_item] == user["item_id"].tolist()
        assert (row.valid_items, row.test_items) == ([row.valid_item], [row.test_item])  # leave-one-out
        assert all(t <= row.valid_timestamp for t in row.train_timestamps)
        assert row.valid_timestamp <= row.test_timestamp
        if dedup:
            assert row.test_item not in row.train_items and row.valid_item not in row.train_items
    kept = prepared.interactions
    assert (kept.groupby("user_id").size() >= max(k, 3)).all()
    assert (kept.groupby("item_id").size() >= k).all()
    assert not dedup or not kept.duplicated(["user_id", "item_id"]).any()


def test_dedup_keeps_earliest_and_ties_keep_file_order(make_raw: MakeRaw) -> None:
    rows = [("u", "a", 9), ("u", "b", 5), ("u", "a", 2), ("u", "c", 5), ("u", "d", 5), ("v", "a", 1)]
    prepared = prepare(make_raw(rows), PrepConfig(k_core=1))
    items = prepared.items.set_index("item_id")["raw_item_id"]
    user = prepared.splits.iloc[0]
    # "a" kept at t=2 (its earliest); b, c, d share t=5 and stay in file order
    assert [items[i] for i in user["train_items"]] == ["a", "b"]
    assert (items[user["valid_item"]], items[user["test_item"]]) == ("c", "d")
    assert user["train_timestamps"] == [2, 5]
    assert prepared.stats["users"] == 1  # "v" has too few interactions for a split


def test_remap_is_seeded_and_order_independent(make_raw: MakeRaw) -> None:
    rng = np.random.default_rng(0)
    rows = [(f"u{u}", f"i{i}", int(t)) for u, i, t in zip(rng.integers(0, 30, 600), rng.integers(0, 40, 600),
                                                             rng.permutation(600), strict=True)]  # fmt: skip
    first = prepare(make_raw(rows), PrepConfig(k_core=2, seed=7))
    shuffled = prepare(make_raw([rows[j] for j in rng.permutation(len(rows))]), PrepConfig(k_core=2, seed=7))
    other = prepare(make_raw(rows), PrepConfig(k_core=2, seed=8))
    pd.testing.assert_frame_equal(first.interactions, shuffled.interactions)
    pd.testing.assert_frame_equal(first.items, shuffled.items)
    assert not first.items["raw_item_id"].equals(other.items["raw_item_id"])
    assert sorted(first.items["item_id"]) == list(range(len(first.items)))


def test_item_ids_are_not_numbered_in_order_of_appearance() -> None:
    raw_ids = pd.Series([f"i{j:04d}" for j in range(500)])
    mapping = remap_items(raw_ids, seed=42)
    assert sorted(mapping.values()) == list(range(500))
    ids = np.array([mapping[r] for r in raw_ids])
    assert np.mean(np.diff(ids) == 1) < 0.05  # consecutive raw items do not get consecutive ids
    assert remap_items(raw_ids.iloc[::-1], seed=42) == mapping


def test_without_metadata_items_have_empty_text(make_raw: MakeRaw) -> None:
    rows = [(u, i, t) for u in range(4) for t, i in enumerate(range(3))]
    prepared = prepare(make_raw(rows), PrepConfig(k_core=3))
    assert prepared.items["title"].tolist() == ["", "", ""]
    assert prepared.items["categories"].tolist() == [[], [], []]


def test_prepare_enforces_reject_share() -> None:
    rejects = Rejects(rows_by_file={"f": 10})
    rejects.add("f", 7, "malformed_json", "{")
    raw = build_raw_dataset([("u", "i", 1, 1.0)] * 9, [], rejects, "test", "mem", has_metadata=False)
    with pytest.raises(DataQualityError, match="first at line 7: malformed_json"):
        prepare(raw, PrepConfig(max_reject_share=0.05))


def test_empty_after_k_core_is_a_clear_error(make_raw: MakeRaw) -> None:
    with pytest.raises(ValueError, match="no interactions left after 5-core"):
        prepare(make_raw([("u", "i", 1)]), PrepConfig())


def test_config_from_params_and_rating_filter(make_raw: MakeRaw) -> None:
    params = {"dataset": "ml-100k", "raw_root": "data/01_raw", "k_core": 1, "seed": 3, "min_rating": 4.5}
    config = PrepConfig.from_params(params)
    assert (config.k_core, config.seed, config.min_rating, config.dedup) == (1, 3, 4.5, True)
    raw = make_raw([("u", "a", 1), ("u", "b", 2), ("u", "c", 3)])  # make_raw rates every row 4.0
    with pytest.raises(ValueError, match=r"min_rating=4\.5 keeps none of the 3 interactions"):
        prepare(raw, config)
    assert prepare(raw, PrepConfig.from_params({**params, "min_rating": 4.0})).stats["interactions"] == 3
    # a key neither the config nor the reader holds is refused, not left silently at its default
    with pytest.raises(ValueError, match=r"data_prep: unknown keys \['kcore'\]"):
        PrepConfig.from_params({**params, "kcore": 10})


@FAST
@given(rows=rows_strategy, points=st.integers(1, 4), valids=st.integers(1, 4))
def test_held_out_points_split_property(
    make_raw: MakeRaw, rows: list[tuple[int, int, int]], points: int, valids: int
) -> None:
    """The last t = min(P, n - 2) interactions are test points in time order, the min(V, n - t - 1)
    before them validation points, the rest (>= 1) train."""
    try:
        prepared = prepare(make_raw(rows), PrepConfig(k_core=1, test_points=points, valid_points=valids))
    except ValueError as err:
        assert "no interactions left" in str(err)
        return
    history = prepared.interactions.groupby("user_id")
    fewer = fewer_valid = 0
    for row in prepared.splits.itertuples(index=False):
        user = history.get_group(row.user_id)
        expected = min(points, len(user) - 2)
        expected_valid = min(valids, len(user) - expected - 1)
        fewer, fewer_valid = fewer + (expected < points), fewer_valid + (expected_valid < valids)
        assert len(row.test_items) == len(row.test_timestamps) == expected >= 1
        assert len(row.valid_items) == len(row.valid_timestamps) == expected_valid >= 1
        assert len(row.train_items) >= 1
        assert [*row.train_items, *row.valid_items, *row.test_items] == user["item_id"].tolist()
        assert (row.test_item, row.test_timestamp) == (row.test_items[0], row.test_timestamps[0])
        assert (row.valid_item, row.valid_timestamp) == (row.valid_items[0], row.valid_timestamps[0])
        assert max(row.train_timestamps) <= row.valid_timestamp
        assert max(row.valid_timestamps) <= row.test_timestamps[0]
        assert not set(row.test_items) & {*row.train_items, *row.valid_items}  # dedup: never trained on
        assert not set(row.valid_items) & set(row.train_items)
    assert prepared.stats["splits"]["test"] == sum(len(t) for t in prepared.splits["test_items"])
    assert prepared.stats["splits"]["valid"] == sum(len(v) for v in prepared.splits["valid_items"])
    assert sum(prepared.stats["splits"].values()) == len(prepared.interactions)
    assert prepared.stats["test_points"] == {"per_user": points, "users_with_fewer": fewer}
    assert prepared.stats["valid_points"] == {"per_user": valids, "users_with_fewer": fewer_valid}


def test_short_users_give_fewer_held_out_points(make_raw: MakeRaw) -> None:
    """Test points first (n - 2 at most), then validation (what is left but one train interaction)."""
    rows = [("a", f"i{j}", j) for j in range(9)] + [("b", f"i{j}", j) for j in range(6)]
    rows += [("c", f"i{j}", j) for j in range(3)]
    prepared = prepare(make_raw(rows), PrepConfig(k_core=1, test_points=3, valid_points=3))
    splits = prepared.splits.set_index("user_id")
    lengths = [(len(r.train_items), len(r.valid_items), len(r.test_items)) for r in splits.itertuples()]
    assert sorted(lengths) == [(1, 1, 1), (1, 2, 3), (3, 3, 3)]  # c: 3 interactions, b: 6, a: 9
    assert prepared.stats["test_points"] == {"per_user": 3, "users_with_fewer": 1}
    assert prepared.stats["valid_points"] == {"per_user": 3, "users_with_fewer": 2}
    for name in ("test_points", "valid_points"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1"):
            PrepConfig(**{name: 0})
