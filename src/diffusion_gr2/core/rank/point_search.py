"""The search for a diffusion system's operating point on validation, in one call
(docs/evaluation.md#how-the-operating-point-is-chosen).

`search_operating_point` does everything choosing a served (tau, window) takes, top to bottom, under
the serving policy (`OperatingPointConfig.policy`, the one the registration gate reads):

1. decode every candidate (`OperatingPointConfig.candidates`) on the validation requests, each
   screened against the own-valid floor first when `floor_screen` is set (`rerank_screened`);
2. pair each candidate with the reference's rows and with the pre-rank's on the same requests
   (`paired_recall`, at the policy's level);
3. keep those that clear the accuracy bars, the R@1 margins against both and the own-valid floor
   (`meets_accuracy_gates`): no other can be served, so no other is timed;
4. time them beside the reference with the timer the caller hands over (`TimeCandidates`; the
   pipeline nodes pass the benchmark's harness, `core/bench/benchmark.py::candidate_timer`:
   interleaved rounds, the same prompts, under the grammar as served; `ranked_speed`);
5. choose the fastest that also clears the speed floor (`choose_operating_point`), or refuse.

Speed that feeds a decision comes from the harness alone: a candidate that meets the gates is
always timed there, beside the reference, or the system is refused. A validation pass's own
wall-clock figure stays in the record (`pass_tokens_per_s` beside a timed figure; `tokens_per_s` of
a candidate refused before timing, which nothing ranks) as what the pass cost, never as a speed
that chooses. The rules themselves are the pure functions of `operating_point.py`.

A caller that holds the reference's model but not its validation rows (a retrain, which runs no
inference stage) calls `search_beside_reference`, which decodes them first.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from diffusion_gr2.core.decode.grammar import TokenConstraint
from diffusion_gr2.core.evaluate.metrics import user_values
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.rank.operating_point import (
    PRERANK,
    OperatingPointError,
    choose_operating_point,
    meets_accuracy_gates,
    paired_key,
    paired_recall,
    ranked_speed,
    refused_operating_point,
)
from diffusion_gr2.core.rank.rerank import (
    AR_SYSTEMS,
    RerankConfig,
    prepare_model,
    prerank_rows,
    request_grammars,
    rerank_screened,
    rerank_system,
    setting_rows,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CandidateTiming",
    "FloorScreen",
    "OperatingPointConfig",
    "OperatingPointSearch",
    "Reference",
    "TauWindow",
    "TimeCandidates",
    "search_beside_reference",
    "search_operating_point",
]

TauWindow = tuple[float | None, int | None]  # a decoding setting: (tau, window); AR: (None, None)


class TimeCandidates(Protocol):
    """What times the admitted candidates beside the reference, handed over by the caller (the
    pipeline nodes: the benchmark's harness, `core/bench/benchmark.py::candidate_timer`): per
    candidate (tau, window), and for the reference (key None), the per-round output tokens/s at
    each timing batch size, all in the same interleaved rounds."""

    def __call__(
        self,
        model: PreTrainedModel,
        system: str,
        candidates: Sequence[tuple[float, int | None]],
        prompts: Sequence[Sequence[int]],
        tokenizer: PreTrainedTokenizerBase,
        decoding: RerankConfig,
        *,
        grammars: Sequence[TokenConstraint] | None,
        reference_model: PreTrainedModel,
    ) -> Mapping[tuple[float, int | None] | None, Mapping[int, Sequence[float]]]: ...


@dataclass(frozen=True)
class CandidateTiming:
    """`operating_point.timing`: the harness settings the candidates are timed under; the rest of
    the benchmark's settings belong to the benchmark stage, and the reference is the operating
    point's own."""

    n_prompts: int  # the first validation requests, timed
    batch_sizes: tuple[int, ...]
    rounds: int
    min_calls: int
    warmup: int


TIMING_KEYS = frozenset(f.name for f in fields(CandidateTiming))


def _exact_keys(section: Mapping[str, Any], expected: set[str] | frozenset[str], where: str) -> None:
    """Refuse a section that misses a key or names one nothing reads (a typo would pass silently)."""
    unknown, missing = sorted(set(section) - expected), sorted(expected - set(section))
    if unknown or missing:
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing}")


