"""Decode throughput of the AR teacher, `generate` and the block-diffusion systems: one machine, one run.

What is timed (docs/architecture.md#decoding; issues 13 and 17), one `benchmark.json` row per setting:
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
same batch size and the same constrained flag, measured in the same run, paired by round, with its
interval (`speedup_vs_ar_low`, `_high`).

How: the one timing harness (`harness.py`: warm-up, interleaved rounds, full batches, the median
over rounds, sign-test intervals of the per-round ratios; each row names it in `statistic` and keeps
its per-round figures in `tokens_per_s_by_round`). Throughput counts OUTPUT tokens only (the
end-of-output token included, never prompt tokens: a pain point of published numbers). Every setting
gets at least `min_calls` timed calls over all rounds (and decodes every prompt at least once). The
device is synchronised before the clock is read.

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

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.base.speed import (
    interval_fields,
    speedup,
    statistic,
    tokens_per_s,
)
from diffusion_gr2.core.bench.generate_baseline import generate_tokens
from diffusion_gr2.core.bench.harness import Call, TimedSystem, round_rates, time_rounds
from diffusion_gr2.core.decode.decoder import decode, resolved_backend
from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.rank.operating_point import OperatingPointError, resolve_operating_point
from diffusion_gr2.core.rank.point_search import OperatingPointConfig, TimeCandidates
from diffusion_gr2.core.rank.rerank import (
    AR_SYSTEMS,
    RerankConfig,
    decode_config_for,
    prepare_model,
    request_grammars,
    select_requests,
)

logger = logging.getLogger(__name__)
Request = tuple[list[int], TokenConstraint | None]  # a prompt and its answer grammar (None: none given)
Rounds = list[list[Call]]  # one setting's calls, per round

__all__ = [
    "backend_of",
    "BENCHMARK_KEYS",
    "GENERATE",
    "BenchmarkConfig",
    "BenchmarkResult",
    "TimedSetting",
    "add_speedups",
    "benchmark_requests",
    "candidate_timer",
    "describe_device",
    "format_table",
    "plan_settings",
    "run_benchmark",
    "speedup_by_length",
    "summarize",
    "time_candidates",
]

GENERATE = "generate"  # row name of `transformers` `generate` on the reference system's weights
PROMPT_LOOKUP = "+pld"  # row-name suffix of a lossless prompt-lookup row (`ar_rl+pld`, `generate+pld`)
# row-name suffix of the reference verifying a diffusion system's drafts (`ar_rl+rl-draft`)
DRAFTED_BY = "+{}-draft"
GRAPHS = "+graphs"  # row-name suffix of the static decode step's rows (`BenchmarkConfig.graphs_batch_sizes`)
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
    "speedup_vs_ar_low",
    "speedup_vs_ar_high",
    "speedup_vs_best_ar",
    "speedup_vs_best_ar_low",
    "speedup_vs_best_ar_high",
    "best_ar",
    "statistic",
    "tokens_per_s_by_round",
)  # the keys of a `benchmark.json` row (docs/architecture.md#names-and-report-files): the setting, its
# figures, the speed-ups with their intervals, the statistic's name and the per-round figures it is
# the median of


@dataclass(frozen=True)
class BenchmarkConfig:
    """What to time; decoding itself (max tokens, step cap, commit rule) comes from a `RerankConfig`.

    `RerankConfig.constrained` and `.batch_size` are not used here: `constrained` and `batch_sizes`
    below say which lines are timed. Defaults are conf/base's `benchmark.timing` (tests/test_config.py
    holds them equal); the operating point's timing sets the rounds, prompts and batch sizes only.
    """

    n_prompts: int = 20  # the first requests of the split (sorted by user id)
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)  # issue 17's batch sweep (docs/architecture.md#decoding)
    # Systems timed at other batch sizes than `batch_sizes` (at their operating point): a full batch
    # sweep of every intermediate stage costs more than it tells.
    system_batch_sizes: Mapping[str, tuple[int, ...]] = field(
        default_factory=lambda: {"cft": (1, 16), "opd": (1, 16), "rl": (1, 16)}
    )
    constrained: tuple[bool, ...] = (True, False)  # a line under the answer grammar (as served), one free
    generate_constrained: bool = True  # `generate` under the grammar too (a LogitsProcessor), not only free
    taus: tuple[float, ...] = (1.0, 0.9, 0.6, 0.4)  # the sweep's thresholds (the paper's), whole block
    sweep_systems: tuple[str, ...] = ("distilled",)  # diffusion systems timed at every tau (frontier plot)
    sweep_batch_sizes: tuple[int, ...] = (1, 16)  # the sweep at fewer batch sizes: it is costly
    sweep_constrained: tuple[bool, ...] = (True,)  # the frontier plots R@1 as served, so speed as served
    # A diffusion system with no operating point (refused, or not chosen for it) is still timed at this
    # tau (whole block) at its batch sizes, as a line that is not served (`operating_point` false), so
    # the batch sweep shows what it would give; None = not timed at all.
    unserved_tau: float | None = 0.75
    min_calls: int = 20  # timed calls per setting, all rounds together (issue 13: >= 20 at batch 16)
    warmup: int = 1  # untimed calls per setting before its first timed call
    # Every setting is timed once per round, rounds one after another: a machine that slows down for
    # a while (shared cores, thermal limits) then slows every setting alike instead of whichever ran.
    rounds: int = 10  # 20 calls = 2 per round; the interval covers 97.9% (4 rounds: 87.5%)
    # The length sweep: reasoning budgets (max_new_tokens) each served line (the reference and every
    # diffusion system at its operating point, or at `unserved_tau`) is decoded under at batch 1 under
    # the grammar, which closes the explanation early to fit the ranking: output length varied on
    # purpose (the teacher's answers are otherwise all ~115 tokens). The natural budget is the batch-1
    # row itself. () = no length sweep.
    length_budgets: tuple[int, ...] = (64, 80, 96)
    reference: str = "ar_rl"  # speed-ups are relative to this (AR) system; `generate` runs its weights
    # Lossless prompt-lookup rows: `<reference>+pld` (our decoder, `DecodeConfig.draft="prompt"`) at the
    # reference's batch sizes, and `generate+pld` (`transformers`' `prompt_lookup_num_tokens`: batch 1
    # and free only, as the library allows: its candidates would advance a grammar processor's state
    # past tokens it then rejects), drafting this many tokens; None = no such rows.
    # `speedup_vs_best_ar` compares every row with the fastest of the reference's AR rows there.
    prompt_lookup_tokens: int | None = 3
    # The lossless diffusion-drafted row `<reference>+<drafter>-draft`: this diffusion system drafts
    # `drafter_tokens` tokens (None = its whole block; never more) in one forward of its own, the
    # reference verifies them in one forward (`DecodeConfig.draft="model"`): the reference's own
    # tokens. At `drafter_batch_sizes`, both flags of `constrained`; None = no such row. It counts as
    # one of the reference's AR rows.
    drafter: str | None = "distilled"
    drafter_tokens: int | None = None
    drafter_batch_sizes: tuple[int, ...] = (1,)
    # `<system>+graphs` rows: the reference and each diffusion system's served line (its operating
    # point, or `unserved_tau`) again with the static decode step (`DecodeConfig.static_cache`;
    # captured as CUDA graphs on a GPU, eager elsewhere) at these batch sizes; () = no such rows.
    graphs_batch_sizes: tuple[int, ...] = ()

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
class TimedSetting:
    """One timed configuration of a system's decoding, one `benchmark.json` row."""

    system: str  # a system, or GENERATE
    tau: float | None  # commit threshold; None = AR (block size 1)
    window: int | None  # decoding window of a diffusion system; None = the whole block (and AR)
    constrained: bool  # under each request's answer grammar (as served) or free
    batch_size: int
    operating_point: bool  # as served: AR rows, `generate`, a diffusion system at its chosen (tau, window)
    budget: int | None = None  # max_new_tokens of the length sweep; None = the decoding's own
    draft_tokens: int | None = (
        None  # AR drafts (lossless): draft tokens per forward; None = off (a drafter: its block)
    )
    drafter: str | None = None  # the diffusion system writing the drafts; None = prompt lookup
    graphs: bool = False  # the static decode step; CUDA graphs on a GPU (`graphs_batch_sizes`)

    @property
    def key(self) -> tuple[str, float | None, int | None, bool, int, int | None]:
        return self.name, self.tau, self.window, self.constrained, self.batch_size, self.budget

    @property
    def name(self) -> str:
        """The row's system name: `ar_rl`, `ar_rl+pld` for its prompt-lookup line, `ar_rl+rl-draft`
        for rl's drafts verified by ar_rl."""
        if self.drafter is not None:
            return self.system + DRAFTED_BY.format(self.drafter)
        return self.system + (PROMPT_LOOKUP if self.draft_tokens else "") + (GRAPHS if self.graphs else "")


