"""Decode throughput of the AR teacher and the block-diffusion systems, on one machine in one run (DESIGN §8).

Every system decodes the same prompts with the same decoder; only the block size and the commit
threshold tau differ. Throughput counts OUTPUT tokens only (the end-of-output token included, never
prompt tokens: a pain point of published numbers). Latency is per request at batch 1 and per batch
otherwise. A batch is always full: when there are fewer prompts than the batch size they are cycled,
so batch 16 really decodes 16 rows together. Systems decode as they are served: under each request's
answer grammar when `RerankConfig.constrained` (its per-token cost is in the figures). Each setting is
warmed up before it is timed (allocator, kernel selection, caches), and the device is synchronised
before the clock is read. With `rounds` > 1 the settings are timed round after round, so a machine
whose speed drifts slows every setting alike.

NFE counts the forward passes a row took part in (prefill included), so tokens per forward is
output tokens / NFE; the speed-up of parallel decoding grows with output length (Diffusion-GR2), which
`speedup_by_length` shows per output-length bucket at batch 1.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.decode.decoder import DecodeConfig, decode
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.rank.rerank import (
    AR_SYSTEMS,
    RerankConfig,
    decode_config_for,
    prepare_model,
    request_grammars,
    select_requests,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = [
    "BENCHMARK_KEYS",
    "BenchmarkConfig",
    "BenchmarkResult",
    "benchmark_requests",
    "describe_device",
    "format_table",
    "full_batches",
    "run_benchmark",
    "speedup_by_length",
    "summarize",
    "time_calls",
]

BENCHMARK_KEYS = (
    "system",
    "tau",
    "batch_size",
    "output_tokens_per_s",
    "nfe_per_sample",
    "tokens_per_forward",
    "latency_p50_ms",
    "latency_p95_ms",
    "mean_output_tokens",
    "device",
)  # DESIGN §10: the exact keys of a `benchmark.json` row


@dataclass(frozen=True)
class BenchmarkConfig:
    """What to time; decoding itself (max tokens, step cap) comes from a `RerankConfig`."""

    n_prompts: int = 32  # the first test requests (sorted by user id)
    batch_sizes: tuple[int, ...] = (1, 16)  # DESIGN §8: report batch 1 and batch 16
    taus: tuple[float, ...] = (1.0, 0.9, 0.6, 0.4)  # thresholds of the diffusion systems (paper's sweep)
    warmup: int = 1  # untimed calls per setting before timing
    # Every setting is timed once per round, rounds one after another: a machine that slows down for
    # a while (shared cores, thermal limits) then slows every setting alike instead of whichever ran.
    rounds: int = 1
    length_buckets: tuple[int, ...] = (32, 64, 128, 256)  # upper edges of the output-length buckets
    reference: str = "ar_rl"  # speed-ups are relative to this (AR) system

    @classmethod
    def from_params(cls, timing: Mapping[str, Any]) -> BenchmarkConfig:
        """From the `benchmark.timing` parameters (YAML lists become tuples)."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in timing.items()})


@dataclass(frozen=True)
class Call:
    """One timed decode call: its wall time and, per row, output tokens and forwards."""

    latency_s: float
    output_tokens: list[int]
    nfe: list[int]


@dataclass(frozen=True)
class BenchmarkResult:
    """`benchmark.json` rows, per-request samples at batch 1, and the speed-up by output length."""

    rows: list[dict[str, Any]]
    samples: pd.DataFrame  # system, tau, output_tokens, nfe, latency_s (one row per batch-1 request)
    length_rows: list[dict[str, Any]]


