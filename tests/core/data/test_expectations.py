"""Great Expectations runner and the splits suite: passes on good data, readable failures on bad data."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from diffusion_gr2.core.data.expectations import (
    ExpectationReport,
    ExpectationsFailed,
    check_splits,
    run_expectations,
)
from diffusion_gr2.core.data.prepare import PreparedData, PrepConfig, prepare
from diffusion_gr2.core.data.raw import RawDataset


@pytest.fixture
def prepared(make_raw: Callable[..., RawDataset]) -> PreparedData:
    rows = [(u, (u + j) % 6, 10 * j + u) for u in range(5) for j in range(5)]
    return prepare(make_raw(rows), PrepConfig(k_core=3))


def test_split_suite_passes_and_saves_report(
    prepared: PreparedData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # an ephemeral context must not create a gx/ project folder
    report = check_splits(prepared.splits, len(prepared.items), report_dir=tmp_path / "reports")
    assert report.success, report.summary()
    assert report.summary().startswith("suite 'splits': PASSED")
    saved = json.loads((tmp_path / "reports" / "splits.json").read_text())
    assert saved["success"] is True and saved["statistics"]["unsuccessful_expectations"] == 0
    assert {tuple(sorted(r)) for r in saved["results"]} == {("details", "expectation", "success")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reports"]


def test_split_suite_fails_readably(prepared: PreparedData) -> None:
    bad = prepared.splits.copy()
    bad.at[1, "train_items"] = [*bad.at[1, "train_items"][:-1], int(bad.at[1, "test_item"])]  # leak
    bad.loc[2, "valid_item"] = 99  # outside the catalogue
    bad.loc[3, "user_id"] = bad.loc[0, "user_id"]  # a user twice
    report = check_splits(bad, len(prepared.items))
    assert not report.success
    failed = {
        r["expectation"]["type"] + ":" + str(r["expectation"]["kwargs"].get("column"))
        for r in report.failures()
    }
    assert failed == {
        "expect_column_values_to_be_in_set:test_item_in_train",
        "expect_column_values_to_be_between:valid_item",
        "expect_column_values_to_be_in_set:valid_item_is_first",  # valid_items still holds the old item
        "expect_column_values_to_be_unique:user_id",
    }
    summary = report.summary()
    assert "FAILED expect_column_values_to_be_between(column='valid_item'" in summary
    assert "sample values [99]" in summary and "1 of 5 rows unexpected" in summary
    assert "FAILED expect_column_values_to_be_in_set(column='test_item_in_train'" in summary


def test_split_suite_checks_every_test_point(make_raw: Callable[..., RawDataset]) -> None:
    rows = [(u, (u + j) % 8, 10 * j + u) for u in range(6) for j in range(7)]
    splits = prepare(make_raw(rows), PrepConfig(k_core=3, test_points=3)).splits
    assert check_splits(splits, 8).success
    bad = splits.copy()
    last = int(bad.at[1, "test_items"][-1])
    bad.at[1, "train_items"] = [*bad.at[1, "train_items"][:-1], last]  # the last point leaks, not point 0
    bad.at[2, "test_timestamps"] = [int(bad.at[2, "valid_timestamp"]) - 1, *bad.at[2, "test_timestamps"][1:]]
    report = check_splits(bad, 8)
    failed = {str(r["expectation"]["kwargs"].get("column")) for r in report.failures()}
    assert failed == {"test_item_in_train", "test_points_ordered"}, report.summary()


def test_split_suite_checks_every_validation_point(make_raw: Callable[..., RawDataset]) -> None:
    rows = [(u, (u + j) % 9, 10 * j + u) for u in range(6) for j in range(8)]
    splits = prepare(make_raw(rows), PrepConfig(k_core=3, test_points=2, valid_points=3)).splits
    assert check_splits(splits, 9).success and set(splits["valid_items"].map(len)) == {3}
    bad = splits.copy()
    last = int(bad.at[1, "valid_items"][-1])
    bad.at[1, "train_items"] = [*bad.at[1, "train_items"][:-1], last]  # the last point leaks, not point 0
    stamps = bad.at[2, "valid_timestamps"]
    bad.at[2, "valid_timestamps"] = [*stamps[:-1], int(bad.at[2, "test_timestamp"]) + 1]  # after test
    bad.at[3, "valid_items"] = [*bad.at[3, "valid_items"][:2]]  # one timestamp too many
    report = check_splits(bad, 9)
    kwargs = [r["expectation"]["kwargs"] for r in report.failures()]
    failed = {str(k.get("column", k.get("column_A"))) for k in kwargs}
    assert failed == {"valid_item_in_train", "test_after_valid", "test_points_ordered", "n_valid_points"}, (
        report.summary()
    )


def test_allow_repeats_drops_leak_expectations(prepared: PreparedData) -> None:
    bad = prepared.splits.copy()
    bad.at[0, "train_items"] = [*bad.at[0, "train_items"][:-1], int(bad.at[0, "test_item"])]
    assert not check_splits(bad, len(prepared.items)).success
    assert check_splits(bad, len(prepared.items), allow_repeats=True).success


def test_generic_runner_with_custom_suite(tmp_path: Path) -> None:
    import great_expectations.expectations as gxe

    frame = pd.DataFrame({"target_position": [1, 4, 11, 0], "n": [10, 10, 10, 10]})
    suite = [
        gxe.ExpectColumnValuesToBeBetween(column="target_position", min_value=1, max_value=10),
        gxe.ExpectColumnDistinctValuesToEqualSet(column="n", value_set=[10]),
        gxe.ExpectColumnValuesToNotBeNull(column="no_such_column"),
    ]
    report = run_expectations(frame, "candidates_test", suite, tmp_path)
    assert isinstance(report, ExpectationReport) and not report.success
    assert report.statistics["evaluated_expectations"] == 3
    assert [r["success"] for r in report.results] == [False, True, False]
    assert report.results[0]["details"]["partial_unexpected_list"] == [11, 0]
    assert "does not exist" in report.results[2]["details"]["exception"]
    assert "no_such_column" in report.summary()
    assert json.loads((tmp_path / "candidates_test.json").read_text())["suite_name"] == "candidates_test"
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.success = True  # type: ignore[misc]


def test_raise_for_failure(prepared: PreparedData) -> None:
    check_splits(prepared.splits, len(prepared.items)).raise_for_failure()
    bad = prepared.splits.assign(test_item=99)
    with pytest.raises(ExpectationsFailed, match="column='test_item'"):
        check_splits(bad, num_items=len(prepared.items)).raise_for_failure()
