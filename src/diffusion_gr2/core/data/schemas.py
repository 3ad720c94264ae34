"""Pandera schemas for the frames that cross pipeline boundaries (docs/architecture.md "Data").

Schemas are built by functions because some bounds depend on the data (the catalogue size) and on
the preparation (repeated pairs are only forbidden after dedup). `validate` runs a schema lazily and
raises one `SchemaValidationError` naming the dataset, each failing column and check, and the rows.
List cells are accepted as lists or numpy arrays, since parquet round trips return arrays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pandera.pandas as pa

from diffusion_gr2.core.data.raw import MAX_TIMESTAMP_S, RAW_EXCERPT_CHARS
from diffusion_gr2.core.text.prompt import split_sid

__all__ = [
    "INTERACTIONS",
    "ITEMS",
    "SPLITS",
    "SchemaValidationError",
    "interactions_schema",
    "items_schema",
    "rejects_schema",
    "requests_schema",
    "splits_schema",
    "validate",
    "validate_requests",
]

MAX_EXAMPLES = 5  # failing rows shown per check in the error message


class SchemaValidationError(ValueError):
    """A frame failed its schema; ``failure_cases`` holds pandera's full table."""

    def __init__(self, message: str, failure_cases: pd.DataFrame) -> None:
        super().__init__(message)
        self.failure_cases = failure_cases


def _is_seq(value: Any) -> bool:
    return isinstance(value, list | tuple | np.ndarray)


def _int_list_in_range(value: Any, num_items: int | None, non_empty: bool) -> bool:
    """A list of ints (optionally non-empty, optionally all in ``[0, num_items)``)."""
    if not _is_seq(value) or (non_empty and len(value) == 0):
        return False
    if not all(isinstance(v, int | np.integer) for v in value):
        return False
    return all(int(v) >= 0 and (num_items is None or int(v) < num_items) for v in value)


def _str_list(value: Any) -> bool:
    return _is_seq(value) and all(isinstance(v, str) for v in value)


def _non_decreasing(value: Any) -> bool:
    return _is_seq(value) and bool(np.all(np.diff(np.asarray(value, dtype=np.int64)) >= 0))


def _contiguous(frame_or_series: pd.Series) -> bool:
    """Ids are exactly 0..n-1 (each may repeat): remapping leaves no holes."""
    values = frame_or_series.unique()
    return len(values) == 0 or (values.min() == 0 and values.max() == len(values) - 1)


def _sorted_by_user_time(df: pd.DataFrame) -> pd.Series:
    """Row-wise: each row comes after the previous one in (user, time) order."""
    user, time = df["user_id"], df["timestamp"]
    prev_user, prev_time = user.shift(1), time.shift(1)
    return prev_user.isna() | (user > prev_user) | ((user == prev_user) & (time >= prev_time))


def _id_column(n: int | None = None, unique: bool = False) -> pa.Column:
    checks = [pa.Check.ge(0)] if n is None else [pa.Check.in_range(0, n - 1)]
    return pa.Column("int64", checks, unique=unique)


def _timestamp_column() -> pa.Column:
    return pa.Column("int64", pa.Check.in_range(0, MAX_TIMESTAMP_S))


def interactions_schema(num_items: int | None = None, unique_pairs: bool = True) -> pa.DataFrameSchema:
    """``user_id`` 0..U-1, ``item_id`` in the catalogue, unix-second ``timestamp``, ``rating`` (NaN ok);
    sorted by user then time; (user, item) pairs unique after dedup."""
    return pa.DataFrameSchema(
        {
            "user_id": pa.Column("int64", [pa.Check.ge(0), pa.Check(_contiguous, name="ids_contiguous")]),
            "item_id": _id_column(num_items),
            "timestamp": _timestamp_column(),
            "rating": pa.Column("float64", nullable=True),
        },
        checks=[pa.Check(_sorted_by_user_time, name="sorted_by_user_then_time")],
        unique=["user_id", "item_id"] if unique_pairs else None,
        strict=True,
        name="interactions",
    )