@dataclass(frozen=True)
class FloorScreen:
    """`floor_screen`: a candidate stops after its first `requests` when the Wilson upper bound of
    its own valid rate there, at `z`, is under the floor (`operating_point.floor_screen`)."""

    requests: int
    z: float


@dataclass(frozen=True)
class OperatingPointConfig:
    """`inference.operating_point`, typed once, with the serving policy its bars come from. No
    defaults: conf/base holds every value, with why."""

    systems: tuple[str, ...]  # the diffusion systems that choose one on validation
    reference: str  # the AR system every candidate is paired with and timed beside (ar_rl)
    n_boot: int  # bootstrap resamples of each candidate's paired intervals
    floor_screen: FloorScreen | None  # None = every candidate decodes every validation request
    speed_batch_size: int  # the policy's speed floor is read at this batch size
    taus: tuple[float, ...]
    windows: tuple[int | None, ...]  # None = the whole block
    timing: CandidateTiming  # the harness's rounds, prompts and batch sizes; its reference is ours
    policy: Policy  # the bars (`params:policy`): margins, floors and level, the gate's too

    @classmethod
    def from_params(cls, section: Mapping[str, Any], policy: Policy) -> OperatingPointConfig:
        """From `params["inference"]["operating_point"]` and the run's `policy` (built once from
        `params["policy"]`, `Policy.from_params`): every key required, an unknown one refused (a
        bar written here would be a second copy of the policy's)."""
        where = "inference.operating_point"
        _exact_keys(section, {f.name for f in fields(cls)} - {"policy"}, where)
        timing, screen = section["timing"], section["floor_screen"]
        if timing is None:  # the passes' wall-clock figures would rank the candidates
            raise ValueError(f"{where}.timing: candidates are ranked by the harness's timing alone, not null")
        _exact_keys(timing, TIMING_KEYS, f"{where}.timing")
        if int(timing["n_prompts"]) < 1:
            raise ValueError(f"{where}.timing.n_prompts: at least one prompt to time the candidates on")
        if screen is not None:
            _exact_keys(screen, {f.name for f in fields(FloorScreen)}, f"{where}.floor_screen")
        return cls(
            systems=tuple(section["systems"]),
            reference=str(section["reference"]),
            n_boot=int(section["n_boot"]),
            floor_screen=None if screen is None else FloorScreen(int(screen["requests"]), float(screen["z"])),
            speed_batch_size=int(section["speed_batch_size"]),
            taus=tuple(float(t) for t in section["taus"]),
            windows=tuple(None if w is None else int(w) for w in section["windows"]),
            timing=CandidateTiming(**{k: tuple(v) if isinstance(v, list) else v for k, v in timing.items()}),
            policy=policy,
        )

    def chooses(self, system: str) -> bool:
        """Whether `system` chooses an operating point (a diffusion system named in `systems`)."""
        return system in self.systems and system not in AR_SYSTEMS

    @property
    def candidates(self) -> list[TauWindow]:
        """The (tau, window) settings tried: every tau with every window, taus outermost."""
        return [(t, w) for t in self.taus for w in self.windows]


@dataclass(frozen=True)
class Reference:
    """What the candidates are measured against (`OperatingPointConfig.reference`, ar_rl)."""

    rows: pd.DataFrame | None  # its rankings; the validation rows pair with the candidates'
    model: PreTrainedModel | None  # timed beside the candidates, in the same rounds


@dataclass(frozen=True)
class OperatingPointSearch:
    """What the search hands back: the rows it decoded and the record it chose or refused by."""

    rows: pd.DataFrame  # every candidate's validation rows (`RANKING_COLUMNS`)
    point: dict[str, Any]  # `operating_point.json`'s entry: the choice, or the refusal and why


