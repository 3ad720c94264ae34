"""Whether a retrain has anything to do (docs/operations.md#retraining): the one decision every way of
starting one makes.

A retrain runs when the incoming folder holds rows the raw folder lacks, when no champion serves yet
(a first retrain is the full recipe), or when forced; the pre-rank's or the teacher's champion serves
too. Otherwise the same delivery twice must change nothing: the files are still taken in
(duplicates to ``done/``, bad files to quarantine, under the retrain lock), their report goes to
``ingest_without_retrain.json`` (the last retrain's ``ingest.json`` is an input on its lineage record
and stays as it was), and nothing is trained or registered.

`python -m diffusion_gr2 retrain` asks before it opens a Kedro session; the retrain pipeline's first
node (`decide_retrain`) asks again, so a plain ``kedro run --pipelines retrain`` and the Airflow DAG
(its first task, then every other task skipped) stop on the same answer.

Each delivery is also compared with the champion's training window (`core.monitoring.drift`); the
summary joins the reason. Fewer new rows than ``min_new_rows`` wait in the incoming folder for more,
unless strong drift forces a retrain (``drift.force_retrain``); ``trigger`` says which rule decided.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow import MlflowClient

from diffusion_gr2.core.data.readers import classify_file, detect_format, read_interactions
from diffusion_gr2.core.io import atomic_write_text
from diffusion_gr2.core.lineage.lineage import file_md5
from diffusion_gr2.core.lineage.lineage_report import raw_inputs
from diffusion_gr2.core.monitoring.drift import DriftConfig, drift_report
from diffusion_gr2.core.monitoring.ingest import (
    IngestConfig,
    acquire_lock,
    ingest,
    pending_delivery,
    release_lock,
)
from diffusion_gr2.core.registry import registry

logger = logging.getLogger(__name__)

__all__ = [
    "NO_RETRAIN_REPORT",
    "NothingToRetrain",
    "RetrainConfig",
    "RetrainDecision",
    "decide_from_params",
    "decide_retrain",
    "delivery_drift",
]

NO_RETRAIN_REPORT = "data/08_reporting/retrain/ingest_without_retrain.json"


class NothingToRetrain(RuntimeError):
    """Raised by a retrain pipeline run asked to go on past a decision not to retrain."""


# The sections of `retrain` that other typed configs read: IngestConfig, DriftConfig, GateConfig,
# ShadowConfig (core/registry/shadow.py), RegisterConfig and the warm-start plan (pipelines/retrain).
RETRAIN_SECTIONS = frozenset({"ingest", "drift", "warm_start", "register", "gate", "shadow"})


@dataclass(frozen=True)
class RetrainConfig:
    """`retrain`'s own settings (its sections are their own configs). No defaults: conf/base holds
    every value, with why."""

    force: bool  # retrain even when nothing new arrived (`--force`, `retrain.force=true`)
    lock_file: str  # one retrain at a time: the decision's ingest, and the pipeline's from ingest to gate
    min_new_rows: int  # fewer new rows wait in the incoming folder, unless strong drift forces a retrain

    @classmethod
    def from_params(cls, section: Mapping[str, Any]) -> RetrainConfig:
        """From `params["retrain"]`: every setting required; a key that is neither one of them nor
        one of `RETRAIN_SECTIONS` is refused (a typo would otherwise pass silently)."""
        own = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(section) - own - RETRAIN_SECTIONS), sorted(own - set(section))
        if unknown or missing:
            raise ValueError(
                f"retrain: unknown keys {unknown}, missing keys {missing} (its settings: {sorted(own)}; "
                f"its sections: {sorted(RETRAIN_SECTIONS)})"
            )
        return cls(
            force=bool(section["force"]),
            lock_file=str(section["lock_file"]),
            min_new_rows=int(section["min_new_rows"]),
        )


@dataclass(frozen=True)
class RetrainDecision:
    """The answer, and what it was based on (a JSON-able record: ``dataclasses.asdict``)."""

    retrain: bool
    reason: str  # one line for a person: the CLI prints it, Airflow's skip carries it
    new_rows: int  # rows of the incoming files the raw folder does not hold
    champion_version: str | None  # the served `diffusion-gr2` version, if any
    forced: bool
    # the rule that decided: forced | no_champion | new_rows | drift (strong drift below the
    # minimum) | waiting (new rows below the minimum, left in incoming/) | nothing_new
    trigger: str
    drift: dict[str, Any] | None  # the drift report (`core.monitoring.drift`); None: off or nothing new
    # files this decision moved to quarantine (nothing new only): a delivery a person must look at
    quarantined: int = 0


def _reference_files(raw_folder: Path, client: MlflowClient, champion: str | None) -> tuple[list[Path], str]:
    """The interaction files of the champion's training window, and where that window came from.

    The champion's lineage names the raw files `data_prep` read; each that still holds its recorded
    hash is the reference. Without such a record (no champion, or registered outside a Kedro run)
    the raw folder as it is now, before this delivery is merged, stands in, and the source says so.
    """
    recorded = raw_inputs(client, registry.DIFFUSION_MODEL, champion) if champion else {}
    held = [
        Path(entry["path"])
        for name, entry in recorded.items()
        if (kind := classify_file(name.removeprefix("raw/")))
        and kind[1] == "inter"
        and entry.get("path")
        and Path(entry["path"]).is_file()
        and file_md5(Path(entry["path"])) == entry["digest"]
    ]
    if held:
        return (
            held,
            f"{registry.DIFFUSION_MODEL} v{champion}'s training window ({len(held)} raw files, hashes as recorded)",
        )
    why = f"v{champion} has no raw files on record that still hold their hash" if champion else "no champion"
    files = detect_format(raw_folder).interaction_files
    return files, f"the raw folder before this delivery ({why})"


def delivery_drift(
    config: IngestConfig, drift: DriftConfig, client: MlflowClient, champion: str | None
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the dry run's ingest report, the drift report of the rows it would merge, None when none)."""
    pending, delivery = pending_delivery(config)
    if delivery.empty or not drift.enabled:
        return pending, None
    files, source = _reference_files(Path(pending["raw_folder"]), client, champion)
    reference: pd.DataFrame = read_interactions(files)
    report = drift_report(reference, delivery, drift)
    report["reference"] |= {"source": source, "files": [p.name for p in files]}
    report["delivery"]["files"] = [f["file"] for f in pending["files"] if f.get("new_rows")]
    return pending, report


