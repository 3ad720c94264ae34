"""Candidate lists obey the contract in both modes; schema and GX suite catch corrupted lists."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.data.prepare import leave_one_out
from diffusion_gr2.core.data.schemas import SchemaValidationError, splits_schema, validate
from diffusion_gr2.core.retrieval.candidates import COLUMNS, CandidateConfig, build_candidates
from diffusion_gr2.core.retrieval.evaluation import histories_before_valid, mask_history, top_n
from diffusion_gr2.core.retrieval.validation import check_candidates, validate_candidates

NUM_ITEMS, N = 30, 10


def successor_scores(num_items: int):
    """Scores that rank the items after the last history item first (cyclically by item id)."""

    def score(histories):
        ids = np.arange(num_items)
        return np.stack([-((ids - h[-1] - 1) % num_items).astype(np.float32) for h in histories])

    return score


def arithmetic_splits(num_users: int = 12) -> pd.DataFrame:
    """User u walks u, u+1, ... (mod NUM_ITEMS): the successor scorer always ranks the target first."""
    rows = []
    for u in range(num_users):
        seq = [(u + k) % NUM_ITEMS for k in range(5 + u % 4)]
        rows.append(
            {
                "user_id": u,
                "train_items": seq[:-2],
                "train_timestamps": list(range(len(seq) - 2)),
                "valid_item": seq[-2],
                "valid_timestamp": 100,
                "valid_items": [seq[-2]],
                "valid_timestamps": [100],
                "test_item": seq[-1],
                "test_timestamp": 101,
                "test_items": seq[-1:],
                "test_timestamps": [101],
            }
        )
    return pd.DataFrame(rows)


def _assert_contract(frame: pd.DataFrame, splits: pd.DataFrame, config: CandidateConfig) -> None:
    assert tuple(frame.columns) == COLUMNS
    assert frame.dtypes[["user_id", "target", "target_position"]].eq("int64").all()
    by_user = splits.set_index("user_id")
    for row in frame.itertuples(index=False):
        user = by_user.loc[row.user_id]
        train = list(user.train_items)
        if row.split == "train":
            j = train.index(row.target)
            assert j >= max(1, len(train) - config.train_prefixes)
            assert row.history == train[:j][-config.history_cap :]
        elif row.split == "valid":
            assert row.target == user.valid_item and row.history == train[-config.history_cap :]
        else:
            full = [*train, user.valid_item]
            assert row.target == user.test_item and row.history == full[-config.history_cap :]
        assert len(row.candidates) == config.n and len(set(row.candidates)) == config.n
        assert all(0 <= c < NUM_ITEMS for c in row.candidates)
        assert not set(row.candidates) & set(row.history)
        assert row.candidates[row.target_position - 1] == row.target


def test_retrieved_mode_keeps_pre_rank_order_and_obeys_contract() -> None:
    splits = arithmetic_splits()
    config = CandidateConfig(n=N, mode="retrieved", train_prefixes=2, history_cap=3)
    result = build_candidates(splits, successor_scores(NUM_ITEMS), config, NUM_ITEMS)
    frame = result.frame
    _assert_contract(frame, splits, config)
    assert list(frame["split"].unique()) == ["train", "valid", "test"]
    train_rows = sum(min(2, len(t) - 1) for t in splits["train_items"])
    assert (frame["split"] == "train").sum() == train_rows
    assert (frame["target_position"] == 1).all() and result.users_kept == {
        "train": 1.0,
        "valid": 1.0,
        "test": 1.0,
    }
    full_history = [[*t, v] for t, v in zip(splits["train_items"], splits["valid_item"], strict=True)]
    expected = top_n(mask_history(successor_scores(NUM_ITEMS)(full_history), full_history), N)
    np.testing.assert_array_equal(np.stack(frame[frame["split"] == "test"]["candidates"]), expected)
    validate_candidates(frame, N, NUM_ITEMS)


def test_retrieved_mode_drops_rows_whose_target_is_missed() -> None:
    splits = arithmetic_splits()

    def score(histories):  # fixed order 0..29 for everyone: targets far down the list are missed
        return np.tile(-np.arange(NUM_ITEMS, dtype=np.float32), (len(histories), 1))

    result = build_candidates(splits, score, CandidateConfig(n=5), NUM_ITEMS)
    test = result.frame[result.frame["split"] == "test"]
    for row in test.itertuples():
        assert row.candidates == [i for i in range(NUM_ITEMS) if i not in row.history][:5]
    kept_users = {
        u
        for u, t, v in zip(splits["user_id"], splits["train_items"], splits["valid_item"], strict=True)
        if splits.loc[u, "test_item"] in [i for i in range(NUM_ITEMS) if i not in [*t, v]][:5]
    }
    assert set(test["user_id"]) == kept_users and 0 < len(kept_users) < len(splits)
    assert result.users_kept["test"] == len(kept_users) / len(splits)


def test_sampled_mode_is_seeded_shuffled_and_obeys_contract() -> None:
    splits = arithmetic_splits()
    config = CandidateConfig(n=N, mode="sampled", train_prefixes=3, history_cap=20, seed=7)
    first = build_candidates(splits, None, config, NUM_ITEMS)
    _assert_contract(first.frame, splits, config)
    assert first.users_kept == {"train": 1.0, "valid": 1.0, "test": 1.0}
    assert first.frame["target_position"].nunique() > 3  # shuffled, not always first
    pd.testing.assert_frame_equal(first.frame, build_candidates(splits, None, config, NUM_ITEMS).frame)
    other = build_candidates(splits, None, CandidateConfig(n=N, mode="sampled", seed=8), NUM_ITEMS)
    assert first.frame["candidates"].tolist() != other.frame["candidates"].tolist()
    validate_candidates(first.frame, N, NUM_ITEMS)


def test_retrieved_mode_never_fills_a_list_with_history_items() -> None:
    splits = arithmetic_splits(3)
    full = splits.copy()
    full.at[0, "train_items"] = [i for i in range(NUM_ITEMS) if i not in (28, 29)][:-3]  # 3 items left
    full.at[0, "valid_item"], full.at[0, "test_item"], full.at[0, "test_items"] = 28, 29, [29]
    full.at[0, "valid_items"] = [28]
    result = build_candidates(full, successor_scores(NUM_ITEMS), CandidateConfig(n=N), NUM_ITEMS)
    frame = result.frame
    assert not ((frame["user_id"] == 0) & (frame["split"] != "train")).any()
    assert all(not set(c) & set(h) for c, h in zip(frame["candidates"], frame["history"], strict=True))
    assert result.users_kept["test"] == 2 / 3


def test_retrieved_mode_needs_a_score_fn() -> None:
    with pytest.raises(ValueError, match="score_fn"):
        build_candidates(arithmetic_splits(), None, CandidateConfig(), NUM_ITEMS)


def _corrupted(frame: pd.DataFrame) -> pd.DataFrame:
    bad = frame.copy()
    bad.at[0, "candidates"] = [bad.at[0, "candidates"][0]] * 2 + bad.at[0, "candidates"][2:]  # duplicate id
    bad.at[1, "candidates"] = bad.at[1, "candidates"][:-1]  # wrong length
    bad.at[2, "candidates"] = bad.at[2, "candidates"][:-1] + [NUM_ITEMS + 5]  # foreign id
    return bad


def test_schema_rejects_corrupted_lists() -> None:
    frame = build_candidates(arithmetic_splits(), None, CandidateConfig(mode="sampled"), NUM_ITEMS).frame
    with pytest.raises(SchemaValidationError, match="candidates") as err:
        validate_candidates(_corrupted(frame), N, NUM_ITEMS)
    assert "10_unique_ids_in_catalog" in str(err.value)


def test_gx_suite_passes_good_lists_and_names_each_corruption(tmp_path) -> None:
    frame = build_candidates(arithmetic_splits(), None, CandidateConfig(mode="sampled"), NUM_ITEMS).frame
    assert check_candidates(frame, N, NUM_ITEMS, report_dir=tmp_path).success
    report = check_candidates(_corrupted(frame), N, NUM_ITEMS, report_dir=tmp_path, suite_name="bad")
    assert not report.success
    failed = {r["expectation"]["kwargs"].get("column") for r in report.failures()}
    assert {"n_candidates", "n_duplicates", "n_foreign"} <= failed
    summary = report.summary()
    assert "n_duplicates" in summary and "0:train/0" in summary  # names the rule and the row
    assert "n_foreign" in summary and "2:train/" in summary
    saved = json.loads((tmp_path / "bad.json").read_text())
    assert saved["success"] is False and (tmp_path / "candidates.json").exists()


def _walks(num_users: int = 12, length: int = 9, test_points: int = 3, valid_points: int = 1) -> pd.DataFrame:
    """A real preparation of per-user walks over the catalogue, with `test_points` and `valid_points`
    held out per user."""
    rows = [(u, (u + k) % NUM_ITEMS, 100 * k + u) for u in range(num_users) for k in range(length)]
    frame = pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"]).assign(rating=float("nan"))
    return leave_one_out(
        frame.sort_values(["user_id", "timestamp"], kind="stable"), test_points, valid_points
    )


def _training_data(frame: pd.DataFrame, splits: pd.DataFrame) -> set[tuple[int, int]]:
    """(user, item) of everything a model trains on: train rows (traces, SFT, RL) and the retriever's data."""
    train = frame[frame["split"] == "train"]
    rows = {(int(u), int(i)) for u, h, t in zip(train["user_id"], train["history"], train["target"], strict=True)
            for i in [*h, t]}  # fmt: skip
    retriever = {(int(u), int(i)) for u, h in zip(splits["user_id"], histories_before_valid(splits), strict=True)
                 for i in h}  # fmt: skip
    return rows | retriever


