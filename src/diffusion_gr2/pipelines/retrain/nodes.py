"""retrain nodes: take in fresh files, register the new models, gate and promote
(docs/operations.md#retraining)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd

from diffusion_gr2.core.bench.benchmark import candidate_timer
from diffusion_gr2.core.evaluate.policy import Policy
from diffusion_gr2.core.lineage import model_card
from diffusion_gr2.core.lineage.lineage import DigestCache
from diffusion_gr2.core.monitoring.ingest import (
    IngestConfig,
    acquire_lock,
    delivered_interactions,
    ingest,
    release_lock,
)
from diffusion_gr2.core.monitoring.retrain_decision import RetrainConfig
from diffusion_gr2.core.rank.point_search import OperatingPointConfig, search_beside_reference
from diffusion_gr2.core.rank.rerank import SERVED_DIFFUSION, RerankConfig, select_requests
from diffusion_gr2.core.registry import registry, shadow
from diffusion_gr2.core.registry.gate import GateConfig, newest_slice
from diffusion_gr2.core.registry.promotion import gate_and_promote
from diffusion_gr2.core.runs.mlflow_utils import as_metrics_history
from diffusion_gr2.core.serving.request_log import RequestLogConfig, read_log
from diffusion_gr2.core.serving.serving import PRERANK, Ranker, ServingConfig
from diffusion_gr2.core.text.evidence import shows_evidence

logger = logging.getLogger(__name__)


def take_in_incoming(params: dict[str, Any]) -> dict[str, Any]:
    """Hold the retrain lock, then validate and merge the incoming files (the report says what happened)."""
    acquire_lock(RetrainConfig.from_params(params).lock_file)
    return ingest(IngestConfig(**params["ingest"]))


def after_ingest(prepare: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`data_prep`'s node, made to wait for the ingest (its only input is its parameters)."""

    def prepare_dataset(params: dict[str, Any], ingest_report: dict[str, Any]) -> dict[str, Any]:
        return prepare(params)

    prepare_dataset.__doc__ = prepare.__doc__
    return prepare_dataset


@dataclass(frozen=True)
class RegisterConfig:
    """`retrain.register`: the folders registered and what a refused operating point does. Every
    setting is conf/base's (no defaults here: the config is the one source)."""

    model_dirs: Mapping[str, str]  # role ("diffusion", "teacher") -> the model folder registered
    # A diffusion system without an operating point on validation is not registered; True registers
    # it anyway at `fallback_tau`, its `operating_point.source` tag naming the refusal it overrode.
    without_operating_point: bool
    fallback_tau: float
    limits: Mapping[str, Any]  # `serving.Limits` overrides of every version registered; {} = its own


class NoOperatingPoint(RuntimeError):
    """The diffusion system has no operating point chosen on validation: it is not registered."""


def _serving(
    system: str,
    operating_point: dict[str, Any] | None,
    register: RegisterConfig,
    traces: dict[str, Any],
    inference: dict[str, Any],
) -> tuple[ServingConfig, str]:
    """The serving settings of `system`: operating point, the inference decoding, the prompt of traces.

    `operating_point` is the run's `operating_point.json` (chosen on validation for these very
    models). A diffusion system without one (refused on validation, or never chosen) raises
    `NoOperatingPoint`, unless `register.without_operating_point` serves it at `fallback_tau`, tagged.
    """
    from diffusion_gr2.core.rank.operating_point import OperatingPointError, resolve_operating_point

    tau, window, source = None, None, "ar"
    if system != "ar_rl":
        try:
            tau, window = resolve_operating_point(operating_point, system)
            source = "operating_point.json (validation)"
        except OperatingPointError as err:
            if not register.without_operating_point:
                raise NoOperatingPoint(str(err)) from err
            tau = float(register.fallback_tau)
            source = f"fallback tau {tau} by retrain.register.without_operating_point: {err}"
            logger.warning("registering %s at the fallback tau %s (override): %s", system, tau, err)
    config = ServingConfig(
        system=system,
        tau=tau,
        window=window,
        decoding=dict(inference["decoding"]),
        prompt=dict(traces["prompt"]),
        limits=dict(register.limits),
    )
    return config, source


