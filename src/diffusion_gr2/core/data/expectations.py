"""Great Expectations 1.x runner for data frames, and the suite for the ``splits`` frame.

`run_expectations` is generic: other stages pass their own list of GX expectation objects (the
candidate-list suite does). It validates in an ephemeral context (nothing written under
``gx/``), returns a plain `ExpectationReport` and saves it as ``<suite_name>.json`` when asked.
GX imports are inside functions: importing it costs seconds, which callers that never validate
should not pay.

GX has no reliable expectations on list cells (a value-length check passes an empty list), so list
properties of the splits frame are first turned into scalar columns by `split_check_frame`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from diffusion_gr2.core.io import atomic_write_json

logger = logging.getLogger(__name__)

__all__ = [
    "ExpectationReport",
    "ExpectationsFailed",
    "check_splits",
    "run_expectations",
    "split_check_frame",
    "split_suite",
]

DETAIL_KEYS = (
    "element_count",
    "unexpected_count",
    "unexpected_percent",
    "partial_unexpected_list",
    "partial_unexpected_index_list",
    "observed_value",
)
SAMPLE_SIZE = 5  # bad values quoted per failed expectation in `summary()`


class ExpectationsFailed(ValueError):
    """A suite that must pass did not; the message is the report's `summary()`."""


@dataclass(frozen=True)
class ExpectationReport:
    """Outcome of one suite: overall ``success``, GX ``statistics`` and one dict per expectation.

    Each result is ``{"expectation": {"type": ..., "kwargs": {...}}, "success": bool, "details": {...}}``.
    """

    suite_name: str
    success: bool
    statistics: dict[str, Any]
    results: list[dict[str, Any]]

    def failures(self) -> list[dict[str, Any]]:
        """The results whose expectation failed."""
        return [result for result in self.results if not result["success"]]

    def summary(self) -> str:
        """Readable text: the verdict, then each failed expectation with sample bad values and rows."""
        stats = self.statistics
        head = (
            f"suite '{self.suite_name}': {'PASSED' if self.success else 'FAILED'} "
            f"({stats.get('successful_expectations', 0)} of {stats.get('evaluated_expectations', 0)} "
            "expectations met)"
        )
        return "\n".join([head, *(_describe(result) for result in self.failures())])

    def as_dict(self) -> dict[str, Any]:
        """The report as saved in ``<suite_name>.json``."""
        return asdict(self)

    def raise_for_failure(self) -> None:
        """Raise `ExpectationsFailed` with the summary when the suite failed."""
        if not self.success:
            raise ExpectationsFailed(self.summary())


def _describe(result: dict[str, Any]) -> str:
    """One line for a failed expectation: its type and arguments, counts and samples."""
    expectation, details = result["expectation"], result["details"]
    args = ", ".join(f"{k}={v!r}" for k, v in expectation["kwargs"].items())
    line = f"  FAILED {expectation['type']}({args})"
    if "unexpected_count" in details:
        line += (
            f": {details['unexpected_count']} of {details.get('element_count')} rows unexpected "
            f"({details.get('unexpected_percent', 0.0):.2f}%); sample values "
            f"{details.get('partial_unexpected_list', [])[:SAMPLE_SIZE]} at rows "
            f"{details.get('partial_unexpected_index_list', [])[:SAMPLE_SIZE]}"
        )
    elif "observed_value" in details:
        line += f": observed {details['observed_value']!r}"
    if details.get("exception"):
        line += f"; raised {details['exception']}"
    return line


