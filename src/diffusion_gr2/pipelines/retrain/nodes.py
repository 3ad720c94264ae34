"""retrain nodes: take in fresh files, register the new models, gate and promote (DESIGN §9)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlflow
import pandas as pd
from mlflow import MlflowClient

from diffusion_gr2.core.tracking import registry
from diffusion_gr2.core.tracking.gate import (
    GateConfig,
    decide,
    newest_slice,
    prerank_score,
    score,
    servable,
    speeds,
)
from diffusion_gr2.core.tracking.ingest import IngestConfig, acquire_lock, ingest, release_lock
from diffusion_gr2.core.tracking.lineage import DigestCache
from diffusion_gr2.core.tracking.mlflow_utils import as_metrics_history
from diffusion_gr2.core.tracking.serving import Ranker, ServingConfig

logger = logging.getLogger(__name__)


def take_in_incoming(params: dict[str, Any]) -> dict[str, Any]:
    """Hold the retrain lock, then validate and merge the incoming files (the report says what happened)."""
    acquire_lock(params["lock_file"])
    return ingest(IngestConfig(**params["ingest"]))


def after_ingest(prepare: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`data_prep`'s node, made to wait for the ingest (its only input is its parameters)."""

    def prepare_dataset(params: dict[str, Any], ingest_report: dict[str, Any]) -> dict[str, Any]:
        return prepare(params)

    prepare_dataset.__doc__ = prepare.__doc__
    return prepare_dataset


class NoOperatingPoint(RuntimeError):
    """The diffusion system has no operating point chosen on validation: it is not registered."""


def _serving(
    system: str,
    operating_point: dict[str, Any] | None,
    params: dict[str, Any],
    traces: dict[str, Any],
    inference: dict[str, Any],
) -> tuple[ServingConfig, str]:
    """The serving settings of `system`: operating point, the inference decoding, the prompt of traces.

    `operating_point` is the run's `operating_point.json` (chosen on validation for these very
    models). A diffusion system without one (refused on validation, or never chosen) raises
    `NoOperatingPoint`, unless `register_without_operating_point` serves it at `fallback_tau`, tagged.
    """
    from diffusion_gr2.core.rank.operating_point import OperatingPointError, resolve_operating_point

    tau, window, source = None, None, "ar"
    if system != "ar_rl":
        try:
            tau, window = resolve_operating_point(operating_point, system)
            source = "operating_point.json (validation)"
        except OperatingPointError as err:
            if not params.get("register_without_operating_point", False):
                raise NoOperatingPoint(str(err)) from err
            tau = float(params["fallback_tau"])
            source = f"fallback tau {tau} by register_without_operating_point: {err}"
            logger.warning("registering %s at the fallback tau %s (override): %s", system, tau, err)
    config = ServingConfig(
        system=system,
        tau=tau,
        window=window,
        decoding=dict(inference["decoding"]),
        prompt=dict(traces["prompt"]),
        limits=dict(params.get("limits") or {}),
    )
    return config, source


def choose_operating_point(
    model_rl: Any, model_ar_rl: Any, requests: pd.DataFrame, tokenizer: Any, inference: dict[str, Any]
) -> dict[str, Any]:
    """`rl`'s operating point for the models this retrain trained, on its validation requests.

    The inference stage's own rule and passes (`rerank_ar_rl` as the reference, then `rerank_rl`'s
    candidates), on the validation split only: the test passes are the default run's report, and the
    gate measures the challenger on the newest test requests itself.
    """
    from diffusion_gr2.pipelines.inference.nodes import make_rerank_node

    valid = {**inference, "splits": ["valid"]}
    reference = make_rerank_node("ar_rl")(model_ar_rl, requests, tokenizer, valid)
    result = make_rerank_node("rl")(model_rl, requests, tokenizer, valid, reference, model_ar_rl)
    return {} if result["operating_point"] is None else {"rl": result["operating_point"]}


