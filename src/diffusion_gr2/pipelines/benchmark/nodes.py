"""benchmark node: decode throughput of the AR teacher and the diffusion systems in one run (DESIGN §8)."""

from __future__ import annotations

import os
from typing import Any

import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.rank.benchmark import BenchmarkConfig, run_benchmark
from diffusion_gr2.core.rank.plots import speedup_figure
from diffusion_gr2.core.rank.rerank import (
    RerankConfig,
    prepare_model,
    request_grammars,
    select_requests,
    system_key,
)
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history


def _cores() -> int:
    """CPU cores this process may use (the affinity mask, which containers narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _benchmark_config(params: dict[str, Any]) -> BenchmarkConfig:
    timing = {k: tuple(v) if isinstance(v, list) else v for k, v in params["timing"].items()}
    return BenchmarkConfig(**timing)


def benchmark_decoding(
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
    **models: PreTrainedModel,
) -> dict[str, Any]:
    """Time every system on the first `n_prompts` test requests, at each tau and batch size."""
    torch.set_num_threads(params["num_threads"] or _cores())  # the benchmark owns the process
    decoding, config = RerankConfig(**params["decoding"]), _benchmark_config(params)
    chosen = select_requests(requests, params["split"], config.n_prompts)
    prompts = [list(p) for p in chosen["prompt_ids"]]
    grammars = request_grammars(tokenizer, chosen) if decoding.constrained else None
    placed = {name: prepare_model(model, decoding.device) for name, model in models.items()}
    result = run_benchmark(placed, prompts, tokenizer, decoding, config, grammars=grammars)
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