def items_schema(num_items: int | None = None) -> pa.DataFrameSchema:
    """One row per catalogue item: ids unique and contiguous, text fields strings, price >= 0 or NaN."""
    return pa.DataFrameSchema(
        {
            "item_id": pa.Column(
                "int64",
                [pa.Check.ge(0), pa.Check(_contiguous, name="ids_contiguous")]
                + ([pa.Check.in_range(0, num_items - 1)] if num_items is not None else []),
                unique=True,
            ),
            "raw_item_id": pa.Column(str, pa.Check.str_length(min_value=1), unique=True),
            "title": pa.Column(str),
            "categories": pa.Column(object, pa.Check(_str_list, element_wise=True, name="list_of_str")),
            "brand": pa.Column(str),
            "price": pa.Column("float64", pa.Check.ge(0), nullable=True),
            "description": pa.Column(str),
        },
        strict=True,
        name="items",
    )


def _split_frame_checks(allow_repeats: bool) -> list[pa.Check]:
    """Cross-column rules of a hold-out split (chronology and no target leakage).

    Validation points come after every train interaction and every test point after the last
    validation point; the scalar ``valid_item``/``test_item`` (and timestamps) are point 0 of their
    lists; with dedup no held-out point is a train item of its user, no validation point a test
    point, and no point repeats within its list.
    """

    def row_rule(rule: Any, *columns: str) -> Any:
        def check(df: pd.DataFrame) -> pd.Series:
            return pd.Series(
                [bool(rule(*v)) for v in zip(*(df[c] for c in columns), strict=True)], index=df.index
            )

        return check

    def first_is(column: str, points: str) -> Any:
        return row_rule(lambda value, seq: _length(seq) > 0 and int(seq[0]) == int(value), column, points)

    def valid_after_train(df: pd.DataFrame) -> pd.Series:
        last = df["train_timestamps"].map(lambda ts: max(ts) if len(ts) else -1)
        return df["valid_timestamp"] >= last

    def test_after_valid(df: pd.DataFrame) -> pd.Series:
        last = df["valid_timestamps"].map(lambda ts: max(ts) if _length(ts) > 0 else np.iinfo(np.int64).max)
        return df["test_timestamp"] >= last

    def not_in_train(points: Any, train: Any) -> bool:
        held_out = set(map(int, [points] if np.isscalar(points) else points))
        return held_out.isdisjoint(map(int, train))

    checks = [
        pa.Check(row_rule(lambda a, b: _length(a) == _length(b), "train_items", "train_timestamps"),
                 name="train_lengths_match"),
        pa.Check(row_rule(lambda a, b: _length(a) == _length(b), "test_items", "test_timestamps"),
                 name="test_lengths_match"),
        pa.Check(row_rule(lambda a, b: _length(a) == _length(b), "valid_items", "valid_timestamps"),
                 name="valid_lengths_match"),
        pa.Check(valid_after_train, name="valid_not_before_train"),
        pa.Check(test_after_valid, name="test_not_before_valid"),
        pa.Check(first_is("test_item", "test_items"), name="test_item_is_first_test_point"),
        pa.Check(first_is("test_timestamp", "test_timestamps"), name="test_timestamp_is_first_test_point"),
        pa.Check(first_is("valid_item", "valid_items"), name="valid_item_is_first_valid_point"),
        pa.Check(first_is("valid_timestamp", "valid_timestamps"), name="valid_timestamp_is_first_valid_point"),
    ]  # fmt: skip
    if not allow_repeats:

        def distinct(column: str) -> Any:
            return row_rule(lambda seq: len(set(map(int, seq))) == len(seq), column)

        checks += [
            pa.Check(row_rule(not_in_train, "test_items", "train_items"), name="test_item_not_in_train"),
            pa.Check(row_rule(not_in_train, "valid_items", "train_items"), name="valid_item_not_in_train"),
            pa.Check(row_rule(not_in_train, "valid_items", "test_items"), name="valid_item_not_test_item"),
            pa.Check(distinct("test_items"), name="test_points_distinct"),
            pa.Check(distinct("valid_items"), name="valid_points_distinct"),
        ]
    return checks