def describe_device(device: torch.device) -> str:
    """`cuda (NVIDIA H200)` or `cpu (16 threads)`: enough to tell two runs' machines apart."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"{device.type} ({torch.get_num_threads()} threads)"


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so the clock measures it (CPU work is synchronous already)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def full_batches(items: Sequence[T], batch_size: int) -> list[list[T]]:
    """`ceil(n / batch_size)` batches of exactly `batch_size` items (prompts), cycling through `items`."""
    if not items:
        raise ValueError("the benchmark needs at least one prompt")
    n_batches = math.ceil(len(items) / batch_size)
    flat = [items[i % len(items)] for i in range(n_batches * batch_size)]
    return [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]


def time_calls(
    model: PreTrainedModel,
    batches: Sequence[Sequence[Sequence[int]]],
    config: DecodeConfig,
    warmup: int,
    clock: Callable[[], float] = time.perf_counter,
    constraints: Sequence[Sequence[TokenConstraint]] | None = None,
) -> list[Call]:
    """Decode each batch in one `decode` call and time it, after `warmup` untimed calls on the first.

    `constraints[i]`, when given, are the per-prompt constraints of `batches[i]`.
    """
    rows = constraints if constraints is not None else [None] * len(batches)
    for _ in range(warmup):
        decode(model, batches[0], config, rows[0])
    _synchronize(model.device)
    calls = []
    for batch, batch_rows in zip(batches, rows, strict=True):
        start = clock()
        outputs = decode(model, batch, config, batch_rows)
        _synchronize(model.device)
        latency = clock() - start
        calls.append(Call(latency, [len(o.tokens) for o in outputs], [o.nfe for o in outputs]))
    return calls


def summarize(
    system: str, tau: float | None, batch_size: int, calls: Sequence[Call], device: str
) -> dict[str, Any]:
    """One `benchmark.json` row: throughput over all calls, latency percentiles over calls."""
    tokens = [t for c in calls for t in c.output_tokens]
    nfe = [n for c in calls for n in c.nfe]
    latency_ms = np.array([c.latency_s for c in calls]) * 1000.0
    total_s = float(sum(c.latency_s for c in calls))
    return {
        "system": system,
        "tau": None if tau is None else float(tau),
        "batch_size": int(batch_size),
        "output_tokens_per_s": sum(tokens) / total_s if total_s > 0 else float("nan"),
        "nfe_per_sample": float(np.mean(nfe)),
        "tokens_per_forward": sum(tokens) / sum(nfe),
        "latency_p50_ms": float(np.percentile(latency_ms, 50)),
        "latency_p95_ms": float(np.percentile(latency_ms, 95)),
        "mean_output_tokens": float(np.mean(tokens)),
        "device": device,
    }


def _settings(
    models: Mapping[str, PreTrainedModel], config: BenchmarkConfig
) -> list[tuple[str, float | None]]:
    """(system, tau) pairs to time: the reference first, AR systems once, diffusion systems per tau."""
    order = sorted(models, key=lambda s: s != config.reference)
    return [(s, t) for s in order for t in ([None] if s in AR_SYSTEMS else list(config.taus))]


def _samples(system: str, tau: float | None, calls: Sequence[Call]) -> list[dict[str, Any]]:
    """Per-request records of batch-1 calls (one request per call, so its latency is the call's)."""
    tau_value = float("nan") if tau is None else float(tau)
    return [
        {"system": system, "tau": tau_value, "output_tokens": c.output_tokens[0], "nfe": c.nfe[0]}
        | {"latency_s": c.latency_s}
        for c in calls
    ]


def run_benchmark(
    models: Mapping[str, PreTrainedModel],
    prompts: Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase,
    decoding: RerankConfig,
    config: BenchmarkConfig,
    clock: Callable[[], float] = time.perf_counter,
    grammars: Sequence[TokenConstraint] | None = None,
) -> BenchmarkResult:
    """Time every (system, tau, batch size) on `prompts`; models must already sit on their device.

    With `decoding.constrained`, every system decodes under `grammars` (one per prompt), as served.
    """
    if decoding.constrained and (grammars is None or len(grammars) != len(prompts)):
        raise ValueError("decoding.constrained needs one grammar per prompt (rerank.request_grammars)")
    prompt_lists = [list(p) for p in prompts]
    if config.reference not in models:
        logger.warning("reference system %s is not benchmarked: no speed-ups", config.reference)
    settings = [(s, t, b) for s, t in _settings(models, config) for b in config.batch_sizes]
    calls: dict[tuple[str, float | None, int], list[Call]] = {s: [] for s in settings}
    with tqdm(total=len(settings) * config.rounds, desc="benchmark", unit="setting") as bar:
        for _ in range(config.rounds):
            for system, tau, batch_size in settings:
                model = models[system]
                cfg = decode_config_for(model, tokenizer, tau, replace(decoding, batch_size=batch_size))
                constraints = (
                    full_batches(list(grammars), batch_size) if decoding.constrained and grammars else None
                )
                batches = full_batches(prompt_lists, batch_size)
                calls[(system, tau, batch_size)] += time_calls(
                    model, batches, cfg, config.warmup, clock, constraints
                )
                bar.update()
    rows, samples = [], []
    for (system, tau, batch_size), timed in calls.items():
        rows.append(summarize(system, tau, batch_size, timed, describe_device(models[system].device)))
        if batch_size == 1:
            samples += _samples(system, tau, timed)
    frame = pd.DataFrame(samples, columns=["system", "tau", "output_tokens", "nfe", "latency_s"])
    length_rows = speedup_by_length(frame, config.length_buckets, config.reference)
    logger.info("decode benchmark (output tokens only)\n%s", format_table(rows))
    return BenchmarkResult(rows, frame, length_rows)


def benchmark_requests(
    models: Mapping[str, PreTrainedModel],
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    decoding: RerankConfig,
    config: BenchmarkConfig,
    split: str = "test",
) -> BenchmarkResult:
    """`run_benchmark` on the first `config.n_prompts` requests of `split`, as they are served.

    Models go to `decoding.device`; each request decodes under its answer grammar when
    `decoding.constrained`. The Kedro node and `benchmarks/saved_models_bench.py` both call this.
    """
    chosen = select_requests(requests, split, config.n_prompts)
    if chosen.empty:
        raise ValueError(f"no {split!r} requests to benchmark")
    prompts = [list(p) for p in chosen["prompt_ids"]]
    grammars = request_grammars(tokenizer, chosen) if decoding.constrained else None
    placed = {name: prepare_model(model, decoding.device) for name, model in models.items()}
    return run_benchmark(placed, prompts, tokenizer, decoding, config, grammars=grammars)


def _bucket_of(n_tokens: int, edges: Sequence[int]) -> str:
    """`1-32`, `33-64`, ... or `>256`: the output-length bucket of `n_tokens`."""
    low = 0
    for high in edges:
        if n_tokens <= high:
            return f"{low + 1}-{high}"
        low = high
    return f">{low}"


def _bucket_stats(group: pd.DataFrame) -> dict[str, Any]:
    tokens, seconds = int(group["output_tokens"].sum()), float(group["latency_s"].sum())
    return {
        "n": len(group),
        "mean_output_tokens": float(group["output_tokens"].mean()),
        "tokens_per_forward": tokens / int(group["nfe"].sum()),
        "output_tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
    }


def speedup_by_length(
    samples: pd.DataFrame, edges: Sequence[int], reference: str = "ar_rl"
) -> list[dict[str, Any]]:
    """Per (system, tau, output-length bucket) of batch-1 samples: tokens per forward and speed-up.

    speed-up = output tokens/s of the system in the bucket / that of `reference` in the same bucket
    (None when the reference has no request of that length).
    """
    frame = samples.assign(
        bucket=[_bucket_of(int(n), edges) for n in samples["output_tokens"]],
        tau=samples["tau"].astype("float64").fillna(-1.0),  # groupby drops NaN keys
    )
    stats = {key: _bucket_stats(g) for key, g in frame.groupby(["system", "tau", "bucket"], sort=False)}
    ref = {b: s["output_tokens_per_s"] for (name, _, b), s in stats.items() if name == reference}
    rows = []
    for (system, tau, bucket), s in stats.items():
        speedup = s["output_tokens_per_s"] / ref[bucket] if bucket in ref else None
        rows.append(
            {
                "system": system,
                "tau": None if tau < 0 else float(tau),
                "bucket": bucket,
                **s,
                "speedup": speedup,
            }
        )
    return sorted(rows, key=lambda r: (r["system"] != reference, r["mean_output_tokens"]))


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table of `benchmark.json` rows, for the log."""
    head = f"{'system':8s} {'tau':>5s} {'batch':>5s} {'tok/s':>9s} {'NFE/sample':>10s} {'tok/fwd':>7s} "
    head += f"{'p50 ms':>9s} {'p95 ms':>9s} {'out tok':>7s}  device"
    lines = [head]
    for r in rows:
        tau = "-" if r["tau"] is None else f"{r['tau']:g}"
        lines.append(
            f"{r['system']:8s} {tau:>5s} {r['batch_size']:5d} {r['output_tokens_per_s']:9.1f} "
            f"{r['nfe_per_sample']:10.1f} {r['tokens_per_forward']:7.2f} {r['latency_p50_ms']:9.1f} "
            f"{r['latency_p95_ms']:9.1f} {r['mean_output_tokens']:7.1f}  {r['device']}"
        )
    return "\n".join(lines)