@dataclass(frozen=True)
class BenchmarkResult:
    """`benchmark.json` rows, per-request samples at batch 1 (as served), the speed-up by output length."""

    rows: list[dict[str, Any]]
    samples: pd.DataFrame  # system, tau, window, output_tokens, nfe, latency_s (one row per request)
    length_rows: list[dict[str, Any]]
    calls: dict[tuple[str, float | None, int | None, bool, int], int]  # timed calls per `TimedSetting.key`


def describe_device(device: torch.device) -> str:
    """`cuda (NVIDIA H200)` or `cpu (16 threads)`: enough to tell two runs' machines apart."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"{device.type} ({torch.get_num_threads()} threads)"


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What the harness calls before reading the clock: wait for queued GPU work (CPU work is
    synchronous already)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def plan_settings(
    systems: Sequence[str], points: Mapping[str, Any] | None, config: BenchmarkConfig
) -> list[TimedSetting]:
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
    drafted: list[TimedSetting] = []
    if config.reference in systems and config.prompt_lookup_tokens:
        k = int(config.prompt_lookup_tokens)
        for constrained in config.constrained:
            sizes = config.batch_sizes_of(config.reference)
            drafted += [
                TimedSetting(config.reference, None, None, constrained, b, True, None, k) for b in sizes
            ]
            if not constrained:
                drafted.append(TimedSetting(GENERATE, None, None, constrained, 1, True, None, k))
    if config.reference in systems and config.drafter in systems:
        ref = config.reference
        drafted += [
            TimedSetting(ref, None, None, constrained, b, True, None, config.drafter_tokens, config.drafter)
            for constrained in config.constrained
            for b in config.drafter_batch_sizes
        ]
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
    settings: dict[tuple, TimedSetting] = {}
    for system, tau, window, point, sizes, flags in lines:
        for constrained in flags:
            for b in sizes:
                setting = TimedSetting(system, tau, window, constrained, b, point)
                settings.setdefault(setting.key, setting)  # the first (operating-point) line wins
    ar = [s for s in settings.values() if s.tau is None]
    rest = [s for s in settings.values() if s.tau is not None]
    return [*ar, *drafted, *rest, *_graphed(ar + rest, config)]


def _graphed(settings: Sequence[TimedSetting], config: BenchmarkConfig) -> list[TimedSetting]:
    """The `+graphs` twins of the reference's rows and of each diffusion system's served line."""
    served = [
        s
        for s in settings
        if s.batch_size in config.graphs_batch_sizes
        and (s.system == config.reference or (s.tau is not None and _served(s, config)))
    ]
    return [replace(s, graphs=True) for s in served]


def _served(s: TimedSetting, config: BenchmarkConfig) -> bool:
    """Whether `s` is its system's served line: its operating point, or the `unserved_tau` line."""
    unserved = config.unserved_tau is not None and s.tau == float(config.unserved_tau) and s.window is None
    return s.operating_point or unserved


