"""retrieval nodes: SASRec first stage vs popularity, then validated top-N candidate lists
(docs/architecture.md#items-candidates-and-prompts)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from diffusion_gr2.core.retrieval.candidates import CandidateConfig, build_candidates
from diffusion_gr2.core.retrieval.evaluation import (
    evaluate_test,
    popularity_counts,
    popularity_scorer,
    retrieval_report,
)
from diffusion_gr2.core.retrieval.sasrec import RetrieverConfig, score_users, train_retriever
from diffusion_gr2.core.retrieval.validation import check_candidates, validate_candidates
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history


def retrieve_candidates(
    splits: pd.DataFrame, items: pd.DataFrame, params: dict[str, Any]
) -> tuple[pd.DataFrame, dict[str, Any], dict[str, Any]]:
    """Train the retriever, compare it with popularity full-catalog, and build the candidate lists."""
    num_items, k = len(items), params["eval_k"]
    trained = train_retriever(splits, num_items, RetrieverConfig(**params["retriever"]))

    def retriever(histories):
        return score_users(trained.model, histories)

    popularity = popularity_scorer(popularity_counts(splits, num_items))
    config = CandidateConfig(**params["candidates"])
    candidate_set = build_candidates(splits, retriever, config, num_items)
    report = retrieval_report(
        evaluate_test(retriever, splits, k),
        evaluate_test(popularity, splits, k),
        config.mode,
        candidate_set.users_kept,
    )
    report["retriever"] |= {"best_epoch": trained.best_epoch, "train_seconds": round(trained.seconds, 1)}
    report["rows"] = candidate_set.frame["split"].value_counts().to_dict()
    return candidate_set.frame, report, as_metrics_history(report)


def validate_candidate_lists(
    candidates: pd.DataFrame, items: pd.DataFrame, params: dict[str, Any], dedup: bool
) -> dict[str, Any]:
    """pandera schema and the Great Expectations suite at the pipeline boundary; failures stop the run.

    Without dedup (``data_prep.dedup: false``) a target may legitimately repeat a history item.
    """
    n, num_items = params["candidates"]["n"], len(items)
    require_target = True  # both modes keep the target: `retrieved` drops rows without it
    validate_candidates(candidates, n, num_items, require_target, allow_repeats=not dedup)
    report = check_candidates(candidates, n, num_items, require_target, allow_repeats=not dedup)
    report.raise_for_failure()
    return report.as_dict()
