"""inference nodes: every system re-ranks the validation and test requests (DESIGN §8, §10).

Diffusion systems decode validation once per candidate (tau, window) and take the fastest whose
paired R@1 interval against `ar_rl` on the same requests has its lower bound within the budget
(`operating_point.paired_recall`) as their operating point; the choosing systems and `ar_rl` decode
every validation request, the others (which choose nothing) the first `sweep_max_requests`. "Fastest"
is timed apart from those passes (`operating_point.timing`): every candidate on the same first
validation prompts, at each timing batch size, in interleaved rounds, ranked by the geometric mean of
its output tokens/s over the batch sizes (one cold pass per setting at batch 16 picked a different
window on reruns of the same models). Test is
decoded at every tau of the sweep and at that operating point, never used to choose. On test, the
pre-rank, the reference AR system (`ar_rl`) and each served operating point answer every request;
`ar_sft` and the rest of the tau sweep answer the first `sweep_max_requests` (decoding is the run's
cost; docs/evaluation.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.bench.benchmark import BenchmarkConfig, ranked_speed, time_candidates
from diffusion_gr2.core.evaluate.metrics import user_values
from diffusion_gr2.core.evaluate.rankings import rankings_summary
from diffusion_gr2.core.rank.operating_point import (
    OperatingPointError,
    choose_operating_point,
    meets_accuracy_gates,
    paired_key,
    paired_recall,
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
    select_requests,
    setting_rows,
)
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history

logger = logging.getLogger(__name__)
TauWindow = tuple[float | None, int | None]  # a decoding setting: (tau, window); AR: (None, None)


def _split_requests(requests: pd.DataFrame, params: dict[str, Any], split: str) -> pd.DataFrame:
    return select_requests(requests, split, params["max_requests"])


def _valid_cap(system: str, params: dict[str, Any], chooses: bool) -> int | None:
    """Validation requests `system` decodes: all for a system that chooses its operating point there
    and for the reference (`ar_rl`), the pair whose interval decides; the first `sweep_max_requests`
    (in `select_requests` order, so they pair with the full passes) for the rest, which choose nothing.
    """
    if chooses or system == params["operating_point"]["reference"]:
        return None
    return params["sweep_max_requests"]


def _test_passes(
    system: str, params: dict[str, Any], operating_point: dict[str, Any] | None
) -> list[tuple[list[TauWindow], int | None]]:
    """(settings, request cap) of each test pass of `system`, in report order.

    The tau sweep is capped at `sweep_max_requests` (the first requests in `select_requests` order, so
    every capped pass is paired with the full ones on the same requests), and so is an AR system
    other than the operating point's reference (`ar_sft`); the reference (`ar_rl`) and each served
    operating point answer every request: they are the pair the headline compares.
    """
    if system in AR_SYSTEMS:
        reference = params["operating_point"]["reference"]
        return [([(None, None)], None if system == reference else params["sweep_max_requests"])]
    served = (
        []
        if operating_point is None or operating_point["tau"] is None
        else [(operating_point["tau"], operating_point["window"])]
    )
    sweep = [s for s in _sweep(params, system) if s not in served]
    passes = [(sweep, params["sweep_max_requests"]), (served, None)]
    return [(settings, cap) for settings, cap in passes if settings]


def rerank_prerank(requests: pd.DataFrame, params: dict[str, Any]) -> pd.DataFrame:
    """The retriever's order served as is, on every split: the floor every model must beat."""
    frames = [prerank_rows(_split_requests(requests, params, s), s) for s in params["splits"]]
    return pd.concat(frames, ignore_index=True)


def _sweep(params: dict[str, Any], system: str) -> list[TauWindow]:
    """The tau sweep (whole-block canvas) of `system`: `taus`, unless `taus_by_system` narrows it."""
    taus = params["taus_by_system"].get(system, params["taus"])
    return [(float(t), None) for t in taus]


def operating_point_settings(params: dict[str, Any]) -> list[TauWindow]:
    """The (tau, window) candidates of the operating point (`inference.operating_point`)."""
    section = params["operating_point"]
    return [(float(t), None if w is None else int(w)) for t in section["taus"] for w in section["windows"]]


def _recall(rows: pd.DataFrame) -> float:
    return float(user_values(rows)["recall@1"].mean())