def plan_length_settings(settings: Sequence[TimedSetting], config: BenchmarkConfig) -> list[TimedSetting]:
    """The length sweep: each system's served line at batch 1 under the grammar (its operating point,
    or the `unserved_tau` line of a system without one; not `generate`), once per budget."""
    lines: dict[str, TimedSetting] = {}
    for s in settings:
        if s.batch_size != 1 or not s.constrained or s.system == GENERATE or s.draft_tokens or s.drafter:
            continue
        if _served(s, config) and not s.graphs:  # a system's operating-point lines come before its sweep
            lines.setdefault(s.system, s)
    return [replace(s, budget=int(b)) for s in lines.values() for b in config.length_budgets]


def _unzip(batch: list[Request], constrained: bool) -> tuple[list[list[int]], list[TokenConstraint] | None]:
    """A batch's prompts, and their grammars when the setting decodes under them."""
    prompts = [p for p, _ in batch]
    rows = [g for _, g in batch] if constrained else None
    if rows is not None and any(g is None for g in rows):
        raise ValueError("constrained settings need one grammar per prompt (rerank.request_grammars)")
    return prompts, rows  # type: ignore[return-value]


def make_runner(
    setting: TimedSetting,
    models: Mapping[str, PreTrainedModel],
    tokenizer: PreTrainedTokenizerBase,
    decoding: RerankConfig,
    reference: str,
) -> tuple[TimedSystem[Request], torch.device]:
    """The decode call `setting` times (one full batch, (output tokens, NFE) per row) and its device."""
    # one call decodes one whole batch; the length sweep caps the output
    rerank = replace(
        decoding, batch_size=setting.batch_size, max_new_tokens=setting.budget or decoding.max_new_tokens
    )
    if setting.drafter is not None:  # at most the drafter's block
        block = int(models[setting.drafter].config.block_size)
        rerank = replace(rerank, draft="model", draft_tokens=min(setting.draft_tokens or block, block))
    elif setting.draft_tokens and setting.system != GENERATE:
        rerank = replace(rerank, draft="prompt", draft_tokens=int(setting.draft_tokens))
    if setting.graphs:
        rerank = replace(rerank, static_cache=True, cuda_graphs=True)
    if setting.system == GENERATE:
        hf_model = models[reference]
        hf_cfg = decode_config_for(hf_model, tokenizer, None, rerank)
        lookup = setting.draft_tokens

        def run_generate(batch: list[Request]) -> list[tuple[int, int | None]]:
            prompts, rows = _unzip(batch, setting.constrained)
            out = generate_tokens(hf_model, prompts, hf_cfg, rows, prompt_lookup=lookup)
            # one forward a token, except under prompt lookup, whose forwards `generate` does not count
            return [(len(t), None if lookup else len(t)) for t in out]

        device = hf_model.device
        return TimedSystem(run_generate, setting.batch_size, synchronizer(device)), device
    model = models[setting.system]
    drafter = None if setting.drafter is None else models[setting.drafter]
    cfg = replace(decode_config_for(model, tokenizer, setting.tau, rerank), window=setting.window)

    def run_decode(batch: list[Request]) -> list[tuple[int, int]]:
        prompts, rows = _unzip(batch, setting.constrained)
        return [(len(o.tokens), o.nfe) for o in decode(model, prompts, cfg, rows, drafter=drafter)]

    return TimedSystem(run_decode, setting.batch_size, synchronizer(model.device)), model.device


