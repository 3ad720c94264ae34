"""Decode throughput of the AR teacher, `generate` and the block-diffusion systems: one machine, one run.

What is timed (DESIGN §8, issues 13 and 17), one `benchmark.json` row per setting:
* `ar_rl` with our decoder (block size 1): the reference of every speed-up;
* `generate`: `transformers`' `model.generate` (greedy, KV cache) on the same `ar_rl` weights
  (`generate_baseline.py`), the baseline a sceptic would reach for;
* each diffusion system at its operating point, the (tau, window) chosen on validation and read from
  `operating_point.json`; a system without one is timed at `unserved_tau` with a warning, its rows
  not marked served (never guessed into an operating point);
* the tau sweep of `sweep_systems` (whole-block window) at `sweep_batch_sizes`: the speed side of
  the speed/accuracy frontier.
Every line is timed under each request's answer grammar (as served; its per-token cost is in the
figures) and free (the model alone). `speedup_vs_ar` is the ratio of output tokens/s to `ar_rl` at the
same batch size and the same constrained flag, measured in the same run.

How. Throughput counts OUTPUT tokens only (the end-of-output token included, never prompt tokens: a
pain point of published numbers). A batch is always full: prompts are cycled, so batch 32 really
decodes 32 rows together. Every setting gets at least `min_calls` timed calls over all rounds (and
decodes every prompt at least once), after `warmup` untimed calls before its first timed one
(allocator, kernel selection, caches). Settings are timed round after round, so a machine whose speed
drifts slows every setting alike. The device is synchronised before the clock is read.

Per request: every request of a call waits for the whole call, so its latency is the call's, and
p50/p95 over requests are those over calls (all calls of a setting have the same batch size). NFE
counts the forward passes a row took part in (prefill included); tokens per forward = output tokens /
NFE (`generate`: one forward per output token). The speed-up of parallel decoding grows with output
length (Diffusion-GR2). The teacher's answers are all about as long, so the length sweep varies the
length on purpose: each served line is timed again at batch 1 under smaller reasoning budgets
(`length_budgets`, max_new_tokens), where the grammar closes the explanation early to fit the
ranking; `speedup_by_length` compares each budget with the reference under the same budget.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.decode.decoder import decode, resolved_backend
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.rank.generate_baseline import generate_tokens
from diffusion_gr2.core.rank.operating_point import OperatingPointError, resolve_operating_point
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
    "backend_of",
    "BENCHMARK_KEYS",
    "GENERATE",
    "BenchmarkConfig",
    "BenchmarkResult",
    "Setting",
    "add_speedups",
    "benchmark_requests",
    "calls_per_round",
    "cycled_batches",
    "describe_device",
    "format_table",
    "full_batches",
    "plan_settings",
    "ranked_speed",
    "run_benchmark",
    "speedup_by_length",
    "summarize",
    "time_calls",
    "time_candidates",
]

GENERATE = "generate"  # row name of `transformers` `generate` on the reference system's weights
BENCHMARK_KEYS = (
    "system",
    "tau",
    "window",
    "operating_point",
    "batch_size",
    "constrained",
    "backend",
    "output_tokens_per_s",
    "nfe_per_sample",
    "tokens_per_forward",
    "latency_p50_ms",
    "latency_p95_ms",
    "mean_output_tokens",
    "device",
    "speedup_vs_ar",
)  # DESIGN §10 keys of a `benchmark.json` row, plus `window` and `operating_point`


@dataclass(frozen=True)
class BenchmarkConfig:
    """What to time; decoding itself (max tokens, step cap, commit rule) comes from a `RerankConfig`.

    `RerankConfig.constrained` and `.batch_size` are not used here: `constrained` and `batch_sizes`
    below say which lines are timed.
    """

    n_prompts: int = 20  # the first requests of the split (sorted by user id)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)  # issue 17's batch sweep (DESIGN §8: at least 1 and 16)
    # Systems timed at other batch sizes than `batch_sizes` (at their operating point): a full batch
    # sweep of every intermediate stage costs more than it tells.
    system_batch_sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    constrained: tuple[bool, ...] = (True, False)  # a line under the answer grammar (as served), one free
    generate_constrained: bool = True  # `generate` under the grammar too (a LogitsProcessor), not only free
    taus: tuple[float, ...] = (1.0, 0.9, 0.6, 0.4)  # the sweep's thresholds (the paper's), whole block
    sweep_systems: tuple[str, ...] = ("rl",)  # diffusion systems timed at every tau (frontier plot)
    sweep_batch_sizes: tuple[int, ...] = (1, 16)  # the sweep at fewer batch sizes: it is costly
    sweep_constrained: tuple[bool, ...] = (True,)  # the frontier plots R@1 as served, so speed as served
    # A diffusion system with no operating point (refused, or not chosen for it) is still timed at this
    # tau (whole block) at its batch sizes, as a line that is not served (`operating_point` false), so
    # the batch sweep shows what it would give; None = not timed at all.
    unserved_tau: float | None = 0.9
    min_calls: int = 20  # timed calls per setting, all rounds together (issue 13: >= 20 at batch 16)
    warmup: int = 1  # untimed calls per setting before its first timed call
    # Every setting is timed once per round, rounds one after another: a machine that slows down for
    # a while (shared cores, thermal limits) then slows every setting alike instead of whichever ran.
    rounds: int = 4  # 20 calls = 5 per round
    # The length sweep: reasoning budgets (max_new_tokens) each served line (the reference and every
    # diffusion system at its operating point, or at `unserved_tau`) is decoded under at batch 1 under
    # the grammar, which closes the explanation early to fit the ranking: output length varied on
    # purpose (the teacher's answers are otherwise all ~115 tokens). The natural budget is the batch-1
    # row itself. () = no length sweep.
    length_budgets: tuple[int, ...] = (64, 80, 96)
    reference: str = "ar_rl"  # speed-ups are relative to this (AR) system; `generate` runs its weights

    @classmethod
    def from_params(cls, timing: Mapping[str, Any]) -> BenchmarkConfig:
        """From the `benchmark.timing` parameters (YAML lists become tuples)."""
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in timing.items()}
        if "system_batch_sizes" in fields:
            fields["system_batch_sizes"] = {
                s: tuple(b) for s, b in (fields["system_batch_sizes"] or {}).items()
            }
        return cls(**fields)

    def batch_sizes_of(self, system: str) -> tuple[int, ...]:
        """The batch sizes `system` is timed at (at its operating point)."""
        return tuple(self.system_batch_sizes.get(system, self.batch_sizes))


@dataclass(frozen=True)
class Setting:
    """One timed configuration, one `benchmark.json` row."""

    system: str  # a system, or GENERATE
    tau: float | None  # commit threshold; None = AR (block size 1)
    window: int | None  # decoding window of a diffusion system; None = the whole block (and AR)
    constrained: bool  # under each request's answer grammar (as served) or free
    batch_size: int
    operating_point: bool  # as served: AR rows, `generate`, a diffusion system at its chosen (tau, window)
    budget: int | None = None  # max_new_tokens of the length sweep; None = the decoding's own

    @property
    def key(self) -> tuple[str, float | None, int | None, bool, int, int | None]:
        return self.system, self.tau, self.window, self.constrained, self.batch_size, self.budget


@dataclass(frozen=True)
class Call:
    """One timed decode call: its wall time and, per row, output tokens and forwards."""

    latency_s: float
    output_tokens: list[int]
    nfe: list[int]


@dataclass(frozen=True)
class BenchmarkResult:
    """`benchmark.json` rows, per-request samples at batch 1 (as served), the speed-up by output length."""

    rows: list[dict[str, Any]]
    samples: pd.DataFrame  # system, tau, window, output_tokens, nfe, latency_s (one row per request)
    length_rows: list[dict[str, Any]]
    calls: dict[tuple[str, float | None, int | None, bool, int], int]  # timed calls per `Setting.key`


def describe_device(device: torch.device) -> str:
    """`cuda (NVIDIA H200)` or `cpu (16 threads)`: enough to tell two runs' machines apart."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"{device.type} ({torch.get_num_threads()} threads)"


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so the clock measures it (CPU work is synchronous already)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cycled_batches(items: Sequence[T], batch_size: int, n_batches: int, start: int = 0) -> list[list[T]]:
    """`n_batches` batches of exactly `batch_size` items, cycling through `items` from index `start`."""
    if not items:
        raise ValueError("the benchmark needs at least one prompt")
    flat = [items[(start + i) % len(items)] for i in range(n_batches * batch_size)]
    return [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]