def choose_operating_point(
    model_diffusion: Any,
    model_ar_rl: Any,
    requests: pd.DataFrame,
    tokenizer: Any,
    inference: dict[str, Any],
    policy: dict[str, Any],
) -> dict[str, Any]:
    """The served diffusion system's operating point for the models this retrain trained, on its
    validation requests: `operating_point.json`'s entry, keyed by the system ({} when
    `inference.operating_point.systems` does not name it).

    The inference stage's rule and settings under the serving `policy` (`params:policy`, which the
    gate reads too), in one core call (`search_beside_reference`: `ar_rl` decodes the validation
    requests, then the candidates are decoded, gated, timed beside it and one chosen or all
    refused); validation only: the test passes are the default run's report, and the gate measures
    the challenger on the newest test requests itself.
    """
    config = OperatingPointConfig.from_params(inference["operating_point"], Policy.from_params(policy))
    if not config.chooses(SERVED_DIFFUSION):
        logger.info("%s chooses no operating point (inference.operating_point.systems)", SERVED_DIFFUSION)
        return {}
    decoding = RerankConfig(**inference["decoding"])
    valid = select_requests(requests, "valid", inference["max_requests"])
    found = search_beside_reference(
        model_diffusion,
        model_ar_rl,
        tokenizer,
        SERVED_DIFFUSION,
        valid,
        decoding,
        config,
        candidate_timer(config),
    )
    return {SERVED_DIFFUSION: found.point}


def _shown_evidence(
    evidence: dict[str, Any] | None, splits: pd.DataFrame | None
) -> tuple[dict[str, Any] | None, pd.DataFrame | None]:
    """The evidence spec the prompts show (None: none) and the training sequences it is counted on."""
    shown = evidence if shows_evidence(evidence) else None
    if shown is not None and splits is None:
        raise ValueError(
            "register_models: the prompts show evidence, so the training sequences (splits) are needed"
        )
    sequences = splits[["user_id", "train_items"]] if shown is not None and splits is not None else None
    return shown, sequences


def _lineage_tags(system: str, folder: Path, digests: DigestCache, run: Any, source: str) -> dict[str, str]:
    """The version tags saying which saved model, of which run, at which operating point."""
    return {
        "lineage.model.name": f"model_{system}",
        "lineage.model.path": str(folder),
        "lineage.model.digest": digests.digest(folder) or "",
        "lineage.model.run_id": run.info.run_id if run else "",
        "operating_point.source": source[:5000],
    }


def register_models(
    model_diffusion: Any,
    model_ar_rl: Any,
    items: pd.DataFrame,
    sids: pd.DataFrame,
    operating_point: dict[str, Any] | None,
    params: dict[str, Any],
    traces: dict[str, Any],
    inference: dict[str, Any],
    evidence: dict[str, Any] | None = None,
    splits: pd.DataFrame | None = None,
) -> dict[str, str | None]:
    """Register `ar_rl` as a new `diffusion-gr2-teacher` version, the served diffusion system
    (`SERVED_DIFFUSION`) as `diffusion-gr2` and the pre-rank (this run's catalogue) as
    `diffusion-gr2-prerank`, each its model's challenger. The versions are keyed by role: ``teacher``,
    ``diffusion``, ``prerank``.

    The model objects only order the node after training; the saved folders are what is registered.
    When the diffusion system has no operating point it is not registered (a model validation refused
    never becomes a challenger): its version is None and `not_registered` says why; the teacher still
    is, and goes through its own gate (`core/registry/promotion.py`). `params`: `retrain`, of which
    `register` (`RegisterConfig`) is read here. Where the prompts showed `evidence`, each model's
    version carries its spec and the training sequences it is counted on, so it serves the prompts
    it was trained on.
    """
    shown, sequences = _shown_evidence(evidence, splits)
    register = RegisterConfig(**params["register"])
    digests, run = DigestCache(), mlflow.active_run()
    refs: dict[str, str | None] = {"diffusion": None}
    not_registered = None
    for role, system in (("teacher", "ar_rl"), ("diffusion", SERVED_DIFFUSION)):  # the teacher first
        try:
            config, source = _serving(system, operating_point, register, traces, inference)
            config = replace(config, evidence=shown)
        except NoOperatingPoint as err:
            not_registered = (
                f"{system} not registered: {err} (set retrain.register.without_operating_point to "
                f"register it at the fallback tau {register.fallback_tau}, tagged as such)"
            )
            logger.warning("%s", not_registered)
            continue
        folder = Path(register.model_dirs[role])
        tags = _lineage_tags(system, folder, digests, run, source)
        if role == "diffusion":
            tags["teacher_version"] = refs["teacher"]
        name = registry.RERANKER_MODELS[role]
        refs[role] = registry.register_reranker(
            name, folder, items, sids, config, tags, sequences=sequences
        ).version
    prerank = ServingConfig(system=PRERANK, tau=None, limits=dict(register.limits))
    run_tag = {"lineage.model.run_id": run.info.run_id if run else ""}
    refs["prerank"] = registry.register_reranker(
        registry.PRERANK_MODEL, None, items, sids, prerank, run_tag
    ).version
    return refs | ({"not_registered": not_registered} if not_registered else {})


