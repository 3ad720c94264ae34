"""benchmark node: decode throughput of ar_rl, `generate` and the diffusion systems in one run
(docs/architecture.md#decoding)."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.bench.benchmark import BENCHMARK_KEYS, BenchmarkConfig, benchmark_requests
from diffusion_gr2.core.evaluate.plots import speedup_by_batch_figure, speedup_by_length_figure
from diffusion_gr2.core.evaluate.rankings import system_key
from diffusion_gr2.core.rank.rerank import RerankConfig
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history

# What each row logs to MLflow: the row's keys (`BENCHMARK_KEYS`, the one list) less its setting (the
# metric's name says it), what is not a number, and the mean output length (a property of the requests,
# not of the decoder's speed). Tokens/s and speed-ups: the harness statistic, row["statistic"].
NOT_LOGGED = frozenset(
    {
        *("system", "tau", "window", "operating_point", "batch_size", "constrained", "backend"),
        *("device", "best_ar", "statistic", "tokens_per_s_by_round", "mean_output_tokens"),
    }
)
MEASURED = tuple(k for k in BENCHMARK_KEYS if k not in NOT_LOGGED)


def _cores() -> int:
    """CPU cores this process may use (the affinity mask, which containers narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _metric_name(row: dict[str, Any]) -> str:
    """`rl.tau0.9.w4.b16.grammar` / `ar_rl.pld.b1.free`: one benchmark row in metric names (MLflow
    allows no `+`)."""
    grammar = "grammar" if row["constrained"] else "free"
    system = str(row["system"]).replace("+", ".")
    return f"{system_key(system, row['tau'], row['window'])}.b{row['batch_size']}.{grammar}"


def benchmark_decoding(
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    operating_point: dict[str, Any],
    params: dict[str, Any],
    **models: PreTrainedModel,
) -> dict[str, Any]:
    """Time ar_rl, `generate`, every diffusion system at its operating point and the tau sweep."""
    torch.set_num_threads(params["num_threads"] or _cores())  # the benchmark owns the process
    decoding, config = RerankConfig(**params["decoding"]), BenchmarkConfig.from_params(params["timing"])
    result = benchmark_requests(
        models, requests, tokenizer, decoding, config, params["split"], operating_points=operating_point
    )
    metrics = {_metric_name(r): {k: r[k] for k in MEASURED} for r in result.rows}
    return {
        "benchmark": result.rows,
        "speedup_by_length": result.length_rows,
        "benchmark_metrics": as_metrics_history(metrics),
        "batch_plot": speedup_by_batch_figure(result.rows, config.reference),
        "length_plot": speedup_by_length_figure(result.length_rows, config.reference),
    }
