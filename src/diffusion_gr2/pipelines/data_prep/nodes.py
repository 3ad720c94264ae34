"""data_prep nodes: raw files → validated interactions, items, chronological split
(docs/architecture.md#data)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from diffusion_gr2.core.data import expectations
from diffusion_gr2.core.data.prepare import PrepConfig, prepare
from diffusion_gr2.core.data.raw import ReadConfig
from diffusion_gr2.core.data.readers import read_dataset
from diffusion_gr2.core.data.schemas import rejects_schema, validate
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history


def prepare_dataset(params: dict[str, Any]) -> dict[str, Any]:
    """Read the configured dataset, set bad rows aside, k-core, remap and split it.

    `prepare` validates every output against its schema (repeated pairs allowed when ``dedup`` is off);
    the rejects are validated here, against `rejects_schema`.
    """
    raw = read_dataset(
        params["dataset"],
        params["raw_root"],
        ReadConfig(max_reject_share=params["max_reject_share"]),
    )
    prepared = prepare(raw, PrepConfig.from_params(params))
    return {
        "interactions": prepared.interactions,
        "items": prepared.items,
        "splits": prepared.splits,
        "rejects": validate(raw.rejects, rejects_schema(), "rejects"),
        "data_stats": prepared.stats,
        "data_prep_metrics": as_metrics_history(prepared.stats),
    }


def validate_splits(splits: pd.DataFrame, items: pd.DataFrame, params: dict[str, Any]) -> dict[str, Any]:
    """Great Expectations suite on the split output; a failing suite stops the run.

    Without dedup a user may legitimately consume an item again, so the no-repeat rules are lifted.
    """
    allow_repeats = not PrepConfig.from_params(params).dedup
    report = expectations.check_splits(splits, num_items=len(items), allow_repeats=allow_repeats)
    report.raise_for_failure()
    return report.as_dict()
