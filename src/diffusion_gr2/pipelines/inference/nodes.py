"""inference nodes: every system re-ranks the validation and test requests (docs/evaluation.md).

A diffusion system named in `operating_point.systems` chooses its operating point on validation in
one core call (`core/rank/point_search.py::search_operating_point`: decode the candidates, pair
them with `ar_rl` and the pre-rank, hold them to the serving policy (`params:policy`, the gate's
too), time the admitted in the harness, choose) and gets back its validation rows
and the record `operating_point.json` holds; the choosing systems and `ar_rl` decode every
validation request, the systems of `valid_sweep` (which choose nothing: `rl`, the comparison before
distillation) the first `sweep_max_requests`, and the others none (their rows would choose nothing
and report what their test rows report). Test is
decoded at every tau of the sweep and at that operating point, never used to choose. On test, the
pre-rank, the learned analyst (its noiseless order, the teacher's ceiling; both splits, no model), the
reference AR system (`ar_rl`) and each served operating point answer every request;
`ar_sft` and the rest of the tau sweep answer the first `sweep_max_requests` (decoding is the run's
cost; docs/evaluation.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from diffusion_gr2.core.bench.benchmark import candidate_timer
from diffusion_gr2.core.decode.shards import Shards, launch_shards, shared_decoding, solo
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.evaluate.rankings import rankings_summary
from diffusion_gr2.core.rank.point_search import (
    OperatingPointConfig,
    Reference,
    TauWindow,
    TimeCandidates,
    search_operating_point,
)
from diffusion_gr2.core.rank.rerank import (
    AR_SYSTEMS,
    RANKING_COLUMNS,
    RerankConfig,
    analyst_rows,
    prepare_model,
    prerank_rows,
    rerank_system,
    select_requests,
)
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history
from diffusion_gr2.core.text.evidence import evidence_from_spec


def _split_requests(requests: pd.DataFrame, params: dict[str, Any], split: str) -> pd.DataFrame:
    return select_requests(requests, split, params["max_requests"])


def _valid_cap(system: str, params: dict[str, Any], config: OperatingPointConfig) -> int | None:
    """Validation requests `system` decodes: all for a system that chooses its operating point there
    and for the reference (`ar_rl`), the pair whose interval decides; the first `sweep_max_requests`
    (in `select_requests` order, so they pair with the full passes) for a system of `valid_sweep`,
    which chooses nothing; 0 for the rest.
    """
    if config.chooses(system) or system == config.reference:
        return None
    if system not in params["valid_sweep"]:
        return 0
    return params["sweep_max_requests"]


def _test_passes(
    system: str, params: dict[str, Any], config: OperatingPointConfig, operating_point: dict[str, Any] | None
) -> list[tuple[list[TauWindow], int | None]]:
    """(settings, request cap) of each test pass of `system`, in report order.

    The tau sweep is capped at `sweep_max_requests` (the first requests in `select_requests` order, so
    every capped pass is paired with the full ones on the same requests), and so is an AR system
    other than the operating point's reference (`ar_sft`); the reference (`ar_rl`) and each served
    operating point answer every request: they are the pair the headline compares.
    """
    if system in AR_SYSTEMS:
        return [([(None, None)], None if system == config.reference else params["sweep_max_requests"])]
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


def rerank_analyst(
    requests: pd.DataFrame,
    candidates: pd.DataFrame,
    evidence: dict[str, Any],
    splits: pd.DataFrame,
    items: pd.DataFrame,
    params: dict[str, Any],
) -> pd.DataFrame:
    """The learned analyst's noiseless order on the pre-rank's requests of every split: the teacher's
    ceiling (`evidence.json` holds its ranker; the counts are rebuilt from the training sequences,
    the histories read from `candidates`)."""
    analyst = evidence_from_spec(evidence, splits, items)
    frames = [
        analyst_rows(_split_requests(requests, params, s), candidates, analyst, s) for s in params["splits"]
    ]
    return pd.concat(frames, ignore_index=True)


def _sweep(params: dict[str, Any], system: str) -> list[TauWindow]:
    """The tau sweep (whole-block canvas) of `system`: `taus`, unless `taus_by_system` narrows it."""
    taus = params["taus_by_system"].get(system, params["taus"])
    return [(float(t), None) for t in taus]


def _rerank_passes(
    system: str,
    model: PreTrainedModel,
    requests: pd.DataFrame,
    tokenizer: PreTrainedTokenizerFast,
    params: dict[str, Any],
    policy: dict[str, Any],
    reference: dict[str, Any] | None,
    reference_model: PreTrainedModel | None,
    shards: Shards | None,
) -> dict[str, Any]:
    """`system`'s passes over validation (choosing its operating point) and test (`make_rerank_node`)."""
    decoding = RerankConfig(**params["decoding"])
    config = OperatingPointConfig.from_params(params["operating_point"], Policy.from_params(policy))
    model = prepare_model(model, decoding.device)
    frames, operating_point = [], None
    if "valid" in params["splits"]:
        valid = _split_requests(requests, params, "valid")
        if config.chooses(system):
            reference_rows = reference["rankings"] if reference is not None else None
            reference_of = Reference(reference_rows, reference_model)
            # the benchmark's harness times the admitted, on rank 0 alone: every process chooses
            # from the same figures
            timer = solo_timer(candidate_timer(config), shards)
            found = search_operating_point(
                model, tokenizer, system, valid, reference_of, decoding, config, timer
            )
            frames.append(found.rows)
            operating_point = found.point
        elif (cap := _valid_cap(system, params, config)) != 0:
            rows = valid if cap is None else valid.head(int(cap))
            frames.append(
                rerank_system(model, rows, tokenizer, system, _sweep(params, system), decoding, "valid")[0]
            )
    if "test" in params["splits"]:
        test = _split_requests(requests, params, "test")
        for settings, cap in _test_passes(system, params, config, operating_point):
            rows = test if cap is None else test.head(int(cap))
            frames.append(rerank_system(model, rows, tokenizer, system, settings, decoding, "test")[0])
    # No pass at all: validation alone, for a system that neither chooses nor is swept there.
    rankings = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=list(RANKING_COLUMNS))
    return {"rankings": rankings, "operating_point": operating_point}