def gate_requests(
    candidates: pd.DataFrame, splits: pd.DataFrame, items: pd.DataFrame, params: dict[str, Any]
) -> pd.DataFrame:
    """The newest time slice of the test requests, in raw item ids (the gate's held-out set; which
    requests, not what they must reach: no policy is read here)."""
    return newest_slice(candidates, splits, items, GateConfig(**params["gate"]))


def gate_config(params: dict[str, Any], policy: dict[str, Any]) -> GateConfig:
    """`retrain.gate` (how the gate measures) with the serving policy (what it asks): `params` is
    `retrain`, `policy` the `policy` block the operating point's choice reads too."""
    return GateConfig(**params["gate"], policy=Policy.from_params(policy))


def _ranker(uri: str) -> Ranker:
    return mlflow.pyfunc.load_model(uri).unwrap_python_model().ranker


def _shadow(
    params: dict[str, Any], serving: dict[str, Any], gate: GateConfig, ingest_report: dict[str, Any] | None
) -> Callable[[Ranker], dict[str, Any]] | None:
    """The shadow evaluation of a challenger on the request log of the champion serving now (before
    the gate moves it), with this retrain's delivery as feedback, held to `gate`'s policy; None when
    `retrain.shadow` is off."""
    config = shadow.ShadowConfig(**params["shadow"])
    if not config.enabled:
        return None
    served = registry.served_champion().ref
    log_config = RequestLogConfig(**serving["request_log"])
    log, torn = read_log(log_config.folder) if log_config.enabled else (pd.DataFrame(), 0)
    delivered = delivered_interactions(ingest_report)

    def replay(challenger: Ranker) -> dict[str, Any]:
        report = shadow.evaluate(challenger, served, _ranker, log, delivered, gate, config)
        return report | {
            "log": log_config.folder,
            "torn_rows_skipped": torn,
            "delivered_rows": len(delivered),
        }

    return replay


def run_gate(
    versions: dict[str, Any],
    requests: pd.DataFrame,
    params: dict[str, Any],
    serving: dict[str, Any],
    policy: dict[str, Any],
    ingest_report: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Gate the new versions, promote what passes, else the pre-rank (`promotion.gate_and_promote`); log it.

    Every bar is the serving `policy`'s (`params:policy`: the one the operating point was chosen
    under). The diffusion challenger also replays the champion's logged requests (`_shadow`; feedback
    from `ingest_report`'s delivery, none after a first run). The retrain lock is released however the
    gate ends.
    """
    # before the try: the finally releases it (a `retrain` section refused here was refused by the
    # ingest, which takes the lock, first)
    lock_file = RetrainConfig.from_params(params).lock_file
    try:
        config = gate_config(params, policy)
        replay = _shadow(params, serving, config, ingest_report)
        result = gate_and_promote(versions, requests, config, _ranker, shadow=replay)
        if mlflow.active_run() is not None:
            mlflow.set_tags(
                {
                    "gate.decision": result["decision"],
                    "gate.reasons": result["reasons"][:5000],
                    "gate.challenger_version": str(result["challenger_version"]),
                    "gate.teacher_decision": result["teacher_gate"]["decision"],
                }
            )
        model_card.publish_cards(result)  # a card per gated version, from what the run recorded
    finally:
        release_lock(lock_file)
    return {
        "gate_report": result,
        "gate_metrics": as_metrics_history({k: v for k, v in result["numbers"].items() if v is not None}),
    }