def splits_schema(num_items: int | None = None, allow_repeats: bool = False) -> pa.DataFrameSchema:
    """One row per user: non-empty chronological train part, then the validation points, then the
    test points, each in time order (``valid_items``, ``test_items``; ``valid_item``, ``test_item``
    are the first of them).

    ``allow_repeats`` lifts the "target not in the user's train items" rules for data prepared
    without dedup, where re-consumption is legitimate.
    """
    return pa.DataFrameSchema(
        {
            "user_id": _id_column(unique=True),
            "train_items": pa.Column(
                object,
                pa.Check(
                    lambda v: _int_list_in_range(v, num_items, True), element_wise=True, name="items_list"
                ),
            ),
            "train_timestamps": pa.Column(
                object, pa.Check(_non_decreasing, element_wise=True, name="timestamps_non_decreasing")
            ),
            "valid_item": _id_column(num_items),
            "valid_timestamp": _timestamp_column(),
            "valid_items": pa.Column(
                object,
                pa.Check(
                    lambda v: _int_list_in_range(v, num_items, True),
                    element_wise=True,
                    name="valid_points_list",
                ),
            ),
            "valid_timestamps": pa.Column(
                object, pa.Check(_non_decreasing, element_wise=True, name="valid_timestamps_non_decreasing")
            ),
            "test_item": _id_column(num_items),
            "test_timestamp": _timestamp_column(),
            "test_items": pa.Column(
                object,
                pa.Check(
                    lambda v: _int_list_in_range(v, num_items, True),
                    element_wise=True,
                    name="test_points_list",
                ),
            ),
            "test_timestamps": pa.Column(
                object, pa.Check(_non_decreasing, element_wise=True, name="test_timestamps_non_decreasing")
            ),
        },
        checks=_split_frame_checks(allow_repeats),
        strict=True,
        name="splits",
    )


def rejects_schema() -> pa.DataFrameSchema:
    """Rejected raw lines: file, 1-based line, reason code, raw excerpt."""
    return pa.DataFrameSchema(
        {
            "file": pa.Column(str),
            "line": pa.Column("int64", pa.Check.ge(1)),
            "reason": pa.Column(str, pa.Check.str_length(min_value=1)),
            "raw": pa.Column(str, pa.Check.str_length(max_value=RAW_EXCERPT_CHARS)),  # `Rejects.add` cuts
        },
        strict=True,
        name="rejects",
    )


REQUEST_SPLITS = ("train", "valid", "test")


def _is_sid(value: Any) -> bool:
    """A SID string that is exactly its SID tokens (``<a_1><b_2>...``), as the grammar requires."""
    parts = split_sid(value) if isinstance(value, str) else []
    return bool(parts) and "".join(parts) == value


def _length(value: Any) -> int:
    """Length of a list cell; -1 for a cell that is not a list (the column check names it)."""
    return len(value) if _is_seq(value) else -1


def _sid_list(value: Any) -> bool:
    return (
        _is_seq(value) and len(value) > 0 and all(_is_sid(v) for v in value) and len(set(value)) == len(value)
    )


def _request_row_checks() -> list[pa.Check]:
    """Cross-column rules of a request: one SID per candidate, the target where it says, no repeats."""

    def sids_match_candidates(df: pd.DataFrame) -> pd.Series:
        return df["candidate_sids"].map(_length) == df["candidates"].map(_length)

    def target_at_position(df: pd.DataFrame) -> pd.Series:
        cells = zip(df["candidates"], df["target"], df["target_position"], strict=True)
        return pd.Series(
            [0 < p <= _length(c) and int(c[p - 1]) == int(t) for c, t, p in cells], index=df.index
        )

    def one_row_per_request(df: pd.DataFrame) -> pd.Series:
        # (split, user, point) is the request's key: systems are paired on it
        return ~df.duplicated(["split", "user_id", "point"], keep="first")

    return [
        pa.Check(sids_match_candidates, name="one_sid_per_candidate"),
        pa.Check(target_at_position, name="target_at_target_position"),
        pa.Check(one_row_per_request, name="one_row_per_request"),
    ]