def make_rerank_node(system: str) -> Callable[..., dict[str, Any]]:
    """The node function of one model system (named `rerank_<system>` for the DAG and the logs).

    Every system's node returns one shape: a dict of its ``rankings`` frame and its
    ``operating_point`` (None for an AR system, and for a diffusion system that does not choose one),
    with `policy` the serving policy (`params:policy`), `reference` the node output of
    `operating_point.reference` (`ar_rl`: its rankings are read) and `reference_model` its model
    (timed beside the candidates).
    """

    def rerank_model(
        model: PreTrainedModel,
        requests: pd.DataFrame,
        tokenizer: PreTrainedTokenizerFast,
        params: dict[str, Any],
        policy: dict[str, Any],
        reference: dict[str, Any] | None = None,
        reference_model: PreTrainedModel | None = None,
    ) -> dict[str, Any]:
        shards = launch_shards()  # each process of a launch decodes its share of every pass
        with shared_decoding(shards):
            return _rerank_passes(
                system, model, requests, tokenizer, params, policy, reference, reference_model, shards
            )

    rerank_model.__name__ = rerank_model.__qualname__ = f"rerank_{system}"
    rerank_model.__doc__ = f"Re-rank the validation and test requests with `{system}`."
    return rerank_model


def solo_timer(timer: TimeCandidates, shards: Shards | None) -> TimeCandidates:
    """`timer` run by rank 0 alone and its figures sent to every process of a launch (`solo`)."""
    if shards is None:
        return timer

    def timed(*args: Any, **kwargs: Any) -> Any:
        return solo(shards, lambda: timer(*args, **kwargs))

    return timed


def combine_rankings(*results: pd.DataFrame | dict[str, Any]) -> dict[str, Any]:
    """All systems' rows in one frame, the operating points, and per-variant decoding figures for MLflow.

    `results`: the frames of the systems no model answers (`rerank_prerank`, `rerank_analyst`) and
    each model system's node output (a dict, `make_rerank_node`)."""
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