def backend_of(
    setting: TimedSetting, models: Mapping[str, PreTrainedModel], decoding: RerankConfig, reference: str
) -> str:
    """The model forward `setting` runs (`decoding.backend` resolved); `generate` runs the modules."""
    model = models[reference if setting.system == GENERATE else setting.system]
    return "eager" if setting.system == GENERATE else resolved_backend(model, decoding.backend)


def summarize(setting: TimedSetting, rounds: Rounds, device: str, backend: str) -> dict[str, Any]:
    """One `benchmark.json` row: the harness statistic of tokens/s, latency percentiles over requests.

    The speed-up stays None here; `add_speedups` fills it once every row of the run is known.
    """
    calls = [c for r in rounds for c in r]
    tokens = [t for c in calls for t in c.output_tokens]
    nfe = [n for c in calls for n in c.nfe]
    latency_ms = np.array([c.latency_s for c in calls]) * 1000.0  # each request waits for its call
    rates = round_rates(rounds)
    counted = None not in nfe  # `generate+pld` does not say how many forwards it ran
    return {
        "system": setting.name,
        "tau": None if setting.tau is None else float(setting.tau),
        "window": setting.window,
        "operating_point": setting.operating_point,
        "batch_size": int(setting.batch_size),
        "constrained": setting.constrained,
        "backend": backend,
        "output_tokens_per_s": tokens_per_s(rates),
        "nfe_per_sample": float(np.mean(nfe)) if counted else None,
        "tokens_per_forward": sum(tokens) / sum(nfe) if counted else None,
        "latency_p50_ms": float(np.percentile(latency_ms, 50)),
        "latency_p95_ms": float(np.percentile(latency_ms, 95)),
        "mean_output_tokens": float(np.mean(tokens)),
        "device": device,
        **interval_fields("speedup_vs_ar", None),
        **interval_fields("speedup_vs_best_ar", None),
        "best_ar": None,
        "statistic": statistic(len(rounds)),
        "tokens_per_s_by_round": rates,
    }


