"""The promotion gate: challenger against champion on the same newest requests (DESIGN §9).

The held-out requests are the test requests whose target is newest in time (the last
`slice_share` of them by target timestamp), in raw item ids so that models trained on different
data preparations (different internal ids, SIDs and tokenizers) are asked exactly the same thing.
A request a compared model cannot serve (an item outside its catalogue) is left out for all.

Thresholds go through `mlflow.validate_evaluation_results`: R@1 no worse than the champion's by
more than `margin`, the served valid rate at least `min_valid_rate`, and the challenger's decoding
speed (output tokens per second) at least `min_speed_ratio` times the AR teacher's on the same
requests. Speed is timed apart from the accuracy pass, as the benchmark times it: at
`speed_batch_size` (1: a request's latency, the paper's claim; the accuracy pass decodes 16 rows
together, where block diffusion gains least), on the first `speed_requests`, after a warm-up call,
the compared models interleaved for `speed_rounds` rounds, best round each.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlflow
import pandas as pd
from mlflow.models import MetricThreshold
from mlflow.models.evaluation import EvaluationResult
from mlflow.models.evaluation.validation import ModelValidationFailedException

from diffusion_gr2.core.rank.metrics import paired_bootstrap
from diffusion_gr2.core.tracking.serving import Ranker, RequestError, parse_request

logger = logging.getLogger(__name__)

__all__ = ["GateConfig", "decide", "newest_slice", "score", "servable", "speeds"]


@dataclass(frozen=True)
class GateConfig:
    """Which requests the gate uses and what a challenger must reach."""

    slice_share: float = 0.1  # newest share of the test requests (by target time)
    max_requests: int = 200  # at most this many of them (CPU time)
    margin: float = 0.02  # R@1 may be this much below the champion's
    min_valid_rate: float = 0.99  # served (after the grammar) valid answers
    min_speed_ratio: float = 1.0  # challenger output tokens/s over the AR teacher's
    speed_batch_size: int = 1  # rows decoded together while timing (1 = one request's latency)
    speed_requests: int = 32  # timed on the first N gate requests
    speed_rounds: int = 3  # interleaved rounds; each model's best counts


def newest_slice(
    candidates: pd.DataFrame, splits: pd.DataFrame, items: pd.DataFrame, config: GateConfig
) -> pd.DataFrame:
    """Test requests with the newest targets, in raw ids: ``request_id, history, candidates, target,
    timestamp, user``."""
    raw_of = dict(zip(items["item_id"].astype(int), items["raw_item_id"].astype(str), strict=True))
    test = candidates[candidates["split"] == "test"].merge(
        splits[["user_id", "test_timestamps"]], on="user_id"
    )
    # each test point at its own time: a user's later points are newer requests
    test = test.assign(
        test_timestamp=[int(ts[p]) for ts, p in zip(test["test_timestamps"], test["point"], strict=True)]
    )
    test = test.sort_values(["test_timestamp", "user_id"], ascending=[False, True], kind="stable")
    n = min(max(1, round(len(test) * config.slice_share)), config.max_requests, len(test))
    rows = test.head(n)
    return pd.DataFrame(
        {
            "request_id": [
                f"user-{u}-point-{p}" for u, p in zip(rows["user_id"], rows["point"], strict=True)
            ],
            "history": [[raw_of[int(i)] for i in h] for h in rows["history"]],
            "candidates": [[raw_of[int(i)] for i in c] for c in rows["candidates"]],
            "target": [raw_of[int(t)] for t in rows["target"]],
            "timestamp": rows["test_timestamp"].astype("int64").to_numpy(),
            "user": rows["user_id"].astype("int64").to_numpy(),  # paired intervals resample users
        }
    ).reset_index(drop=True)


def servable(requests: pd.DataFrame, rankers: Sequence[Ranker]) -> pd.DataFrame:
    """The requests every ranker can serve (each item in every catalogue)."""
    keep = []
    for i, record in enumerate(requests.to_dict("records")):
        try:
            for ranker in rankers:
                parse_request(i, record, ranker.known, ranker.limits)
            keep.append(i)
        except RequestError as err:
            logger.info("gate: request %s left out: %s", record.get("request_id"), err.message)
    return requests.iloc[keep].reset_index(drop=True)


def _answers(
    ranker: Ranker, records: list[dict[str, Any]], batch_size: int | None = None
) -> list[dict[str, Any]]:
    step = ranker.limits.max_requests
    out: list[dict[str, Any]] = []
    for lo in range(0, len(records), step):
        out += ranker.rank(ranker.parse(records[lo : lo + step]), batch_size=batch_size)
    return out


def score(ranker: Ranker, requests: pd.DataFrame) -> dict[str, float]:
    """R@1 and served and unforced valid rates of `ranker` on `requests` (as served: its own batching)."""
    records = requests.to_dict("records")
    answers = _answers(ranker, records)
    hits = [float(a["ranking"][0] == r["target"]) for a, r in zip(answers, records, strict=True)]
    n = max(len(answers), 1)
    return {
        "n": float(len(answers)),
        "hits": hits,  # per request, for the paired interval against the champion
        "recall@1": sum(hits) / n,
        "valid_rate": sum(a["valid"] for a in answers) / n,
        "unforced_rate": sum(a["unforced"] for a in answers) / n,
    }


def speeds(rankers: dict[str, Ranker], requests: pd.DataFrame, config: GateConfig) -> dict[str, float]:
    """Output tokens per second of each ranker on the same first `speed_requests`, interleaved, best round."""
    records = requests.to_dict("records")[: config.speed_requests]
    best = dict.fromkeys(rankers, 0.0)
    for ranker in rankers.values():  # warm-up: first-call allocations are not the model's speed
        _answers(ranker, records[:1], config.speed_batch_size)
    for _ in range(config.speed_rounds):
        for name, ranker in rankers.items():
            start = time.perf_counter()
            answers = _answers(ranker, records, config.speed_batch_size)
            rate = sum(a["output_tokens"] for a in answers) / max(time.perf_counter() - start, 1e-9)
            best[name] = max(best[name], rate)
    return best


def decide(
    challenger: dict[str, Any],
    champion: dict[str, Any] | None,
    teacher: dict[str, Any],
    config: GateConfig,
    users: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """Promote or refuse, with every number and, on refusal, MLflow's reasons.

    With per-request ``hits`` on both sides, the challenger's R@1 minus the champion's gets a paired
    bootstrap interval (whole `users` resampled): the margin applies to the point estimate, the
    interval says how far a few hundred requests can be trusted.
    """
    paired = None
    if champion is not None and "hits" in challenger and "hits" in champion:
        paired = paired_bootstrap(challenger["hits"], champion["hits"], groups=users)
    challenger, champion, teacher = (
        None if m is None else {k: v for k, v in m.items() if k != "hits"}
        for m in (challenger, champion, teacher)
    )
    numbers = {
        "challenger.recall@1": challenger["recall@1"],
        "champion.recall@1": champion["recall@1"] if champion else None,
        "recall@1_vs_champion": challenger["recall@1"] - champion["recall@1"] if champion else 0.0,
        "recall@1_vs_champion.low": paired.low if paired else None,
        "recall@1_vs_champion.high": paired.high if paired else None,
        "valid_rate": challenger["valid_rate"],
        "unforced_rate": challenger["unforced_rate"],
        "speed_ratio_vs_ar_rl": challenger["output_tokens_per_s"] / max(teacher["output_tokens_per_s"], 1e-9),
        "challenger.tokens_per_s": challenger["output_tokens_per_s"],
        "teacher.tokens_per_s": teacher["output_tokens_per_s"],
        "teacher.recall@1": teacher["recall@1"],
        "n_requests": challenger["n"],
    }
    thresholds = {
        "recall@1_vs_champion": MetricThreshold(threshold=-config.margin, greater_is_better=True),
        "valid_rate": MetricThreshold(threshold=config.min_valid_rate, greater_is_better=True),
        "speed_ratio_vs_ar_rl": MetricThreshold(threshold=config.min_speed_ratio, greater_is_better=True),
    }
    metrics = {k: float(numbers[k]) for k in thresholds}
    try:
        mlflow.validate_evaluation_results(thresholds, EvaluationResult(metrics, {}, run_id="gate"))
        decision, reasons = "promote", "every threshold met" + ("" if champion else " (no champion yet)")
    except ModelValidationFailedException as err:
        decision, reasons = "refuse", err.message
    return {
        "decision": decision,
        "reasons": reasons,
        "numbers": numbers,
        "thresholds": {
            "margin": config.margin,
            "min_valid_rate": config.min_valid_rate,
            "min_speed_ratio": config.min_speed_ratio,
        },
        "champion_metrics": champion,
        "challenger_metrics": challenger,
        "teacher_metrics": teacher,
    }