def _plain(value: Any) -> Any:
    """JSON-ready copy of a GX result value (numpy scalars, tuples, nested containers)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


def _exception_message(info: dict[str, Any] | None) -> str | None:
    """The first exception message of a GX result (flat, or nested per metric)."""
    if not info:
        return None
    if "raised_exception" in info:
        return info.get("exception_message") if info.get("raised_exception") else None
    messages = (_exception_message(v) for v in info.values() if isinstance(v, dict))
    return next((m for m in messages if m), None)


def _result_dict(result: Any) -> dict[str, Any]:
    """A GX ``ExpectationValidationResult`` as ``{expectation, success, details}``."""
    config = result.expectation_config
    kwargs = {k: v for k, v in config.kwargs.items() if k != "batch_id"}
    details = {key: result.result[key] for key in DETAIL_KEYS if key in result.result}
    message = _exception_message(result.exception_info)
    if message:
        details["exception"] = message
    return _plain(
        {
            "expectation": {"type": config.type, "kwargs": kwargs},
            "success": bool(result.success),
            "details": details,
        }
    )


def _validate_with_gx(df: pd.DataFrame, suite_name: str, expectations: list[Any]) -> tuple[Any, list[Any]]:
    """Validate ``df`` in a fresh ephemeral context (progress bars and analytics off).

    Returns GX's suite result and its per-expectation results in the order of ``expectations``.
    """
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")  # read by GX when a context starts
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    asset = context.data_sources.add_pandas(f"{suite_name}_source").add_dataframe_asset(suite_name)
    batch = asset.add_batch_definition_whole_dataframe("whole").get_batch(batch_parameters={"dataframe": df})
    suite = gx.ExpectationSuite(name=suite_name, expectations=list(expectations))
    outcome = batch.validate(suite, result_format="SUMMARY")
    # GX groups results by its own order; report them in the order the caller listed them
    # (expectations of an unsaved suite have no id, so match on type and arguments)
    position: dict[str, int] = {}
    for k, expectation in enumerate(suite.expectations):
        position.setdefault(_config_key(expectation.configuration), k)
    results = sorted(
        outcome.results, key=lambda r: position.get(_config_key(r.expectation_config), len(position))
    )
    return outcome, results


def _config_key(config: Any) -> str:
    """Identity of an expectation configuration: its type and arguments (batch id aside)."""
    kwargs = {k: v for k, v in config.kwargs.items() if k != "batch_id"}
    return f"{config.type}:{sorted((k, repr(v)) for k, v in kwargs.items())}"


def run_expectations(
    df: pd.DataFrame, suite_name: str, expectations: list[Any], report_dir: Path | str | None = None
) -> ExpectationReport:
    """Run GX ``expectations`` (expectation objects) on ``df``; save ``<suite_name>.json`` under ``report_dir``.

    Never raises on failed expectations: the caller decides (see ``ExpectationReport.success``).
    An expectation that errors (e.g. a missing column) counts as failed, with the message in details.
    """
    outcome, results = _validate_with_gx(df, suite_name, expectations)
    report = ExpectationReport(
        suite_name=suite_name,
        success=bool(outcome.success),
        statistics=_plain(dict(outcome.statistics)),
        results=[_result_dict(result) for result in results],
    )
    if report_dir is not None:
        atomic_write_json(Path(report_dir) / f"{suite_name}.json", report.as_dict())
    log = logger.info if report.success else logger.warning
    log("%s", report.summary())
    return report


def split_check_frame(splits: pd.DataFrame) -> pd.DataFrame:
    """Scalar view of the ``splits`` frame for GX, indexed by ``user_id`` so failing rows name users.

    An empty train list gets ``min/max_train_item`` = -1, which the range expectations flag.
    ``valid_item_in_train`` / ``test_item_in_train`` cover every validation / test point of the
    user; ``valid_points_ordered`` says the validation points run forward in time from the last
    train interaction on, ``test_points_ordered`` the test points from the last validation point on.
    """
    train = [set(np.asarray(items, dtype=np.int64).tolist()) for items in splits["train_items"]]
    times = [np.asarray(stamps, dtype=np.int64) for stamps in splits["train_timestamps"]]
    points = [np.asarray(items, dtype=np.int64) for items in splits["test_items"]]
    point_times = [np.asarray(stamps, dtype=np.int64) for stamps in splits["test_timestamps"]]
    valids = [np.asarray(items, dtype=np.int64) for items in splits["valid_items"]]
    valid_times = [np.asarray(stamps, dtype=np.int64) for stamps in splits["valid_timestamps"]]
    last_time = np.array([t.max() if t.size else -1 for t in times], dtype=np.int64)
    valid_time = splits["valid_timestamp"].to_numpy()
    last_valid = np.array([t.max() if t.size else np.iinfo(np.int64).max for t in valid_times])
    frame = pd.DataFrame(
        {
            "user_id": splits["user_id"].to_numpy(),
            "valid_item": splits["valid_item"].to_numpy(),
            "test_item": splits["test_item"].to_numpy(),
            "n_train": [len(t) for t in splits["train_items"]],
            "n_train_timestamps": [t.size for t in times],
            "min_train_item": [min(t) if t else -1 for t in train],
            "max_train_item": [max(t) if t else -1 for t in train],
            "n_valid_points": [v.size for v in valids],
            "n_valid_timestamps": [t.size for t in valid_times],
            "min_valid_item": [int(v.min()) if v.size else -1 for v in valids],
            "max_valid_item": [int(v.max()) if v.size else -1 for v in valids],
            "valid_item_is_first": [
                v.size > 0 and int(v[0]) == int(t) for v, t in zip(valids, splits["valid_item"], strict=True)
            ],
            "valid_points_ordered": [
                t.size > 0 and t[0] >= last and bool(np.all(np.diff(t) >= 0))
                for t, last in zip(valid_times, last_time, strict=True)
            ],
            "n_test_points": [p.size for p in points],
            "n_test_timestamps": [t.size for t in point_times],
            "min_test_item": [int(p.min()) if p.size else -1 for p in points],
            "max_test_item": [int(p.max()) if p.size else -1 for p in points],
            "test_item_is_first": [
                p.size > 0 and int(p[0]) == int(t) for p, t in zip(points, splits["test_item"], strict=True)
            ],
            "valid_after_train": valid_time >= last_time,
            "test_after_valid": splits["test_timestamp"].to_numpy() >= last_valid,
            "test_points_ordered": [
                t.size > 0 and t[0] >= v and bool(np.all(np.diff(t) >= 0))
                for t, v in zip(point_times, last_valid, strict=True)
            ],
            "valid_item_in_train": [not t.isdisjoint(v.tolist()) for v, t in zip(valids, train, strict=True)],
            "test_item_in_train": [not t.isdisjoint(p.tolist()) for p, t in zip(points, train, strict=True)],
        }
    )
    return frame.set_index(frame["user_id"].rename("user"))


def split_suite(num_items: int | None = None, allow_repeats: bool = False) -> list[Any]:
    """GX expectations for `split_check_frame` output: one row per user, ids in the catalogue, non-empty
    chronological train part, at least one validation point after it and one test point after the
    validation points, targets not leaked into the train part (unless ``allow_repeats``)."""
    import great_expectations.expectations as gxe

    top = None if num_items is None else num_items - 1
    item_columns = (
        "valid_item",
        "test_item",
        "min_train_item",
        "max_train_item",
        "min_test_item",
        "max_test_item",
        "min_valid_item",
        "max_valid_item",
    )
    suite: list[Any] = [
        gxe.ExpectTableRowCountToBeBetween(min_value=1),
        gxe.ExpectColumnValuesToBeUnique(column="user_id"),
        *(gxe.ExpectColumnValuesToNotBeNull(column=c) for c in ("user_id", "valid_item", "test_item")),
        gxe.ExpectColumnValuesToBeBetween(column="user_id", min_value=0),
        *(gxe.ExpectColumnValuesToBeBetween(column=c, min_value=0, max_value=top) for c in item_columns),
        gxe.ExpectColumnValuesToBeBetween(column="n_train", min_value=1),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="n_train", column_B="n_train_timestamps"),
        gxe.ExpectColumnValuesToBeBetween(column="n_valid_points", min_value=1),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="n_valid_points", column_B="n_valid_timestamps"),
        gxe.ExpectColumnValuesToBeInSet(column="valid_item_is_first", value_set=[True]),
        gxe.ExpectColumnValuesToBeInSet(column="valid_points_ordered", value_set=[True]),
        gxe.ExpectColumnValuesToBeBetween(column="n_test_points", min_value=1),
        gxe.ExpectColumnPairValuesToBeEqual(column_A="n_test_points", column_B="n_test_timestamps"),
        gxe.ExpectColumnValuesToBeInSet(column="test_item_is_first", value_set=[True]),
        gxe.ExpectColumnValuesToBeInSet(column="valid_after_train", value_set=[True]),
        gxe.ExpectColumnValuesToBeInSet(column="test_after_valid", value_set=[True]),
        gxe.ExpectColumnValuesToBeInSet(column="test_points_ordered", value_set=[True]),
    ]
    if not allow_repeats:
        suite += [
            gxe.ExpectColumnValuesToBeInSet(column="valid_item_in_train", value_set=[False]),
            gxe.ExpectColumnValuesToBeInSet(column="test_item_in_train", value_set=[False]),
        ]
    return suite


def check_splits(
    splits: pd.DataFrame,
    num_items: int | None,
    report_dir: Path | str | None = None,
    allow_repeats: bool = False,
    suite_name: str = "splits",
) -> ExpectationReport:
    """Run `split_suite` on a ``splits`` frame (via `split_check_frame`)."""
    return run_expectations(
        split_check_frame(splits), suite_name, split_suite(num_items, allow_repeats), report_dir
    )