def add_speedups(rows: Sequence[Mapping[str, Any]], reference: str = "ar_rl") -> list[dict[str, Any]]:
    """`speedup_vs_ar` of every row with its interval: paired by round with `reference`'s row at the
    same batch size and constrained flag (`speed.speedup`; None when the reference has no such row);
    and `speedup_vs_best_ar` against the fastest AR row of the reference's weights there (`best_ar`
    names it: plain, `+pld`, `+<drafter>-draft`, `+graphs`, `generate` or `generate+pld`: every
    lossless one)."""
    ar_names = {reference, reference + PROMPT_LOOKUP, reference + GRAPHS, GENERATE, GENERATE + PROMPT_LOOKUP}
    prefix, suffix = (reference + DRAFTED_BY).split("{}")
    ar_names |= {r["system"] for r in rows if r["system"].startswith(prefix) and r["system"].endswith(suffix)}
    ref, best = {}, {}
    for r in rows:
        where = (r["batch_size"], r["constrained"])
        if r["system"] == reference:
            ref[where] = r["tokens_per_s_by_round"]
        rate = r.get("output_tokens_per_s", float("nan"))
        if r["system"] in ar_names and rate > best.get(where, {}).get("output_tokens_per_s", -1.0):
            best[where] = r
    out = []
    for row in rows:
        where = (row["batch_size"], row["constrained"])
        base, fastest = ref.get(where), best.get(where)
        ratio = None if base is None else speedup(row["tokens_per_s_by_round"], base)
        top = (
            None
            if fastest is None
            else speedup(row["tokens_per_s_by_round"], fastest["tokens_per_s_by_round"])
        )
        out.append(
            {
                **row,
                **interval_fields("speedup_vs_ar", ratio),
                **interval_fields("speedup_vs_best_ar", top),
                "best_ar": None if fastest is None else fastest["system"],
            }
        )
    return out