def register_models(
    model_rl: Any,
    model_ar_rl: Any,
    items: pd.DataFrame,
    sids: pd.DataFrame,
    operating_point: dict[str, Any] | None,
    params: dict[str, Any],
    traces: dict[str, Any],
    inference: dict[str, Any],
) -> dict[str, str | None]:
    """Register `rl` as a new `diffusion-gr2` version and `ar_rl` as `diffusion-gr2-teacher`, both challenger.

    The model objects only order the node after training; the saved folders are what is registered.
    When `rl` has no operating point nothing is registered (a model validation refused never becomes
    a challenger): the versions are None and `not_registered` says why; the gate reports it.
    """
    try:
        configs = {s: _serving(s, operating_point, params, traces, inference) for s in ("ar_rl", "rl")}
    except NoOperatingPoint as err:
        reason = (
            f"rl not registered: {err} (set retrain.register_without_operating_point to register it "
            f"at the fallback tau {params['fallback_tau']}, tagged as such)"
        )
        logger.warning("%s", reason)
        return {"ar_rl": None, "rl": None, "not_registered": reason}
    digests, run = DigestCache(), mlflow.active_run()
    refs = {}
    for system, name in (("ar_rl", registry.TEACHER_MODEL), ("rl", registry.DIFFUSION_MODEL)):
        folder = Path(params["model_dirs"][system])
        config, source = configs[system]
        tags = {
            "lineage.model.name": f"model_{system}",
            "lineage.model.path": str(folder),
            "lineage.model.digest": digests.digest(folder) or "",
            "lineage.model.run_id": run.info.run_id if run else "",
            "operating_point.source": source[:5000],
        }
        if system == "rl":
            tags["teacher_version"] = refs["ar_rl"]
        refs[system] = registry.register_reranker(name, folder, items, sids, config, tags).version
    return refs


def gate_requests(
    candidates: pd.DataFrame, splits: pd.DataFrame, items: pd.DataFrame, params: dict[str, Any]
) -> pd.DataFrame:
    """The newest time slice of the test requests, in raw item ids (the gate's held-out set)."""
    return newest_slice(candidates, splits, items, GateConfig(**params["gate"]))


def _ranker(uri: str) -> Ranker:
    return mlflow.pyfunc.load_model(uri).unwrap_python_model().ranker


def _not_registered(versions: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The gate's report when training produced no registrable challenger (no promotion, lock freed)."""
    result = {
        "decision": "not_registered",
        "reasons": versions["not_registered"],
        "decided_by": ["operating_point"],
        "checks": [],
        "numbers": {},
        "challenger_version": None,
        "teacher_version": None,
        "champion_version": None,
    }
    if mlflow.active_run() is not None:
        mlflow.set_tags({"gate.decision": result["decision"], "gate.reasons": result["reasons"][:5000]})
    logger.warning("gate: nothing registered (%s)", result["reasons"])
    release_lock(params["lock_file"])
    return {"gate_report": result, "gate_metrics": as_metrics_history({})}


def run_gate(versions: dict[str, Any], requests: pd.DataFrame, params: dict[str, Any]) -> dict[str, Any]:
    """Challenger vs champion, teacher and pre-rank on the same requests; promote or refuse; log it."""
    if versions.get("rl") is None:
        return _not_registered(versions, params)
    config, client = GateConfig(**params["gate"]), MlflowClient()
    challenger = _ranker(f"models:/{registry.DIFFUSION_MODEL}/{versions['rl']}")
    teacher = _ranker(f"models:/{registry.TEACHER_MODEL}/{versions['ar_rl']}")
    champion_ref = registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION, client)
    champion = _ranker(champion_ref.uri) if champion_ref and champion_ref.version != versions["rl"] else None
    same = servable(requests, [r for r in (challenger, champion, teacher) if r is not None])
    if same.empty:
        raise ValueError("the gate has no request every compared model can serve")
    compared = {"challenger": challenger, "teacher": teacher} | ({"champion": champion} if champion else {})
    rates = speeds(compared, same, config)
    scores = {name: score(r, same) | {"output_tokens_per_s": rates[name]} for name, r in compared.items()}
    users = same["user"].tolist() if "user" in same else None
    result = decide(
        scores["challenger"], scores.get("champion"), scores["teacher"], prerank_score(same), config, users
    )
    result |= {
        "challenger_version": versions["rl"],
        "teacher_version": versions["ar_rl"],
        "champion_version": champion_ref.version if champion_ref else None,
    }
    if result["decision"] == "promote":
        registry.promote(registry.DIFFUSION_MODEL, versions["rl"], result["reasons"], client)
        registry.promote(
            registry.TEACHER_MODEL,
            versions["ar_rl"],
            f"teacher of {registry.DIFFUSION_MODEL} v{versions['rl']}",
            client,
        )
    for key, value in {
        "gate.decision": result["decision"],
        "gate.reasons": result["reasons"][:5000],
        "gate.decided_by": ",".join(result["decided_by"]),
        **{f"gate.{k.replace('@', '_at_')}": v for k, v in result["numbers"].items()},
    }.items():
        client.set_model_version_tag(registry.DIFFUSION_MODEL, versions["rl"], key, str(value))
    if mlflow.active_run() is not None:
        mlflow.set_tags({"gate.decision": result["decision"], "gate.challenger_version": versions["rl"]})
    logger.info("gate: %s (%s)", result["decision"], result["reasons"])
    release_lock(params["lock_file"])
    return {
        "gate_report": result,
        "gate_metrics": as_metrics_history({k: v for k, v in result["numbers"].items() if v is not None}),
    }