def test_several_test_points_per_user_with_everything_before_each() -> None:
    splits = _walks(test_points=3)
    config = CandidateConfig(n=N, mode="sampled", train_prefixes=2, history_cap=20, seed=1)
    frame = build_candidates(splits, None, config, NUM_ITEMS).frame
    test = frame[frame["split"] == "test"]
    assert test.groupby("user_id")["point"].apply(list).map(lambda p: p == [0, 1, 2]).all()
    for row in test.itertuples(index=False):
        walk = [(row.user_id + k) % NUM_ITEMS for k in range(9)]
        position = 6 + row.point  # 9 interactions: 5 train, validation at 5, test points at 6, 7, 8
        assert row.target == walk[position] and list(row.history) == walk[:position]
    assert (frame.loc[frame["split"] == "valid", "point"] == 0).all()
    held_out = {(int(u), int(t)) for u, t in zip(test["user_id"], test["target"], strict=True)}
    assert len(held_out) == 3 * len(splits) and not held_out & _training_data(frame, splits)
    validate_candidates(frame, N, NUM_ITEMS)


def test_several_validation_points_asked_like_test_points() -> None:
    splits = _walks(length=10, test_points=3, valid_points=3)
    config = CandidateConfig(n=N, mode="sampled", train_prefixes=2, history_cap=20, seed=1)
    frame = build_candidates(splits, None, config, NUM_ITEMS).frame
    for split, first in (("valid", 4), ("test", 7)):  # 10 interactions: 4 train, 3 validation, 3 test
        rows = frame[frame["split"] == split]
        assert rows.groupby("user_id")["point"].apply(list).map(lambda p: p == [0, 1, 2]).all()
        for row in rows.itertuples(index=False):
            walk = [(row.user_id + k) % NUM_ITEMS for k in range(10)]
            assert row.target == walk[first + row.point] and list(row.history) == walk[: first + row.point]
    held_out = frame[frame["split"] != "train"]
    targets = {(int(u), int(t)) for u, t in zip(held_out["user_id"], held_out["target"], strict=True)}
    assert len(targets) == 6 * len(splits) and not targets & _training_data(frame, splits)
    validate(splits, splits_schema(NUM_ITEMS), "splits")
    validate_candidates(frame, N, NUM_ITEMS)


def test_a_test_point_leaked_into_train_is_caught() -> None:
    """Moving the last test point of a user into their train part trips the split and candidate checks."""
    splits = _walks(test_points=3)
    leaky = splits.copy()
    leaky.at[4, "train_items"] = [*leaky.at[4, "train_items"][1:], int(leaky.at[4, "test_items"][-1])]
    with pytest.raises(SchemaValidationError, match="test_item_not_in_train"):
        validate(leaky, splits_schema(NUM_ITEMS), "splits")
    config = CandidateConfig(n=N, mode="sampled", train_prefixes=2, seed=1)
    frame = build_candidates(leaky, None, config, NUM_ITEMS).frame
    test = frame[frame["split"] == "test"]
    held_out = {(int(u), int(t)) for u, t in zip(test["user_id"], test["target"], strict=True)}
    assert held_out & _training_data(frame, leaky) == {(4, (4 + 8) % NUM_ITEMS)}
    with pytest.raises(SchemaValidationError, match="held_out_target_not_in_train_rows"):
        validate_candidates(frame, N, NUM_ITEMS)