def _requests(prompts: Sequence[Sequence[int]], grammars: Sequence[TokenConstraint] | None) -> list[Request]:
    """What the harness cycles: each prompt with its grammar, so the two stay aligned in every batch."""
    rows: Sequence[TokenConstraint | None] = grammars if grammars is not None else [None] * len(prompts)
    return [(list(p), g) for p, g in zip(prompts, rows, strict=True)]


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
    reference_model: PreTrainedModel | None = None,
) -> dict[tuple[float, int | None] | None, dict[int, list[float]]]:
    """Per-round output tokens/s of each (tau, window) of `system` at every `config.batch_sizes`.

    The operating point's speed side: the benchmark's harness, all candidates and, with
    `reference_model`, `config.reference` (AR) interleaved in the same rounds (key None), under
    `grammars` when given (as served). `operating_point.ranked_speed` turns a candidate's rounds into its figures.
    """
    constrained = grammars is not None
    settings = {
        (float(tau), window, b): TimedSetting(system, float(tau), window, constrained, b, False)
        for tau, window in candidates
        for b in config.batch_sizes
    }
    models = {system: model}
    if reference_model is not None:
        models[config.reference] = reference_model
        for b in config.batch_sizes:
            settings[(None, None, b)] = TimedSetting(config.reference, None, None, constrained, b, True)
    systems = {
        k: make_runner(s, models, tokenizer, decoding, config.reference)[0] for k, s in settings.items()
    }
    timed = time_rounds(
        systems, _requests(prompts, grammars), config.rounds, config.warmup, config.min_calls, clock, "timing"
    )
    out: dict[tuple[float, int | None] | None, dict[int, list[float]]] = {}
    for (tau, window, b), rounds in timed.items():
        key = None if tau is None else (tau, window)
        out.setdefault(key, {})[b] = round_rates(rounds)
    return out


def candidate_timer(
    point: OperatingPointConfig, clock: Callable[[], float] = time.perf_counter
) -> TimeCandidates:
    """The operating point's timer (`point_search.TimeCandidates`, which the pipeline nodes hand to
    the search): `time_candidates` under `point.timing`'s settings, `point.reference` timed beside
    the candidates."""
    config = BenchmarkConfig(**asdict(point.timing), reference=point.reference)
    return functools.partial(time_candidates, config=config, clock=clock)


