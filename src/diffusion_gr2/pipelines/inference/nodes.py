"""inference nodes: every system re-ranks the test requests; one rankings frame (DESIGN §8, §10)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.rank.rerank import (
    RerankConfig,
    prepare_model,
    prerank_rows,
    rankings_summary,
    rerank_system,
    select_requests,
)
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history


def _test_requests(requests: pd.DataFrame, params: dict[str, Any]) -> pd.DataFrame:
    return select_requests(requests, params["split"], params["max_users"])


def rerank_prerank(requests: pd.DataFrame, params: dict[str, Any]) -> pd.DataFrame:
    """The retriever's order served as is: the floor every model must beat."""
    return prerank_rows(_test_requests(requests, params))


def make_rerank_node(system: str) -> Callable[..., pd.DataFrame]:
    """The node function of one model system (named `rerank_<system>` for the DAG and the logs)."""

    def rerank_model(
        model: PreTrainedModel,
        requests: pd.DataFrame,
        tokenizer: PreTrainedTokenizerFast,
        params: dict[str, Any],
    ) -> pd.DataFrame:
        config = RerankConfig(**params["decoding"])
        model = prepare_model(model, config.device)
        return rerank_system(
            model, _test_requests(requests, params), tokenizer, system, params["taus"], config
        )

    rerank_model.__name__ = rerank_model.__qualname__ = f"rerank_{system}"
    rerank_model.__doc__ = f"Re-rank the test requests with `{system}` (each tau for a diffusion model)."
    return rerank_model


def combine_rankings(*frames: pd.DataFrame) -> dict[str, Any]:
    """All systems' rows in one frame, plus per-system decoding figures for MLflow."""
    # AR systems have no tau (all NaN): one float dtype everywhere keeps the concatenation well defined.
    rankings = pd.concat([f.astype({"tau": "float64"}) for f in frames], ignore_index=True)
    return {"rankings": rankings, "inference_metrics": as_metrics_history(rankings_summary(rankings))}
