"""Whether a retrain has anything to do (DESIGN §9): the one decision every way of starting one makes.

A retrain runs when the incoming folder holds rows the raw folder lacks, when no champion serves yet
(a first retrain is the full recipe), or when forced. Otherwise the same delivery twice must change
nothing: the files are still taken in (duplicates to ``done/``, bad files to quarantine, under the
retrain lock), their report goes to ``ingest_without_retrain.json`` (the last retrain's ``ingest.json``
is an input on its lineage record and stays as it was), and nothing is trained or registered.

`python -m diffusion_gr2 retrain` asks before it opens a Kedro session; the retrain pipeline's first
node (`decide_retrain`) asks again, so a plain ``kedro run --pipelines retrain`` and the Airflow DAG
(its first task, then every other task skipped) stop on the same answer.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient

from diffusion_gr2.core.io import atomic_write_text
from diffusion_gr2.core.tracking import registry
from diffusion_gr2.core.tracking.ingest import IngestConfig, acquire_lock, ingest, release_lock

logger = logging.getLogger(__name__)

__all__ = ["NO_RETRAIN_REPORT", "NothingToRetrain", "RetrainDecision", "decide_retrain"]

NO_RETRAIN_REPORT = "data/08_reporting/retrain/ingest_without_retrain.json"


class NothingToRetrain(RuntimeError):
    """Raised by a retrain pipeline run asked to go on past a decision not to retrain."""


@dataclass(frozen=True)
class RetrainDecision:
    """The answer, and what it was based on (a JSON-able record: ``dataclasses.asdict``)."""

    retrain: bool
    reason: str  # one line for a person: the CLI prints it, Airflow's skip carries it
    new_rows: int  # rows of the incoming files the raw folder does not hold
    champion_version: str | None  # the served `diffusion-gr2` version, if any
    forced: bool


def decide_retrain(
    config: IngestConfig,
    lock_file: str | Path,
    force: bool,
    client: MlflowClient,
    report_file: str | Path = NO_RETRAIN_REPORT,
) -> RetrainDecision:
    """Retrain on new rows, with no champion, or when `force`; else take the files in and say why not.

    Deciding to retrain moves nothing (a dry run): the pipeline's own ingest takes the files in.
    """
    pending = ingest(config, dry_run=True)
    champion = registry.alias_version(registry.DIFFUSION_MODEL, registry.CHAMPION, client)
    version = champion.version if champion else None
    new_rows = int(pending["new_rows"])
    reasons = [
        ("forced", force),
        (f"{new_rows} new rows in {config.incoming_dir}", new_rows > 0),
        ("no champion serves yet", champion is None),  # a first retrain: the full recipe
    ]
    reason = next((text for text, holds in reasons if holds), None)
    if reason is not None:
        logger.info("retrain: %s", reason)
        return RetrainDecision(True, reason, new_rows, version, force)
    acquire_lock(lock_file)
    try:
        report = ingest(config)
    finally:
        release_lock(lock_file)
    atomic_write_text(report_file, json.dumps(report, indent=2))
    reason = (
        f"nothing new in {config.incoming_dir} ({len(report['files'])} file(s): "
        f"{report['quarantined']} quarantined, the rest already held): no retrain, "
        f"{registry.DIFFUSION_MODEL} v{version} stays champion"
    )
    logger.info("%s", reason)
    return RetrainDecision(False, reason, 0, version, False)