def decide_from_params(params: dict[str, Any], force: bool, client: MlflowClient) -> RetrainDecision:
    """`decide_retrain` on the ``retrain`` parameters (the CLI and the pipeline's node read the same);
    forced when `force` or `retrain.force`."""
    config = RetrainConfig.from_params(params)
    return decide_retrain(
        IngestConfig(**params["ingest"]),
        config.lock_file,
        force or config.force,
        client,
        drift=DriftConfig(**params["drift"]),
        min_new_rows=config.min_new_rows,
    )


def decide_retrain(
    config: IngestConfig,
    lock_file: str | Path,
    force: bool,
    client: MlflowClient,
    report_file: str | Path = NO_RETRAIN_REPORT,
    drift: DriftConfig | None = None,
    min_new_rows: int = 1,
) -> RetrainDecision:
    """Retrain on new rows, with nothing serving, or when `force`; else take the files in and say why not.

    Any champion counts as serving, the pre-rank's and the teacher's included: on the same data a
    retrain trains the same models, so nightly runs with nothing new would refuse them again.
    Deciding to retrain moves nothing (a dry run): the pipeline's own ingest takes the files in. With
    `drift`, the delivery is compared with the champion's training window; under `min_new_rows` new
    rows the files wait in the incoming folder unless strong drift forces a retrain.
    """
    champion = registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION, client)
    version = champion.version if champion else None
    served = registry.served_champion(client).ref
    if drift is not None:
        pending, report = delivery_drift(config, drift, client, version)
    else:
        pending, report = ingest(config, dry_run=True), None
    new_rows = int(pending["new_rows"])
    strong = bool(report and report["strong"] and drift is not None and drift.force_retrain)
    floor = max(min_new_rows, 1)
    rules = [
        ("forced", "forced", force),
        ("no_champion", "no champion serves yet", served is None),  # a first retrain: the full recipe
        ("new_rows", f"{new_rows} new rows in {config.incoming_dir}", new_rows >= floor),
        (
            "drift",
            f"strong drift forces a retrain on {new_rows} new rows (< min_new_rows {floor})",
            new_rows > 0 and strong,
        ),
    ]
    trigger, reason = next(((t, text) for t, text, holds in rules if holds), (None, ""))
    drift_note = f"; drift: {report['summary']}" if report else ""
    if trigger is not None:
        logger.info("retrain: %s%s", reason, drift_note)
        return RetrainDecision(True, reason + drift_note, new_rows, version, force, trigger, report)
    assert served is not None  # the no_champion rule held otherwise
    if new_rows > 0:  # below the minimum: the files stay where they are and count with the next ones
        reason = (
            f"{new_rows} new rows in {config.incoming_dir} < min_new_rows {floor}: they wait there for "
            f"more, {_stays(served)}{drift_note}"
        )
        logger.info("%s", reason)
        return RetrainDecision(False, reason, new_rows, version, False, "waiting", report)
    return _take_in_without_retrain(config, lock_file, report_file, served, version)


def _stays(served: registry.VersionRef) -> str:
    """The words for the champion that keeps serving; what it is, when not the diffusion re-ranker."""
    if served.name == registry.DIFFUSION_MODEL:
        return f"{served.name} v{served.version} stays champion"
    return f"{served.name} v{served.version} ({registry.model_label(served.name)}) stays champion"


def _delivery_words(report: dict[str, Any], config: IngestConfig) -> str:
    """What the incoming folder held, from the ingest's report: nothing, only refused files, or
    files whose rows the raw folder already holds (some perhaps refused)."""
    files, quarantined = len(report["files"]), int(report["quarantined"])
    if files == 0:
        return f"no delivery in {config.incoming_dir}"
    if quarantined == files:
        return (
            f"every file delivered to {config.incoming_dir} was quarantined ({files} file(s), each "
            f"beside its .reason.txt in {config.quarantine_dir})"
        )
    return (
        f"nothing new in {config.incoming_dir} ({files} file(s): {quarantined} quarantined, "
        "the rest already held)"
    )


def _take_in_without_retrain(
    config: IngestConfig,
    lock_file: str | Path,
    report_file: str | Path,
    served: registry.VersionRef,
    version: str | None,
) -> RetrainDecision:
    """Nothing new and a champion serving: take the files in under the lock (duplicates to done/, bad
    files to quarantine), write the report, and say why nothing is retrained."""
    acquire_lock(lock_file)
    try:
        report = ingest(config)
    finally:
        release_lock(lock_file)
    atomic_write_text(report_file, json.dumps(report, indent=2))
    reason = f"{_delivery_words(report, config)}: no retrain, {_stays(served)}"
    if served.name != registry.DIFFUSION_MODEL:  # no diffusion champion: say how to try again
        reason += " (on the same data a retrain trains the same models: `retrain --force` to run one anyway)"
    logger.info("%s", reason)
    quarantined = int(report["quarantined"])
    return RetrainDecision(False, reason, 0, version, False, "nothing_new", None, quarantined)
