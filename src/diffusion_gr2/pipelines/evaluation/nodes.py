"""evaluation nodes: stage metrics with intervals, paired comparisons, reasoning quality, table, plots and
the run report (docs/evaluation.md)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from transformers import PreTrainedTokenizerFast

from diffusion_gr2.core.base.manifest import current_manifest
from diffusion_gr2.core.evaluate.metrics import REASONING_METRICS, prompt_contexts, reasoning_metrics
from diffusion_gr2.core.evaluate.plots import metric_figure, valid_rate_figure
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.evaluate.rankings import (
    EvaluationConfig,
    compare_systems,
    eval_metrics,
    metrics_markdown,
    stage_metrics,
    system_key,
)
from diffusion_gr2.core.evaluate.report import (
    ReportInputs,
    decoding_stats,
    load_training_curves,
    markdown_to_html,
    render_markdown,
    report_figures,
    report_run,
)
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history


def _config(params: dict[str, Any]) -> EvaluationConfig:
    return EvaluationConfig(
        n_boot=params["n_boot"],
        seed=params["seed"],
        baselines=tuple(params["baselines"]),
        compare_metrics=tuple(params["compare_metrics"]),
    )


def compute_stage_metrics(rankings: pd.DataFrame, params: dict[str, Any]) -> dict[str, Any]:
    """`stage_metrics.json` rows (one per system and tau) and the same as a markdown table."""
    config = _config(params)
    rows = stage_metrics(rankings, config.n_boot, config.seed)
    return {"stage_metrics": rows, "stage_metrics_md": metrics_markdown(rows)}


def compare_to_baselines(
    rankings: pd.DataFrame, params: dict[str, Any], policy: dict[str, Any]
) -> list[dict[str, Any]]:
    """Paired bootstrap of every system against the AR teacher and the pre-rank, at the serving
    policy's level (`params:policy`: the level the operating point and the gate decide at)."""
    return compare_systems(rankings, _config(params), Policy.from_params(policy).level)


def log_eval_metrics(stage_rows: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> dict[str, Any]:
    """Metric means and comparison differences as MLflow metrics (`eval.cft.tau0.9.recall_at_1`)."""
    return as_metrics_history(eval_metrics(stage_rows, comparisons))


def plot_stage_metrics(stage_rows: list[dict[str, Any]]) -> dict[str, Figure]:
    """R@1 with 95% intervals and the valid-output rate, per system and tau, on test (what is reported)."""
    test = [r for r in stage_rows if r.get("split", "test") == "test"]
    return {
        "recall_plot": metric_figure(test, "recall@1"),
        "valid_rate_plot": valid_rate_figure(test),
    }


def compute_reasoning_metrics(
    rankings: pd.DataFrame, requests: pd.DataFrame, tokenizer: PreTrainedTokenizerFast, params: dict[str, Any]
) -> dict[str, Any]:
    """Grounded citations, stated-pick agreement and explanation length per variant (no LLM judge)."""
    config = _config(params)
    asked = requests.merge(rankings[["split", "user_id"]].drop_duplicates(), on=["split", "user_id"])
    contexts = prompt_contexts(asked, tokenizer.decode)  # SID tokens are kept: they are not special
    rows = reasoning_metrics(
        rankings,
        contexts,
        lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
        config.n_boot,
        config.seed,
    )
    metrics = {
        system_key(r["system"], r["tau"], r["window"], r["split"]): {m: r[m] for m in REASONING_METRICS}
        for r in rows
    }
    return {"reasoning_metrics": rows, "reasoning_mlflow": as_metrics_history(metrics)}


def write_report(
    stage_rows: list[dict[str, Any]],
    comparisons: list[dict[str, Any]],
    reasoning: list[dict[str, Any]],
    rankings: pd.DataFrame,
    params: dict[str, Any],
    **files: Any,
) -> dict[str, Any]:
    """`report.md` and `report.html` from the run's files, and the figures they show.

    `files`: `operating_point`, `data_stats`, `sid_report`, `retrieval_report`, `benchmark`,
    `speedup_by_length`, `decode_profile` (each None when absent), `runs` (the report files' manifests);
    the training curves come from the MLflow run the stage table came from (`report_run`), never from
    another run.
    """
    stages = tuple(params["report"]["training_stages"])
    writing_run = current_manifest().run_id
    curves = load_training_curves(report_run(files.get("runs"), writing_run), stages)
    inputs = ReportInputs(
        stage_rows,
        comparisons,
        reasoning,
        decoding_stats(rankings),
        training_curves=curves,
        training_stages=stages,
        writing_run=writing_run,
        **files,
    )
    figures = report_figures(inputs)
    markdown = render_markdown(inputs, figures)
    return {
        "report_md": markdown,
        "report_html": markdown_to_html(markdown, figures),
        "frontier_plot": figures["frontier"],
        "own_valid_plot": figures["own_valid_rate"],
        "training_plot": figures["training_curves"],
    }