def search_operating_point(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    system: str,
    requests: pd.DataFrame,
    reference: Reference,
    decoding: RerankConfig,
    config: OperatingPointConfig,
    time: TimeCandidates,
) -> OperatingPointSearch:
    """Decode, gate, time and choose `system`'s operating point on the validation `requests`.

    `model` is ready to decode (`prepare_model`); `requests` are the validation requests in
    `select_requests` order, the first of which `time` times. The steps are the module docstring's.
    """
    rows, candidates = _decode_candidates(model, tokenizer, system, requests, decoding, config)
    policy, name = config.policy, config.reference
    ref_rows = None if reference.rows is None else reference.rows[reference.rows["split"] == "valid"]
    if ref_rows is None or ref_rows.empty:
        reason = f"no validation rankings of the reference {name!r} to compare with"
        logger.warning("%s: %s", system, reason)
        return OperatingPointSearch(rows, refused_operating_point(candidates, math.nan, policy, reason, name))
    candidates = _paired(rows, candidates, ref_rows, prerank_rows(requests, "valid"), config)
    _log_paired(system, candidates, name)
    ref_recall = float(user_values(ref_rows)["recall@1"].mean())
    admitted = [meets_accuracy_gates(c, policy, name) for c in candidates]
    _log_untimed(system, candidates, admitted)
    if any(admitted):
        if reference.model is None:  # only an unpaired speed could rank them: refuse instead
            reason = f"{name}'s model was not given, so the candidates cannot be timed beside it"
            logger.warning("%s has no operating point: %s", system, reason)
            point = refused_operating_point(candidates, ref_recall, policy, reason, name)
            return OperatingPointSearch(rows, point)
        passed = [c for c, ok in zip(candidates, admitted, strict=True) if ok]
        timed = iter(
            _timed(model, tokenizer, system, requests, reference.model, decoding, config, time, passed)
        )
        candidates = [next(timed) if ok else c for c, ok in zip(candidates, admitted, strict=True)]
    return OperatingPointSearch(rows, _choose(system, candidates, ref_recall, config))


def _paired(
    rows: pd.DataFrame,
    candidates: list[dict[str, Any]],
    reference_rows: pd.DataFrame,
    prerank: pd.DataFrame,
    config: OperatingPointConfig,
) -> list[dict[str, Any]]:
    """Each candidate with its paired R@1 fields against the reference and against the pre-rank (the
    retriever's order on the same validation requests), at the policy's level."""
    level, n_boot = config.policy.level, config.n_boot
    out = []
    for c in candidates:
        mine = setting_rows(rows, c["tau"], c["window"])
        paired = paired_recall(mine, reference_rows, config.reference, n_boot, level=level)
        out.append(c | paired | paired_recall(mine, prerank, PRERANK, n_boot, level=level))
    return out


def search_beside_reference(
    model: PreTrainedModel,
    reference_model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    system: str,
    requests: pd.DataFrame,
    decoding: RerankConfig,
    config: OperatingPointConfig,
    time: TimeCandidates,
) -> OperatingPointSearch:
    """`search_operating_point` for a caller with the reference's model but not its rows (a retrain,
    which runs no inference stage): the reference decodes every validation request first, as
    inference's `rerank_<reference>` node does, then the search pairs and times the candidates beside it.

    `model` and `reference_model` as loaded (both are made ready to decode here); `requests` are the
    validation requests in `select_requests` order.
    """
    model = prepare_model(model, decoding.device)
    reference_model = prepare_model(reference_model, decoding.device)
    # an AR system decodes once, whatever the settings (`rerank_system`)
    rows = rerank_system(reference_model, requests, tokenizer, config.reference, [], decoding, "valid")[0]
    return search_operating_point(
        model, tokenizer, system, requests, Reference(rows, reference_model), decoding, config, time
    )


