"""benchmark node: decode throughput of the AR teacher and the diffusion systems in one run (DESIGN §8)."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.rank.benchmark import BenchmarkConfig, benchmark_requests
from diffusion_gr2.core.rank.plots import speedup_figure
from diffusion_gr2.core.rank.rerank import RerankConfig, system_key
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history


def _cores() -> int:
    """CPU cores this process may use (the affinity mask, which containers narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def benchmark_decoding(
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
    **models: PreTrainedModel,
) -> dict[str, Any]:
    """Time every system on the first `n_prompts` test requests, at each tau and batch size."""
    torch.set_num_threads(params["num_threads"] or _cores())  # the benchmark owns the process
    decoding, config = RerankConfig(**params["decoding"]), BenchmarkConfig.from_params(params["timing"])
    result = benchmark_requests(models, requests, tokenizer, decoding, config, params["split"])
    measured = (
        "output_tokens_per_s",
        "nfe_per_sample",
        "tokens_per_forward",
        "latency_p50_ms",
        "latency_p95_ms",
    )
    metrics = {
        f"{system_key(r['system'], r['tau'])}.b{r['batch_size']}": {k: r[k] for k in measured}
        for r in result.rows
    }
    return {
        "benchmark": result.rows,
        "speedup_by_length": result.length_rows,
        "benchmark_metrics": as_metrics_history(metrics),
        "speedup_plot": speedup_figure(result.length_rows, config.reference),
    }
