"""Pandera schemas accept good frames (also after a parquet round trip) and name what is wrong in bad ones."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from diffusion_gr2.core.data.raw import RAW_EXCERPT_CHARS, Rejects
from diffusion_gr2.core.data.schemas import (
    SchemaValidationError,
    interactions_schema,
    items_schema,
    rejects_schema,
    splits_schema,
    validate,
)
from diffusion_gr2.core.io import atomic_write_parquet


def good_interactions() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "user_id": np.array([0, 0, 0, 1, 1, 1], dtype=np.int64),
            "item_id": np.array([2, 0, 1, 0, 1, 2], dtype=np.int64),
            "timestamp": np.array([10, 20, 20, 5, 6, 7], dtype=np.int64),
            "rating": [5.0, np.nan, 3.0, 1.0, 2.0, 3.0],
        }
    )


def good_items() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "item_id": np.array([0, 1, 2], dtype=np.int64),
            "raw_item_id": ["a", "b", "c"],
            "title": ["A", "", "C"],
            "categories": [["x", "y"], [], ["z"]],
            "brand": ["", "acme", ""],
            "price": [1.5, np.nan, 0.0],
            "description": ["", "d", ""],
        }
    )


def good_splits() -> pd.DataFrame:
    """User 0 has one validation and one test point, user 1 two validation points (items 1 then 4)
    and two test points (items 2 then 3)."""
    return pd.DataFrame(
        {
            "user_id": np.array([0, 1], dtype=np.int64),
            "train_items": [[2], [0]],
            "train_timestamps": [[10], [5]],
            "valid_item": np.array([0, 1], dtype=np.int64),
            "valid_timestamp": np.array([20, 6], dtype=np.int64),
            "valid_items": [[0], [1, 4]],
            "valid_timestamps": [[20], [6, 7]],
            "test_item": np.array([1, 2], dtype=np.int64),
            "test_timestamp": np.array([20, 7], dtype=np.int64),
            "test_items": [[1], [2, 3]],
            "test_timestamps": [[20], [7, 9]],
        }
    )


def test_good_frames_pass(tmp_path: Path) -> None:
    validate(good_interactions(), interactions_schema(num_items=3), "interactions")
    validate(good_items(), items_schema(num_items=3), "items")
    validate(good_splits(), splits_schema(num_items=5), "splits")
    back = pd.read_parquet(atomic_write_parquet(good_splits(), tmp_path / "splits.parquet"))
    assert isinstance(back["train_items"].iloc[0], np.ndarray)  # lists come back as arrays
    validate(back, splits_schema(num_items=5), "splits")


def _error(df: pd.DataFrame, schema: object, name: str) -> str:
    with pytest.raises(SchemaValidationError) as err:
        validate(df, schema, name)  # type: ignore[arg-type]
    return str(err.value)


def test_interactions_bad_frame() -> None:
    bad = good_interactions()
    bad.loc[4, "item_id"] = 0  # user 1 sees item 0 twice
    bad.loc[1, "timestamp"] = 1  # out of chronological order
    bad.loc[5, "item_id"] = 9  # outside the catalogue
    message = _error(bad, interactions_schema(num_items=3), "interactions")
    assert message.startswith("dataset 'interactions' failed 3 schema check(s)")
    assert "column 'item_id', check 'in_range(0, 2)': rows [5]" in message
    assert "frame-level check 'multiple_fields_uniqueness': rows [3, 4]" in message
    assert "frame-level check 'sorted_by_user_then_time': rows [1]" in message


def test_items_bad_frame() -> None:
    bad = good_items()
    bad.at[1, "categories"] = "x"
    bad.loc[2, "price"] = -3.0
    bad.loc[2, "raw_item_id"] = "a"
    message = _error(bad, items_schema(), "items")
    assert "column 'categories', check 'list_of_str': rows [1]; values ['x']" in message
    assert "column 'price', check 'greater_than_or_equal_to(0)': rows [2]" in message
    assert "column 'raw_item_id', check 'field_uniqueness'" in message


def test_splits_leak_and_range() -> None:
    bad = good_splits()
    bad.at[1, "train_items"] = [2]  # the test item of user 1 is also in their train part
    bad.loc[0, "valid_item"] = 7
    bad.loc[0, "valid_timestamp"] = 3  # validation earlier than training
    message = _error(bad, splits_schema(num_items=5), "splits")
    assert "dataset 'splits'" in message
    assert "frame-level check 'test_item_not_in_train': rows [1]" in message
    assert "frame-level check 'valid_not_before_train': rows [0]" in message
    assert "column 'valid_item', check 'in_range(0, 4)': rows [0]; values [7]" in message


def test_splits_later_test_point_checked() -> None:
    """Every test point, not only the first, is held out of train, in time order, and matches its scalar."""
    leak = good_splits()
    leak.at[1, "train_items"] = [3]  # user 1's second test point is in their train part
    assert "frame-level check 'test_item_not_in_train': rows [1]" in _error(leak, splits_schema(5), "splits")
    early = good_splits()
    early.at[1, "test_timestamps"] = [7, 6]  # the second point before the first
    message = _error(early, splits_schema(5), "splits")
    assert "column 'test_timestamps', check 'test_timestamps_non_decreasing': rows [1]" in message
    moved = good_splits()
    moved.at[1, "test_items"] = [3, 2]  # `test_item` must be point 0
    assert "test_item_is_first_test_point': rows [1]" in _error(moved, splits_schema(5), "splits")
    twice = good_splits()
    twice.at[1, "test_items"] = [2, 2]
    assert "test_points_distinct': rows [1]" in _error(twice, splits_schema(5), "splits")


def test_splits_every_validation_point_checked() -> None:
    """Every validation point is held out of train and test, in time order, before every test
    point, and its scalar columns are point 0."""
    leak = good_splits()
    leak.at[1, "train_items"] = [4]  # user 1's second validation point is in their train part
    assert "'valid_item_not_in_train': rows [1]" in _error(leak, splits_schema(5), "splits")
    late = good_splits()
    late.at[1, "valid_timestamps"] = [6, 8]  # the last validation point after test point 0 (t = 7)
    assert "'test_not_before_valid': rows [1]" in _error(late, splits_schema(5), "splits")
    tested = good_splits()
    tested.at[1, "valid_items"] = [1, 3]  # a validation point that is also a test point
    message = _error(tested, splits_schema(5), "splits")
    assert "'valid_item_not_test_item': rows [1]" in message
    moved = good_splits()
    moved.at[1, "valid_items"] = [4, 1]
    message = _error(moved, splits_schema(5), "splits")
    assert "'valid_item_is_first_valid_point': rows [1]" in message
    short = good_splits()
    short.at[1, "valid_timestamps"] = [6]
    assert "'valid_lengths_match': rows [1]" in _error(short, splits_schema(5), "splits")


def test_splits_repeats_allowed_without_dedup() -> None:
    repeat = good_splits()
    repeat.at[1, "train_items"] = [2]
    validate(repeat, splits_schema(num_items=5, allow_repeats=True), "splits")
    assert "test_item_not_in_train" in _error(repeat, splits_schema(num_items=5), "splits")


def test_splits_empty_train_and_length_mismatch() -> None:
    bad = good_splits()
    bad.at[0, "train_items"] = []
    bad.at[1, "train_timestamps"] = [5, 5]
    message = _error(bad, splits_schema(num_items=5), "splits")
    assert "column 'train_items', check 'items_list': rows [0]" in message
    assert "frame-level check 'train_lengths_match'" in message


def test_rejects_schema() -> None:
    good = pd.DataFrame(
        {"file": ["f"], "line": np.array([3], dtype=np.int64), "reason": ["bad_timestamp"], "raw": ["x"]}
    )
    validate(good, rejects_schema(), "rejects")
    assert "column 'line'" in _error(
        good.assign(line=np.array([0], dtype=np.int64)), rejects_schema(), "rejects"
    )


def test_rejects_schema_accepts_what_the_readers_reject() -> None:
    """The frame `Rejects` builds (data_prep writes it after validating): none, a line cut to the excerpt
    length, an undecodable one, an empty one, all pass."""
    rejects = Rejects()
    validate(rejects.frame(), rejects_schema(), "rejects")
    rejects.add(Path("reviews.json.gz"), 3, "bad_text:title", "\U0001f600" * (RAW_EXCERPT_CHARS + 100))
    rejects.add("meta.json", 1, "bad_encoding", b"\xff\xfe".decode("utf-8", "replace"))
    rejects.add("meta.json", 2, "malformed_record:ValueError", "")
    assert len(validate(rejects.frame(), rejects_schema(), "rejects")) == 3
