"""data_prep nodes: raw files → validated interactions, items, chronological split (DESIGN §3)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from diffusion_gr2.core.data import expectations, schemas
from diffusion_gr2.core.data.prepare import PrepConfig, prepare
from diffusion_gr2.core.data.raw import ReadConfig
from diffusion_gr2.core.data.readers import read_dataset
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history


def prepare_dataset(params: dict[str, Any]) -> dict[str, Any]:
    """Read the configured dataset, set bad rows aside, k-core, remap and split it."""
    raw = read_dataset(
        params["dataset"],
        params["raw_root"],
        ReadConfig(max_reject_share=params["max_reject_share"]),
    )
    prepared = prepare(raw, PrepConfig.from_params(params))
    schemas.validate(prepared.interactions, schemas.INTERACTIONS, "interactions")
    schemas.validate(prepared.items, schemas.ITEMS, "items")
    schemas.validate(prepared.splits, schemas.SPLITS, "splits")
    return {
        "interactions": prepared.interactions,
        "items": prepared.items,
        "splits": prepared.splits,
        "rejects": raw.rejects,
        "data_stats": prepared.stats,
        "data_prep_metrics": as_metrics_history(prepared.stats),
    }


def validate_splits(splits: pd.DataFrame, items: pd.DataFrame) -> dict[str, Any]:
    """Great Expectations suite on the split output; a failing suite stops the run."""
    report = expectations.check_splits(splits, num_items=len(items))
    report.raise_for_failure()
    return report.as_dict()