def make_rerank_node(system: str) -> Callable[..., pd.DataFrame | dict[str, Any]]:
    """The node function of one model system (named `rerank_<system>` for the DAG and the logs).

    An AR system's node returns its rankings frame; a diffusion system's a dict of its rankings and
    its operating point (None when it is not chosen for that system), with `reference` the
    rankings of `operating_point.reference` (`ar_rl`) and `reference_model` its model (timed beside
    the candidates).
    """

    def rerank_model(
        model: PreTrainedModel,
        requests: pd.DataFrame,
        tokenizer: PreTrainedTokenizerFast,
        params: dict[str, Any],
        reference: pd.DataFrame | None = None,
        reference_model: PreTrainedModel | None = None,
    ) -> pd.DataFrame | dict[str, Any]:
        config = RerankConfig(**params["decoding"])
        model = prepare_model(model, config.device)
        chooses = system in params["operating_point"]["systems"] and system not in AR_SYSTEMS
        frames, operating_point = [], None
        if "valid" in params["splits"]:
            valid = _split_requests(requests, params, "valid")
            cap = _valid_cap(system, params, chooses)
            valid = valid if cap is None else valid.head(int(cap))
            settings = operating_point_settings(params) if chooses else _sweep(params, system)
            screen = params["operating_point"]["floor_screen"] if chooses else None
            floor = params["operating_point"]["min_unforced_rate"]
            if screen and floor is not None:
                rows, speeds = rerank_screened(
                    model, valid, tokenizer, system, settings, config, floor, screen["requests"], screen["z"]
                )
            else:
                rows, speeds = rerank_system(model, valid, tokenizer, system, settings, config, "valid")
            frames.append(rows)
            if chooses:
                timing = params["operating_point"]["timing"]
                timed = (
                    None
                    if not timing
                    else lambda candidates: _timed_speeds(
                        candidates, model, system, valid, tokenizer, config, timing, reference_model
                    )
                )
                operating_point = _operating_point(
                    system, speeds, rows, reference, params["operating_point"], timed
                )
        if "test" in params["splits"]:
            test = _split_requests(requests, params, "test")
            for settings, cap in _test_passes(system, params, operating_point):
                rows = test if cap is None else test.head(int(cap))
                frames.append(rerank_system(model, rows, tokenizer, system, settings, config, "test")[0])
        rankings = pd.concat(frames, ignore_index=True)
        return (
            rankings if system in AR_SYSTEMS else {"rankings": rankings, "operating_point": operating_point}
        )

    rerank_model.__name__ = rerank_model.__qualname__ = f"rerank_{system}"
    rerank_model.__doc__ = f"Re-rank the validation and test requests with `{system}`."
    return rerank_model


def _timed_speeds(
    speeds: list[dict[str, Any]],
    model: PreTrainedModel,
    system: str,
    valid: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    config: RerankConfig,
    timing: dict[str, Any],
    reference_model: PreTrainedModel | None = None,
) -> list[dict[str, Any]]:
    """The candidates with their speed timed side by side (`time_candidates`, the one harness) on
    validation prompts, and the reference (`ar_rl`, `reference_model`) in the same rounds.

    `tokens_per_s` becomes `ranked_speed`'s (per round the geometric mean over the timing batch
    sizes, median over rounds, named in `statistic`), with `speedup_vs_ar_rl` and its interval
    (`_low`, `_high`: paired by round) when the reference was timed; the pass's own figure stays as
    `pass_tokens_per_s`, the per-batch figures as `tokens_per_s_by_batch`.
    """
    bench = BenchmarkConfig.from_params(timing)
    head = valid.head(bench.n_prompts)
    if head.empty:  # nothing to time on: the passes' own figures (nan for an empty split) stand
        logger.warning("%s: no validation prompts to time the operating point's candidates on", system)
        return speeds
    if reference_model is None:
        logger.warning("%s: %s not timed beside the candidates: no speed-ups", system, bench.reference)
    else:
        reference_model = prepare_model(reference_model, config.device)
    prompts = [list(p) for p in head["prompt_ids"]]
    grammars = request_grammars(tokenizer, head, config.cite_prompt_sids) if config.constrained else None
    settings = [(float(s["tau"]), s["window"]) for s in speeds]
    timed = time_candidates(
        model, system, settings, prompts, tokenizer, config, bench, grammars, reference_model=reference_model
    )
    ref = timed.get(None)
    return [
        s
        | {"pass_tokens_per_s": s["tokens_per_s"], "timed_prompts": len(prompts)}
        | ranked_speed(timed[key], ref, bench.reference)
        for s, key in zip(speeds, settings, strict=True)
    ]