def full_batches(items: Sequence[T], batch_size: int) -> list[list[T]]:
    """`ceil(n / batch_size)` batches of exactly `batch_size` items (prompts), cycling through `items`."""
    return cycled_batches(items, batch_size, math.ceil(len(items) / batch_size) if items else 1)


def calls_per_round(batch_size: int, n_prompts: int, config: BenchmarkConfig) -> int:
    """Timed calls of a setting in each round: `min_calls` in all, and every prompt decoded at least once."""
    total = max(config.min_calls, math.ceil(n_prompts / batch_size))
    return math.ceil(total / config.rounds)


def plan_settings(
    systems: Sequence[str], points: Mapping[str, Any] | None, config: BenchmarkConfig
) -> list[Setting]:
    """Every setting to time, in row order: AR systems (reference first), `generate`, operating points, sweep.

    `points` is `operating_point.json`. A diffusion system without an operating point there (none
    chosen, or refused) gets no operating-point rows, with a warning; it is timed at
    `config.unserved_tau` instead (rows not marked `operating_point`), and its sweep rows stay.
    A sweep point that is also the operating point is timed once (its row says `operating_point`).
    """
    # (system, tau, window, operating point, batch sizes, constrained flags) of each line
    lines: list[tuple[str, float | None, int | None, bool, tuple[int, ...], tuple[bool, ...]]] = []
    for system in sorted((s for s in systems if s in AR_SYSTEMS), key=lambda s: s != config.reference):
        lines.append((system, None, None, True, config.batch_sizes_of(system), config.constrained))
    if config.reference in systems:
        flags = tuple(c for c in config.constrained if not c or config.generate_constrained)
        lines.append((GENERATE, None, None, True, config.batch_sizes_of(GENERATE), flags))
    for system in (s for s in systems if s not in AR_SYSTEMS):
        try:
            tau, window = resolve_operating_point(points, system)
        except OperatingPointError as err:
            logger.warning("benchmark: %s is not timed at an operating point: %s", system, err)
            if config.unserved_tau is not None:  # not served, but its speed across batch sizes is shown
                tau = float(config.unserved_tau)
                lines.append((system, tau, None, False, config.batch_sizes_of(system), config.constrained))
            continue
        lines.append((system, tau, window, True, config.batch_sizes_of(system), config.constrained))
    for system in (s for s in config.sweep_systems if s in systems and s not in AR_SYSTEMS):
        sweep = (config.sweep_batch_sizes, config.sweep_constrained)
        lines += [(system, float(tau), None, False, *sweep) for tau in config.taus]
    settings: dict[tuple, Setting] = {}
    for system, tau, window, point, sizes, flags in lines:
        for constrained in flags:
            for b in sizes:
                setting = Setting(system, tau, window, constrained, b, point)
                settings.setdefault(setting.key, setting)  # the first (operating-point) line wins
    return list(settings.values())


