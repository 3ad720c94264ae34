"""Gate and promote what one registration produced, so that something always serves
(docs/operations.md#retraining).

A registration holds up to three new versions: the diffusion re-ranker (role ``diffusion``, only when it
has an operating point), the AR teacher (``teacher``, always) and the pre-rank (the retriever's order on this
run's catalogue). Each re-ranker goes through the checks that apply to it (`gate.decide`,
`gate.decide_teacher`) on the same newest requests; a passing one becomes its model's champion. When
afterwards neither re-ranker has a champion, the pre-rank version does: `make serve` then answers
with the retriever's order, labelled as such (`registry.served_champion`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
from mlflow import MlflowClient

from diffusion_gr2.core.registry import registry
from diffusion_gr2.core.registry.gate import (
    GateConfig,
    decide,
    decide_teacher,
    prerank_score,
    score,
    servable,
    speeds,
)
from diffusion_gr2.core.serving.serving import Ranker

logger = logging.getLogger(__name__)

__all__ = ["gate_and_promote"]


def _tag(client: MlflowClient, name: str, version: str, report: dict[str, Any]) -> None:
    """The gate's decision and figures as version tags (the UI and `registry show` read them)."""
    tags = {
        "gate.decision": report["decision"],
        "gate.reasons": report["reasons"][:5000],
        "gate.decided_by": ",".join(report["decided_by"]),
        **{f"gate.{k.replace('@', '_at_')}": v for k, v in report["numbers"].items()},
    }
    for key, value in tags.items():
        client.set_model_version_tag(name, version, key, str(value))


def _not_registered(reason: str) -> dict[str, Any]:
    """The diffusion side's report when training produced no registrable challenger."""
    return {"decision": "not_registered", "reasons": reason, "decided_by": ["operating_point"]} | {
        "checks": [],
        "numbers": {},
    }


def _champion(name: str, new: str | None, client: MlflowClient) -> registry.VersionRef | None:
    """The current champion of `name` unless it is the version just registered."""
    ref = registry.alias_version(name, registry.CHAMPION, client)
    return ref if ref is not None and ref.version != new else None


def _gate_diffusion(
    rankers: Mapping[str, Ranker],
    scores: Mapping[str, dict[str, Any]],
    same: pd.DataFrame,
    prerank: dict[str, Any],
    config: GateConfig,
    users: list[Any] | None,
    shadow: Callable[[Ranker], dict[str, Any]] | None,
) -> dict[str, Any]:
    """The diffusion challenger's gate: its scores with the timed speeds, and the shadow replay if any."""
    # the champion is timed only where there is one
    timed = {"challenger": "diffusion", "teacher": "teacher"} | (
        {"champion": "diffusion_champion"} if "diffusion_champion" in rankers else {}
    )
    rates = speeds({role: rankers[key] for role, key in timed.items()}, same, config)
    sides = {role: scores[key] | {"output_tokens_per_s": rates[role]} for role, key in timed.items()}
    replay = shadow(rankers["diffusion"]) if shadow is not None else None
    return decide(
        sides["challenger"], sides.get("champion"), sides["teacher"], prerank, config, users, replay
    )


def _fall_back_to_prerank(prerank_version: Any, client: MlflowClient) -> registry.Served:
    """Promote the pre-rank when no re-ranker has a champion; what serves now."""
    names = registry.RERANKER_MODELS
    reranker_serves = any(registry.alias_version(n, registry.CHAMPION, client) for n in names.values())
    if not reranker_serves and prerank_version is not None:
        reason = "no re-ranker has passed the gate: the retriever's order serves"
        registry.promote(registry.PRERANK_MODEL, prerank_version, reason, client)
    return registry.served_champion(client)


def _log_decisions(
    report: dict[str, Any], teacher_report: dict[str, Any], new: Mapping[str, Any], served: registry.Served
) -> None:
    """Each refusal's reasons as a warning, then one line: both decisions and what serves."""
    names = registry.RERANKER_MODELS
    for side, gated in (("diffusion", report), ("teacher", teacher_report)):
        if gated["decision"] == "refuse":  # the console's reason (gate.json has every figure)
            logger.warning("gate refused %s v%s: %s", names[side], new[side], gated["reasons"])
    logger.info(
        "gate: diffusion %s, teacher %s; %s", report["decision"], teacher_report["decision"], served.line()
    )


def gate_and_promote(
    versions: Mapping[str, Any],
    requests: pd.DataFrame,
    config: GateConfig,
    load: Callable[[str], Ranker],
    client: MlflowClient | None = None,
    shadow: Callable[[Ranker], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Gate the new versions (`versions`: ``diffusion``, ``teacher``, ``prerank`` version numbers, None
    when not registered, and ``not_registered``: why the diffusion model is not), promote what passes,
    fall back to the pre-rank.

    The report is the diffusion model's gate (``decision``: promote, refuse or not_registered, with
    ``checks`` and ``numbers``), the teacher's under ``teacher_gate``, and ``serving``: the one line
    saying what serves now and why. `load` turns a model URI into its `Ranker`. `shadow` replays the
    champion's logged requests through the diffusion challenger (`shadow.evaluate`); its checks join
    the diffusion gate's.
    """
    client = client or MlflowClient()
    names = registry.RERANKER_MODELS
    new = {s: versions.get(s) for s in names}
    # the new versions, and each model's champion it is compared with
    rankers = {s: load(f"models:/{names[s]}/{v}") for s, v in new.items() if v is not None}
    # a diffusion champion matters only against a diffusion challenger
    champions = {s: _champion(names[s], new[s], client) if new[s] else None for s in names}
    rankers |= {f"{s}_champion": load(ref.uri) for s, ref in champions.items() if ref is not None}
    same = servable(requests, list(rankers.values()))
    if same.empty:
        raise ValueError("the gate has no request every compared model can serve")
    users = same["user"].tolist() if "user" in same else None
    prerank = prerank_score(same)
    scores = {key: score(ranker, same) for key, ranker in rankers.items()}
    if new["teacher"] is None:
        raise ValueError("no teacher version to gate: register_models registers the teacher every time")
    teacher_report = decide_teacher(scores["teacher"], scores.get("teacher_champion"), prerank, config, users)
    if new["diffusion"] is None:
        report = _not_registered(versions.get("not_registered") or "the diffusion model is not registered")
    else:
        report = _gate_diffusion(rankers, scores, same, prerank, config, users, shadow)
        _tag(client, names["diffusion"], new["diffusion"], report)
        if report["decision"] == "promote":
            registry.promote(names["diffusion"], new["diffusion"], report["reasons"], client)
    _tag(client, names["teacher"], new["teacher"], teacher_report)
    if teacher_report["decision"] == "promote":
        teacher_reason = f"teacher gate: {teacher_report['reasons']}"
        registry.promote(names["teacher"], new["teacher"], teacher_reason, client)
    served = _fall_back_to_prerank(versions.get("prerank"), client)
    _log_decisions(report, teacher_report, new, served)
    return report | {
        "challenger_version": new["diffusion"],
        "teacher_version": new["teacher"],
        "prerank_version": versions.get("prerank"),
        "champion_version": champions["diffusion"].version if champions["diffusion"] else None,
        "teacher_gate": teacher_report
        | {"champion_version": champions["teacher"].version if champions["teacher"] else None},
        "serving": served.line(),
    }