def _operating_point(
    system: str,
    speeds: list[dict[str, Any]],
    rows: pd.DataFrame,
    reference: pd.DataFrame | None,
    params: dict[str, Any],
    timed: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """Choose `system`'s (tau, window) on validation from each candidate's paired R@1 interval
    against the reference (`rows`: the candidates' validation rows), or say why not.

    `timed` (`_timed_speeds`) times the candidates that meet the R@1 budget and the own-valid floor
    (`meets_accuracy_gates`), the only ones that can be served; the others keep their passes' figures.
    """
    budget, name = float(params["budget"]), params["reference"]
    ref_rows = None if reference is None else reference[reference["split"] == "valid"]
    if ref_rows is None or ref_rows.empty:
        reason = f"no validation rankings of the reference {name!r} to compare with"
        logger.warning("%s: %s", system, reason)
        return refused_operating_point(speeds, float("nan"), budget, reason, name)
    n_boot, key = int(params["n_boot"]), paired_key(name)
    speeds = [
        s | paired_recall(setting_rows(rows, s["tau"], s["window"]), ref_rows, name, n_boot) for s in speeds
    ]
    for s in speeds:
        logger.info(
            "%s tau %s, window %s (validation, n %d): R@1 - %s %+.3f [%+.3f, %+.3f], own valid %.2f",
            system, s["tau"], s["window"], s[f"{key}.n"], name, s[key], s[f"{key}.low"], s[f"{key}.high"],
            s.get("unforced_rate", float("nan")),
        )  # fmt: skip
    if timed is not None:
        speeds = _time_admitted(system, speeds, timed, budget, name, params["min_unforced_rate"])
    ref_recall = _recall(ref_rows)
    try:
        operating_point = choose_operating_point(
            speeds,
            ref_recall,
            budget,
            name,
            params["min_unforced_rate"],
            params["min_speed_ratio"],
            int(params["speed_batch_size"]),
        )
    except OperatingPointError as err:
        logger.warning("%s has no operating point: %s", system, err)
        return refused_operating_point(speeds, ref_recall, budget, str(err), name)
    logger.info(
        "%s operating point (validation): tau %s, window %s -- R@1 %.3f vs %s %.3f, %.0f tokens/s",
        system,
        operating_point["tau"],
        operating_point["window"],
        operating_point["chosen"]["recall@1"],
        name,
        ref_recall,
        operating_point["chosen"]["tokens_per_s"],
    )
    return operating_point


def _time_admitted(
    system: str,
    speeds: list[dict[str, Any]],
    timed: Callable[[list[dict[str, Any]]], list[dict[str, Any]]],
    budget: float,
    reference: str,
    min_unforced_rate: float | None,
) -> list[dict[str, Any]]:
    """`speeds` with the candidates that meet the accuracy gates timed (in one `timed` call: the same
    interleaved rounds), the rest as they were."""
    passed = [meets_accuracy_gates(s, budget, reference, min_unforced_rate) for s in speeds]
    if not all(passed):
        logger.info(
            "%s: not timed (R@1 budget or own-valid floor missed, so never served): %s",
            system,
            ", ".join(
                f"tau {s['tau']}, window {s['window']}"
                for s, ok in zip(speeds, passed, strict=True)
                if not ok
            ),
        )
    if not any(passed):
        return speeds
    timed_ones = iter(timed([s for s, ok in zip(speeds, passed, strict=True) if ok]))
    return [next(timed_ones) if ok else s for s, ok in zip(speeds, passed, strict=True)]


def combine_rankings(*results: pd.DataFrame | dict[str, Any]) -> dict[str, Any]:
    """All systems' rows in one frame, the operating points, and per-variant decoding figures for MLflow."""
    frames, operating_points = [], {}
    for result in results:
        if isinstance(result, dict):
            frame = result["rankings"]
            if result["operating_point"] is not None:
                operating_points[str(frame["system"].iloc[0])] = result["operating_point"]
        else:
            frame = result
        frames.append(frame)
    # AR systems have no tau (all NaN): one float dtype everywhere keeps the concatenation well defined.
    rankings = pd.concat(
        [f.astype({"tau": "float64", "window": "float64"}) for f in frames], ignore_index=True
    )
    return {
        "rankings": rankings,
        "operating_point": operating_points,
        "inference_metrics": as_metrics_history(rankings_summary(rankings)),
    }