def plan_length_settings(settings: Sequence[Setting], config: BenchmarkConfig) -> list[Setting]:
    """The length sweep: each system's served line at batch 1 under the grammar (its operating point,
    or the `unserved_tau` line of a system without one; not `generate`), once per budget."""
    lines: dict[str, Setting] = {}
    for s in settings:
        if s.batch_size != 1 or not s.constrained or s.system == GENERATE:
            continue
        unserved = (
            config.unserved_tau is not None and s.tau == float(config.unserved_tau) and s.window is None
        )
        if s.operating_point or unserved:  # a system's operating-point lines come before its sweep
            lines.setdefault(s.system, s)
    return [replace(s, budget=int(b)) for s in lines.values() for b in config.length_budgets]


Runner = Callable[[list[list[int]], list[TokenConstraint] | None], list[tuple[int, int]]]


def make_runner(
    setting: Setting,
    models: Mapping[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    decoding: RerankConfig,
    reference: str,
) -> tuple[Runner, torch.device]:
    """The decode call `setting` times, returning (output tokens, NFE) per row, and its device."""
    # one call decodes one whole batch; the length sweep caps the output
    rerank = replace(
        decoding, batch_size=setting.batch_size, max_new_tokens=setting.budget or decoding.max_new_tokens
    )
    if setting.system == GENERATE:
        hf_model = models[reference]
        hf_cfg = decode_config_for(hf_model, tokenizer, None, rerank)

        def run_generate(batch: list[list[int]], rows: list[TokenConstraint] | None) -> list[tuple[int, int]]:
            return [(len(t), len(t)) for t in generate_tokens(hf_model, batch, hf_cfg, rows)]

        return run_generate, hf_model.device
    model = models[setting.system]
    cfg = replace(decode_config_for(model, tokenizer, setting.tau, rerank), window=setting.window)

    def run_decode(batch: list[list[int]], rows: list[TokenConstraint] | None) -> list[tuple[int, int]]:
        return [(len(o.tokens), o.nfe) for o in decode(model, batch, cfg, rows)]

    return run_decode, model.device


def backend_of(
    setting: Setting, models: Mapping[str, PreTrainedModel], decoding: RerankConfig, reference: str
) -> str:
    """The model forward `setting` runs (`decoding.backend` resolved); `generate` runs the modules."""
    model = models[reference if setting.system == GENERATE else setting.system]
    return "eager" if setting.system == GENERATE else resolved_backend(model, decoding.backend)


def time_calls(
    run: Runner,
    batches: Sequence[list[list[int]]],
    warmup: int,
    device: torch.device,
    clock: Callable[[], float] = time.perf_counter,
    constraints: Sequence[list[TokenConstraint]] | None = None,
) -> list[Call]:
    """Run each batch in one call and time it, after `warmup` untimed calls on the first batch.

    `constraints[i]`, when given, are the per-prompt constraints of `batches[i]`.
    """
    rows = constraints if constraints is not None else [None] * len(batches)
    for _ in range(warmup):
        run(batches[0], rows[0])
    _synchronize(device)
    calls = []
    for batch, batch_rows in zip(batches, rows, strict=True):
        start = clock()
        counts = run(batch, batch_rows)
        _synchronize(device)
        latency = clock() - start
        calls.append(Call(latency, [t for t, _ in counts], [n for _, n in counts]))
    return calls


def summarize(setting: Setting, calls: Sequence[Call], device: str, backend: str) -> dict[str, Any]:
    """One `benchmark.json` row: throughput over all calls, latency percentiles over requests.

    `speedup_vs_ar` stays None here; `add_speedups` fills it once every row of the run is known.
    """
    tokens = [t for c in calls for t in c.output_tokens]
    nfe = [n for c in calls for n in c.nfe]
    latency_ms = np.array([c.latency_s for c in calls]) * 1000.0  # each request waits for its call
    total_s = float(sum(c.latency_s for c in calls))
    return {
        "system": setting.system,
        "tau": None if setting.tau is None else float(setting.tau),
        "window": setting.window,
        "operating_point": setting.operating_point,
        "batch_size": int(setting.batch_size),
        "constrained": setting.constrained,
        "backend": backend,
        "output_tokens_per_s": sum(tokens) / total_s if total_s > 0 else float("nan"),
        "nfe_per_sample": float(np.mean(nfe)),
        "tokens_per_forward": sum(tokens) / sum(nfe),
        "latency_p50_ms": float(np.percentile(latency_ms, 50)),
        "latency_p95_ms": float(np.percentile(latency_ms, 95)),
        "mean_output_tokens": float(np.mean(tokens)),
        "device": device,
        "speedup_vs_ar": None,
    }


def add_speedups(rows: Sequence[Mapping[str, Any]], reference: str = "ar_rl") -> list[dict[str, Any]]:
    """`speedup_vs_ar` of every row: its output tokens/s over `reference`'s at the same batch size and
    constrained flag (None when the reference has no such row)."""
    ref = {
        (r["batch_size"], r["constrained"]): r["output_tokens_per_s"]
        for r in rows
        if r["system"] == reference
    }
    out = []
    for row in rows:
        base = ref.get((row["batch_size"], row["constrained"]))
        speedup = row["output_tokens_per_s"] / base if base else None
        out.append({**row, "speedup_vs_ar": speedup})
    return out


def _time_rounds(
    settings: Sequence[Setting],
    runners: Mapping[Setting, tuple[Runner, torch.device]],
    prompts: Sequence[list[int]],
    grammars: Sequence[TokenConstraint] | None,
    config: BenchmarkConfig,
    clock: Callable[[], float],
    desc: str = "benchmark",
) -> dict[Setting, list[Call]]:
    """Every setting's calls, round after round; each round goes on cycling the prompts where the last
    one stopped, so the rounds together cover the prompts evenly."""
    calls: dict[Setting, list[Call]] = {s: [] for s in settings}
    with tqdm(total=len(settings) * config.rounds, desc=desc, unit="setting") as bar:
        for round_index in range(config.rounds):
            for setting in settings:
                b = setting.batch_size
                n = calls_per_round(b, len(prompts), config)
                start = round_index * n * b
                batches = cycled_batches(prompts, b, n, start)
                rows = cycled_batches(grammars, b, n, start) if setting.constrained and grammars else None
                run, device = runners[setting]
                warmup = config.warmup if round_index == 0 else 0
                calls[setting] += time_calls(run, batches, warmup, device, clock, rows)
                bar.update()
    return calls


def time_candidates(
    model: PreTrainedModel,
    system: str,
    candidates: Sequence[tuple[float, int | None]],
    prompts: Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase,
    decoding: RerankConfig,
    config: BenchmarkConfig,
    grammars: Sequence[TokenConstraint] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[tuple[float, int | None], dict[int, float]]:
    """Output tokens/s of each (tau, window) of `system` at every `config.batch_sizes`, one run.

    The operating point's speed side: the same rounds, warm-up and full batches as the benchmark, all
    candidates interleaved, under `grammars` when given (as served). A pass over the validation split
    is one cold measurement per setting; this is several, side by side.
    """
    constrained = grammars is not None
    settings = [
        Setting(system, float(tau), window, constrained, b, False)
        for tau, window in candidates
        for b in config.batch_sizes
    ]
    runners = {s: make_runner(s, {system: model}, tokenizer, decoding, config.reference) for s in settings}
    calls = _time_rounds(settings, runners, [list(p) for p in prompts], grammars, config, clock, "timing")
    out: dict[tuple[float, int | None], dict[int, float]] = {}
    for s in settings:
        row = summarize(s, calls[s], "", "")
        out.setdefault((float(s.tau), s.window), {})[s.batch_size] = row["output_tokens_per_s"]
    return out


def ranked_speed(by_batch: Mapping[int, float]) -> dict[str, Any]:
    """A timed candidate's speed fields: its tokens/s per batch size (`tokens_per_s_by_batch`) and the
    figure the operating point ranks by (`tokens_per_s`), their geometric mean: each batch size
    weighs the same, whatever its scale."""
    mean_log = sum(math.log(max(v, 1e-12)) for v in by_batch.values()) / len(by_batch)
    return {
        "tokens_per_s_by_batch": {str(b): v for b, v in sorted(by_batch.items())},
        "tokens_per_s": math.exp(mean_log),
    }


def _samples(setting: Setting, calls: Sequence[Call]) -> list[dict[str, Any]]:
    """Per-request records of batch-1 calls (one request per call, so its latency is the call's)."""
    tau = float("nan") if setting.tau is None else float(setting.tau)
    window = float("nan") if setting.window is None else float(setting.window)
    return [
        {"system": setting.system, "tau": tau, "window": window}
        | {"output_tokens": c.output_tokens[0], "nfe": c.nfe[0], "latency_s": c.latency_s}
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
    operating_points: Mapping[str, Any] | None = None,
) -> BenchmarkResult:
    """Time every setting of `plan_settings` on `prompts`; models must already sit on their device.

    Constrained settings decode under `grammars` (one per prompt), as served.
    """
    settings = plan_settings(list(models), operating_points, config)
    lengths = plan_length_settings(settings, config)
    if any(s.constrained for s in settings) and (grammars is None or len(grammars) != len(prompts)):
        raise ValueError("constrained settings need one grammar per prompt (rerank.request_grammars)")
    if config.reference not in models:
        logger.warning("reference system %s is not benchmarked: no speed-ups, no generate", config.reference)
    timed = [*settings, *lengths]
    runners = {s: make_runner(s, models, tokenizer, decoding, config.reference) for s in timed}
    calls = _time_rounds(timed, runners, [list(p) for p in prompts], grammars, config, clock)
    rows = add_speedups(
        [
            summarize(
                s, calls[s], describe_device(runners[s][1]), backend_of(s, models, decoding, config.reference)
            )
            for s in settings
        ],
        config.reference,
    )
    served = True in config.constrained  # the length buckets are measured as served
    samples = [
        x for s in settings if s.batch_size == 1 and s.constrained == served for x in _samples(s, calls[s])
    ]
    frame = pd.DataFrame(samples, columns=["system", "tau", "window", "output_tokens", "nfe", "latency_s"])
    swept = {replace(s, budget=None) for s in lengths}
    natural = [s for s in settings if s in swept]
    length_rows = speedup_by_length(
        [(s, calls[s]) for s in [*natural, *lengths]], decoding.max_new_tokens, config.reference
    )
    logger.info("decode benchmark (output tokens only)\n%s", format_table(rows))
    return BenchmarkResult(rows, frame, length_rows, {s.key: len(c) for s, c in calls.items()})


def benchmark_requests(
    models: Mapping[str, PreTrainedModel],
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    decoding: RerankConfig,
    config: BenchmarkConfig,
    split: str = "test",
    operating_points: Mapping[str, Any] | None = None,
) -> BenchmarkResult:
    """`run_benchmark` on the first `config.n_prompts` requests of `split`, each with its answer grammar.

    Models go to `decoding.device`; `operating_points` is `operating_point.json`. The Kedro node and
    `benchmarks/saved_models_bench.py` both call this.
    """
    chosen = select_requests(requests, split, config.n_prompts)
    if chosen.empty:
        raise ValueError(f"no {split!r} requests to benchmark")
    prompts = [list(p) for p in chosen["prompt_ids"]]
    grammars = request_grammars(tokenizer, chosen)
    placed = {name: prepare_model(model, decoding.device) for name, model in models.items()}
    return run_benchmark(
        placed, prompts, tokenizer, decoding, config, grammars=grammars, operating_points=operating_points
    )


def speedup_by_length(
    timed: Sequence[tuple[Setting, Sequence[Call]]], natural_budget: int, reference: str = "ar_rl"
) -> list[dict[str, Any]]:
    """`speedup_by_length.json` rows: per line and reasoning budget, output length and speed-up.

    speed-up = output tokens/s of the line / that of `reference` under the same budget, same run (None
    when the reference was not timed there). A budget of None is the decoding's own (`natural_budget`).
    """
    rows = []
    for setting, calls in timed:
        tokens = sum(sum(c.output_tokens) for c in calls)
        seconds = sum(c.latency_s for c in calls)
        rows.append(
            {
                "system": setting.system,
                "tau": setting.tau,
                "window": setting.window,
                "operating_point": setting.operating_point,
                "budget": setting.budget or natural_budget,
                "n": sum(len(c.output_tokens) for c in calls),
                "mean_output_tokens": tokens / max(sum(len(c.output_tokens) for c in calls), 1),
                "tokens_per_forward": tokens / max(sum(sum(c.nfe) for c in calls), 1),
                "output_tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            }
        )
    ref = {r["budget"]: r["output_tokens_per_s"] for r in rows if r["system"] == reference}
    for r in rows:
        r["speedup"] = r["output_tokens_per_s"] / ref[r["budget"]] if r["budget"] in ref else None
    return sorted(rows, key=lambda r: (r["system"] != reference, r["system"], r["budget"]))


def _setting_label(row: Mapping[str, Any]) -> str:
    """`rl τ=0.9 w4` / `ar_rl`: a row's system and decoding setting."""
    label = str(row["system"]) if row["tau"] is None else f"{row['system']} τ={row['tau']:g}"
    return label if row.get("window") is None else f"{label} w{row['window']}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table of `benchmark.json` rows, for the log (* = operating point)."""
    head = f"{'setting':18s} {'grammar':>7s} {'batch':>5s} {'tok/s':>9s} {'NFE/sample':>10s} {'tok/fwd':>7s} "
    head += f"{'p50 ms':>9s} {'p95 ms':>9s} {'out tok':>7s} {'vs AR':>6s}  device"
    lines = [head]
    for r in rows:
        label = ("* " if r["operating_point"] else "  ") + _setting_label(r)
        speedup = "-" if r["speedup_vs_ar"] is None else f"{r['speedup_vs_ar']:.2f}"
        lines.append(
            f"{label:18s} {'on' if r['constrained'] else 'off':>7s} {r['batch_size']:5d} "
            f"{r['output_tokens_per_s']:9.1f} {r['nfe_per_sample']:10.1f} {r['tokens_per_forward']:7.2f} "
            f"{r['latency_p50_ms']:9.1f} {r['latency_p95_ms']:9.1f} {r['mean_output_tokens']:7.1f} "
            f"{speedup:>6s}  {r['device']}"
        )
    return "\n".join(lines)