def requests_schema() -> pa.DataFrameSchema:
    """The ``requests`` frame every model stage reads (``core/text/examples.py``): a prompt, its
    candidates in pre-rank order with one well-formed, distinct SID each, and the target among them;
    one row per (``split``, ``user_id``, ``point``)."""
    return pa.DataFrameSchema(
        {
            "user_id": _id_column(),
            "split": pa.Column(str, pa.Check.isin(REQUEST_SPLITS)),
            "point": _id_column(),
            "target": _id_column(),
            "target_position": pa.Column("int64", pa.Check.ge(1)),
            "candidates": pa.Column(
                object,
                pa.Check(
                    lambda v: _int_list_in_range(v, None, True) and len(set(map(int, v))) == len(v),
                    element_wise=True,
                    name="unique_item_ids",
                ),
            ),
            "candidate_sids": pa.Column(
                object, pa.Check(_sid_list, element_wise=True, name="distinct_well_formed_sids")
            ),
            "prompt_ids": pa.Column(
                object,
                pa.Check(lambda v: _int_list_in_range(v, None, True), element_wise=True, name="token_ids"),
            ),
        },
        checks=_request_row_checks(),
        strict=True,
        name="requests",
    )


def validate_requests(frame: pd.DataFrame) -> pd.DataFrame:
    """Validate a ``requests`` frame; raises `SchemaValidationError` naming the column, check and rows."""
    return validate(frame, requests_schema(), "requests")


def _describe_failures(name: str, cases: pd.DataFrame) -> str:
    """One line per failing check: the column (or the columns of a frame-level rule), rows, values."""
    groups = cases.groupby(["schema_context", "check"], dropna=False, sort=False)
    lines = [f"dataset '{name}' failed {groups.ngroups} schema check(s):"]
    for (context, check), group in groups:
        columns = list(dict.fromkeys(group["column"].dropna().tolist()))
        rows = group["index"].dropna().unique().tolist()
        where_rows = f"rows {_sample(rows)}" if rows else "the column as a whole"
        if context == "Column" or len(columns) == 1:
            values = _sample(group["failure_case"].tolist())
            lines.append(
                f"  column '{columns[0] if columns else None}', check '{check}': {where_rows}; values {values}"
            )
            continue
        first = group[group["index"] == rows[0]] if rows else group.head(0)
        example = {c: _plain(v) for c, v in zip(first["column"], first["failure_case"], strict=True)}
        lines.append(f"  frame-level check '{check}': {where_rows}; first row {example}")
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    """A failure value for the message: numpy made plain, long lists cut (a prompt has 300+ ids)."""
    value = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(value, list) and len(value) > 2 * MAX_EXAMPLES:
        return [*value[: 2 * MAX_EXAMPLES], f"... {len(value)} in all"]
    return value


def _sample(values: Sequence[Any]) -> str:
    shown = [_plain(v) for v in values[:MAX_EXAMPLES]]
    return f"{shown}{' ...' if len(values) > MAX_EXAMPLES else ''}"


def validate(df: pd.DataFrame, schema: pa.DataFrameSchema, name: str) -> pd.DataFrame:
    """Validate ``df`` against ``schema`` (all checks, lazily); return it or raise `SchemaValidationError`."""
    try:
        return schema.validate(df, lazy=True)
    except pa.errors.SchemaErrors as err:
        cases = err.failure_cases
        raise SchemaValidationError(_describe_failures(name, cases), cases) from None


# Data-independent versions for frames read back at a stage boundary (no catalogue bound; dedup assumed)
INTERACTIONS = interactions_schema()
ITEMS = items_schema()
SPLITS = splits_schema()