def _samples(setting: TimedSetting, rounds: Rounds) -> list[dict[str, Any]]:
    """Per-request records of batch-1 calls (one request per call, so its latency is the call's)."""
    tau = float("nan") if setting.tau is None else float(setting.tau)
    window = float("nan") if setting.window is None else float(setting.window)
    return [
        {"system": setting.name, "tau": tau, "window": window}
        | {"output_tokens": c.output_tokens[0], "nfe": c.nfe[0], "latency_s": c.latency_s}
        for r in rounds
        for c in r
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
    rounds = time_rounds(
        {s: system for s, (system, _) in runners.items()},
        _requests(prompts, grammars),
        config.rounds,
        config.warmup,
        config.min_calls,
        clock,
        "benchmark",
    )
    rows = add_speedups(
        [
            summarize(
                s,
                rounds[s],
                describe_device(runners[s][1]),
                backend_of(s, models, decoding, config.reference),
            )
            for s in settings
        ],
        config.reference,
    )
    served = True in config.constrained  # the length buckets are measured as served
    samples = [
        x for s in settings if s.batch_size == 1 and s.constrained == served for x in _samples(s, rounds[s])
    ]
    frame = pd.DataFrame(samples, columns=["system", "tau", "window", "output_tokens", "nfe", "latency_s"])
    swept = {replace(s, budget=None) for s in lengths}
    natural = [s for s in settings if s in swept]
    length_rows = speedup_by_length(
        [(s, rounds[s]) for s in [*natural, *lengths]], decoding.max_new_tokens, config.reference
    )
    logger.info("decode benchmark (output tokens only)\n%s", format_table(rows))
    calls = {s.key: sum(len(r) for r in rounds[s]) for s in timed}
    return BenchmarkResult(rows, frame, length_rows, calls)


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
    grammars = request_grammars(tokenizer, chosen, decoding.cite_prompt_sids)
    placed = {name: prepare_model(model, decoding.device) for name, model in models.items()}
    return run_benchmark(
        placed, prompts, tokenizer, decoding, config, grammars=grammars, operating_points=operating_points
    )


def speedup_by_length(
    timed: Sequence[tuple[TimedSetting, Rounds]], natural_budget: int, reference: str = "ar_rl"
) -> list[dict[str, Any]]:
    """`speedup_by_length.json` rows: per line and reasoning budget, output length and speed-up.

    speed-up = the line's tokens/s over `reference`'s under the same budget, paired by round with its
    interval (`speedup_low`, `speedup_high`; None when the reference was not timed there). A budget
    of None is the decoding's own (`natural_budget`).
    """
    rows = []
    for setting, rounds in timed:
        calls = [c for r in rounds for c in r]
        tokens = sum(sum(c.output_tokens) for c in calls)
        n = sum(len(c.output_tokens) for c in calls)
        rows.append(
            {
                "system": setting.system,
                "tau": setting.tau,
                "window": setting.window,
                "operating_point": setting.operating_point,
                "budget": setting.budget or natural_budget,
                "n": n,
                "mean_output_tokens": tokens / max(n, 1),
                "tokens_per_forward": tokens / max(sum(sum(c.nfe) for c in calls), 1),
                "output_tokens_per_s": tokens_per_s(round_rates(rounds)),
                "statistic": statistic(len(rounds)),
                "tokens_per_s_by_round": round_rates(rounds),
            }
        )
    ref = {r["budget"]: r["tokens_per_s_by_round"] for r in rows if r["system"] == reference}
    for r in rows:
        ratio = speedup(r["tokens_per_s_by_round"], ref[r["budget"]]) if r["budget"] in ref else None
        r.update(interval_fields("speedup", ratio))
    return sorted(rows, key=lambda r: (r["system"] != reference, r["system"], r["budget"]))


def _setting_label(row: Mapping[str, Any]) -> str:
    """`rl τ=0.9 w4` / `ar_rl`: a row's system and decoding setting."""
    label = str(row["system"]) if row["tau"] is None else f"{row['system']} τ={row['tau']:g}"
    return label if row.get("window") is None else f"{label} w{row['window']}"


def _ratio_text(value: float | None, low: float | None, high: float | None) -> str:
    """`1.52 [1.31, 1.60]`, or `-` when not timed against the reference."""
    return "-" if value is None else f"{value:.2f} [{low:.2f}, {high:.2f}]"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A fixed-width text table of `benchmark.json` rows, for the log (* = operating point), headed by
    the statistic its tokens/s and speed-ups are."""
    head = f"{'setting':18s} {'grammar':>7s} {'batch':>5s} {'tok/s':>9s} {'NFE/sample':>10s} {'tok/fwd':>7s} "
    head += f"{'p50 ms':>9s} {'p95 ms':>9s} {'out tok':>7s} {'vs AR [interval]':>18s}  device"
    names = sorted({str(r["statistic"]) for r in rows})
    lines = [f"tokens/s and speed-ups: {'; '.join(names)}", head]
    for r in rows:
        label = ("* " if r["operating_point"] else "  ") + _setting_label(r)
        ratio = _ratio_text(r["speedup_vs_ar"], r["speedup_vs_ar_low"], r["speedup_vs_ar_high"])
        nfe, per_forward = r["nfe_per_sample"], r["tokens_per_forward"]
        lines.append(
            f"{label:18s} {'on' if r['constrained'] else 'off':>7s} {r['batch_size']:5d} "
            f"{r['output_tokens_per_s']:9.1f} {'-' if nfe is None else f'{nfe:.1f}':>10s} "
            f"{'-' if per_forward is None else f'{per_forward:.2f}':>7s} "
            f"{r['latency_p50_ms']:9.1f} {r['latency_p95_ms']:9.1f} {r['mean_output_tokens']:7.1f} "
            f"{ratio:>18s}  {r['device']}"
        )
    return "\n".join(lines)