def _decode_candidates(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    system: str,
    requests: pd.DataFrame,
    decoding: RerankConfig,
    config: OperatingPointConfig,
) -> tuple[pd.DataFrame, list[dict[str, Any]]]:
    """Every candidate's validation rows and pass figures (`pass_figures`), screened against the
    policy's own-valid floor first when `floor_screen` is set."""
    screen, floor = config.floor_screen, config.policy.min_unforced_rate
    if screen is not None:
        return rerank_screened(
            model, requests, tokenizer, system, config.candidates, decoding, floor, screen.requests, screen.z
        )
    return rerank_system(model, requests, tokenizer, system, config.candidates, decoding, "valid")


def _timed(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    system: str,
    requests: pd.DataFrame,
    reference_model: PreTrainedModel,
    decoding: RerankConfig,
    config: OperatingPointConfig,
    time: TimeCandidates,
    candidates: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """`candidates` (those the accuracy gates admitted) with their speed timed beside the reference,
    in one call of `time` (the same interleaved rounds) on the first `timing.n_prompts` requests.

    `tokens_per_s` becomes `ranked_speed`'s (per round the geometric mean over the timing batch
    sizes, median over rounds, named in `statistic`), with the paired `speedup_vs_<reference>` and
    its interval; the pass's own figure stays as `pass_tokens_per_s`.
    """
    head = requests.head(config.timing.n_prompts)
    prompts = [list(p) for p in head["prompt_ids"]]
    grammars = request_grammars(tokenizer, head, decoding.cite_prompt_sids) if decoding.constrained else None
    settings = [(float(c["tau"]), c["window"]) for c in candidates]
    reference_model = prepare_model(reference_model, decoding.device)
    timed = time(
        model,
        system,
        settings,
        prompts,
        tokenizer,
        decoding,
        grammars=grammars,
        reference_model=reference_model,
    )
    return [
        c
        | {"pass_tokens_per_s": c["tokens_per_s"], "timed_prompts": len(prompts)}
        | ranked_speed(timed[key], timed[None], config.reference)
        for c, key in zip(candidates, settings, strict=True)
    ]


def _choose(
    system: str, candidates: list[dict[str, Any]], ref_recall: float, config: OperatingPointConfig
) -> dict[str, Any]:
    """`choose_operating_point` under `config`'s policy, or the refusal record saying why."""
    try:
        point = choose_operating_point(
            candidates, ref_recall, config.policy, config.reference, config.speed_batch_size
        )
    except OperatingPointError as err:
        logger.warning("%s has no operating point: %s", system, err)
        return refused_operating_point(candidates, ref_recall, config.policy, str(err), config.reference)
    logger.info(
        "%s operating point (validation): tau %s, window %s -- R@1 %.3f vs %s %.3f, %.0f tokens/s",
        system, point["tau"], point["window"], point["chosen"]["recall@1"], config.reference, ref_recall,
        point["chosen"]["tokens_per_s"],
    )  # fmt: skip
    return point


def _log_paired(system: str, candidates: list[dict[str, Any]], reference: str) -> None:
    key, pre = paired_key(reference), paired_key(PRERANK)
    for c in candidates:
        logger.info(
            "%s tau %s, window %s (validation, n %d): R@1 - %s %+.3f [%+.3f, %+.3f], - %s %+.3f "
            "[%+.3f, %+.3f], own valid %.2f",
            system, c["tau"], c["window"], c[f"{key}.n"], reference, c[key], c[f"{key}.low"],
            c[f"{key}.high"], PRERANK, c[pre], c[f"{pre}.low"], c[f"{pre}.high"],
            c.get("unforced_rate", float("nan")),
        )  # fmt: skip


def _log_untimed(system: str, candidates: list[dict[str, Any]], admitted: list[bool]) -> None:
    refused = [
        f"tau {c['tau']}, window {c['window']}" for c, ok in zip(candidates, admitted, strict=True) if not ok
    ]
    if refused:
        logger.info(
            "%s: not timed (an R@1 margin or the own-valid floor missed, so never served): %s",
            system,
            ", ".join(refused),
        )
