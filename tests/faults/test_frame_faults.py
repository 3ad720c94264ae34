"""Bad candidate lists and requests: the pandera schema and the GX suite name the rule and the row."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd
import pytest

from diffusion_gr2.core.data.expectations import ExpectationReport
from diffusion_gr2.core.data.schemas import SchemaValidationError, validate_requests
from diffusion_gr2.core.retrieval.validation import check_candidates, validate_candidates
from diffusion_gr2.hooks import BoundarySchemaHooks

N, NUM_ITEMS = 4, 30


def good_candidates() -> pd.DataFrame:
    """Two users; user 0 has two train prefixes, user 1 two test points. No leakage, one row per request."""
    rows = [
        (0, "train", 2, [1, 2], 3, [3, 5, 6, 7], 1),
        (0, "train", 3, [1, 2, 3], 4, [8, 4, 9, 10], 2),
        (0, "valid", 0, [1, 2, 3, 4], 11, [11, 12, 13, 14], 1),
        (0, "test", 0, [1, 2, 3, 4, 11], 15, [16, 15, 17, 18], 2),
        (1, "valid", 0, [20, 21], 22, [23, 24, 22, 25], 3),
        (1, "test", 0, [20, 21, 22], 26, [26, 27, 28, 29], 1),
        (1, "test", 1, [20, 21, 22, 26], 19, [19, 27, 28, 29], 1),
    ]
    columns = ["user_id", "split", "point", "history", "target", "candidates", "target_position"]
    return pd.DataFrame(rows, columns=columns).astype(
        {"user_id": "int64", "point": "int64", "target": "int64", "target_position": "int64"}
    )


def _set(row: int, column: str, value: object) -> Callable[[pd.DataFrame], pd.DataFrame]:
    def change(frame: pd.DataFrame) -> pd.DataFrame:
        frame.at[row, column] = value
        return frame

    return change


def _append_copy(row: int, **changes: object) -> Callable[[pd.DataFrame], pd.DataFrame]:
    def change(frame: pd.DataFrame) -> pd.DataFrame:
        extra = frame.iloc[[row]].copy()
        for column, value in changes.items():
            extra.at[extra.index[0], column] = value
        return pd.concat([frame, extra], ignore_index=True)

    return change


# (case id, corruption, pandera check, GX check column, failing row index)
CANDIDATE_CASES = [
    ("target_in_history", _set(2, "history", [1, 2, 3, 4, 11]), "target_not_in_history", "target_in_history", 2),
    ("candidate_in_history", _set(3, "history", [1, 2, 17]), "no_candidate_in_history", "n_candidates_in_history", 3),
    ("empty_history", _set(4, "history", []), "history_not_empty", "n_history", 4),
    ("repeated_request", _append_copy(3, candidates=[15, 16, 17, 19]), "one_row_per_request", "repeated_row", 7),
    ("repeated_train_prefix", _append_copy(0), "one_row_per_request", "repeated_row", 7),
    ("history_foreign_id", _set(5, "history", [20, 99]), "history_ids_in_catalog", "n_history_foreign", 5),
    ("test_target_in_train_row", _set(0, "history", [1, 15]), "held_out_target_not_in_train_rows", "target_trained_on", 3),
]  # fmt: skip
IDS = [c[0] for c in CANDIDATE_CASES]


def test_good_candidates_pass() -> None:
    validate_candidates(good_candidates(), N, NUM_ITEMS)


@pytest.mark.parametrize(("corrupt", "check", "row"), [(c[1], c[2], c[4]) for c in CANDIDATE_CASES], ids=IDS)
def test_candidate_schema_names_rule_and_row(corrupt: Callable, check: str, row: int) -> None:
    with pytest.raises(SchemaValidationError) as err:
        validate_candidates(corrupt(good_candidates()), N, NUM_ITEMS)
    lines = [line for line in str(err.value).splitlines() if f"'{check}'" in line]
    assert len(lines) == 1 and f"rows [{row}]" in lines[0], str(err.value)


@pytest.fixture(scope="module")
def gx_reports() -> dict[str, ExpectationReport]:
    """One GX run per case, all in one ephemeral-context session (GX start-up is paid once)."""
    return {
        case: check_candidates(corrupt(good_candidates()), N, NUM_ITEMS)
        for case, corrupt, *_ in CANDIDATE_CASES
    }


@pytest.mark.parametrize(("case", "column", "row"), [(c[0], c[3], c[4]) for c in CANDIDATE_CASES], ids=IDS)
def test_candidate_gx_suite_names_rule_and_row(
    gx_reports: dict[str, ExpectationReport], case: str, column: str, row: int
) -> None:
    report = gx_reports[case]
    failed = [r for r in report.failures() if r["expectation"]["kwargs"].get("column") == column]
    assert not report.success and len(failed) == 1, report.summary()
    rows = [entry["row"].split(":")[0] for entry in failed[0]["details"]["partial_unexpected_index_list"]]
    assert rows == [str(row)]  # the label "row:split/user/point" names the list


def test_repeats_allowed_without_dedup() -> None:
    """data_prep.dedup false: consuming an item again is a legitimate target, in both checks."""
    frame = _set(2, "history", [1, 2, 3, 4, 11])(good_candidates())
    validate_candidates(frame, N, NUM_ITEMS, allow_repeats=True)
    assert check_candidates(frame, N, NUM_ITEMS, allow_repeats=True).success


# ---- requests ------------------------------------------------------------------------------------
SIDS = [f"<a_{i}><b_{i % 3}>" for i in range(N)]


def good_requests() -> pd.DataFrame:
    frame = good_candidates().drop(columns="history")
    frame["candidate_sids"] = [[f"<a_{i}><b_{i % 3}>" for i in c] for c in frame["candidates"]]
    frame["prompt_ids"] = [[5, 6, 7 + k] for k in range(len(frame))]
    return frame


REQUEST_CASES = [
    ("sids_shorter_than_candidates", _set(0, "candidate_sids", SIDS[:3]), "one_sid_per_candidate"),
    ("duplicate_sids", _set(1, "candidate_sids", [SIDS[0]] * N), "distinct_well_formed_sids"),
    ("tokenless_sid", _set(2, "candidate_sids", ["", *SIDS[1:]]), "distinct_well_formed_sids"),
    ("sid_with_text", _set(2, "candidate_sids", ["<a_9>x<b_1>", *SIDS[1:]]), "distinct_well_formed_sids"),
    ("sid_not_text", _set(2, "candidate_sids", [7, *SIDS[1:]]), "distinct_well_formed_sids"),
    ("target_not_at_position", _set(3, "target_position", 3), "target_at_target_position"),
    ("repeated_request", _append_copy(6), "one_row_per_request"),
    ("negative_token_id", _set(4, "prompt_ids", [5, -1]), "token_ids"),
    ("empty_prompt", _set(4, "prompt_ids", []), "token_ids"),
    ("repeated_candidate", _set(5, "candidates", [26, 26, 28, 29]), "unique_item_ids"),
    ("unknown_split", _set(5, "split", "holdout"), "isin"),
    ("missing_sids", _set(1, "candidate_sids", None), "not_nullable"),
]


def test_good_requests_pass() -> None:
    validate_requests(good_requests())


@pytest.mark.parametrize(
    ("corrupt", "check"), [c[1:] for c in REQUEST_CASES], ids=[c[0] for c in REQUEST_CASES]
)
def test_requests_schema_names_rule(corrupt: Callable, check: str) -> None:
    with pytest.raises(SchemaValidationError, match=r"dataset 'requests' failed") as err:
        validate_requests(corrupt(good_requests()))
    assert f"'{check}" in str(err.value), str(err.value)


def test_requests_missing_column_is_named() -> None:
    with pytest.raises(SchemaValidationError, match="column_in_dataframe") as err:
        validate_requests(good_requests().drop(columns="prompt_ids"))
    assert "prompt_ids" in str(err.value)


def test_requests_are_checked_whenever_a_node_loads_them() -> None:
    """The Kedro hook: a damaged requests file stops the consuming node, naming the rule."""
    hooks = BoundarySchemaHooks()
    hooks.after_dataset_loaded("requests", good_requests())
    hooks.after_dataset_loaded("rankings", pd.DataFrame({"anything": [1]}))  # not a checked dataset
    with pytest.raises(SchemaValidationError, match="one_sid_per_candidate"):
        hooks.after_dataset_loaded("requests", _set(0, "candidate_sids", SIDS[:3])(good_requests()))
