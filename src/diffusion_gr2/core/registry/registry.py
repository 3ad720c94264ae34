"""Model registry: versions, the `challenger`/`champion` aliases, promotion and rollback
(docs/operations.md#registry).

Three registered models: ``diffusion-gr2`` (the block-diffusion re-ranker, system ``rl``),
``diffusion-gr2-teacher`` (the AR teacher ``ar_rl``) and ``diffusion-gr2-prerank`` (the retriever's
order, the baseline registered when neither re-ranker has a champion). `served_champion` picks what
serves: the diffusion champion, else the teacher's, else the pre-rank's, and says why. Each version
is an MLflow pyfunc model (`serving.RerankerModel`, `serving.PrerankModel` for the pre-rank) holding
the model folder, the item catalogue and the serving settings; its
operating point (tau, window), decoding settings and lineage facts are version tags too, so they are
visible in the UI and travel with the version.

`challenger` always points at the newest version, `champion` at the one served. Promotion moves
`champion` and records the version it replaced (tag ``previous_champion``); rollback moves it back
to that version (or to one named explicitly) and records why. A model, version or alias the store
does not hold raises `NotFoundError`, naming it.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException

from diffusion_gr2.core.runs.mlflow_utils import NotFoundError, model_version, registered_model

if TYPE_CHECKING:  # serving imports torch and the decoder: ~7 s the read-only commands do not need
    from diffusion_gr2.core.serving.serving import ServingConfig

logger = logging.getLogger(__name__)

__all__ = [
    "RERANKER_MODELS",
    "CHALLENGER",
    "CHAMPION",
    "DIFFUSION_MODEL",
    "NotFoundError",
    "PRERANK_MODEL",
    "SERVING_ORDER",
    "TEACHER_MODEL",
    "Served",
    "VersionRef",
    "alias_version",
    "download_version",
    "model_label",
    "promote",
    "register_reranker",
    "resolve_uri",
    "rollback",
    "served_champion",
    "version_summary",
]

DIFFUSION_MODEL = "diffusion-gr2"
TEACHER_MODEL = "diffusion-gr2-teacher"
PRERANK_MODEL = "diffusion-gr2-prerank"
# The re-rankers a registration holds, by role (the gate's and the registration's keys).
RERANKER_MODELS = {"teacher": TEACHER_MODEL, "diffusion": DIFFUSION_MODEL}
SERVING_ORDER = (DIFFUSION_MODEL, TEACHER_MODEL, PRERANK_MODEL)  # best first: what `make serve` serves
CHALLENGER, CHAMPION = "challenger", "champion"


@dataclass(frozen=True)
class VersionRef:
    """One registered version."""

    name: str
    version: str
    run_id: str | None

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def _requirements() -> list[str]:
    """The serving environment's pins (the project's own lock decides them; `--env-manager local`)."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for package in ("mlflow", "torch", "transformers", "tokenizers", "pandas", "pyarrow"):
        try:
            pins.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            continue
    return pins


def _serving_tags(config: ServingConfig) -> dict[str, str]:
    """Version tags that say how the version serves (operating point and decoding settings)."""
    tags = {
        "system": config.system,
        "operating_point.tau": "none" if config.tau is None else f"{config.tau:g}",
        "operating_point.window": "none" if config.window is None else str(config.window),
    }
    tags |= {f"decoding.{k}": json.dumps(v) for k, v in sorted(config.decoding.items())}
    return tags


def register_reranker(
    name: str,
    model_dir: str | Path | None,
    items: pd.DataFrame,
    sids: pd.DataFrame,
    config: ServingConfig,
    tags: Mapping[str, str] | None = None,
    client: MlflowClient | None = None,
    sequences: pd.DataFrame | None = None,
) -> VersionRef:
    """Log `model_dir` as a pyfunc model in the active run, register it as a new version of `name`.

    The new version gets the `challenger` alias, its serving settings and `tags` as version tags.
    Without an active run a run named ``register-<name>`` is opened for it. A ``prerank`` system has
    no model (`model_dir` None): it is a `PrerankModel` on the catalogue.
    """
    from diffusion_gr2.core.serving.serving import (
        INPUT_EXAMPLE,
        PRERANK,
        SEQUENCES_FILE,
        SIGNATURE,
        PrerankModel,
        RerankerModel,
    )

    client = client or MlflowClient()
    with tempfile.TemporaryDirectory() as tmp:
        catalogue = Path(tmp) / "catalogue"
        catalogue.mkdir()
        items.to_parquet(catalogue / "items.parquet", index=False)
        sids.to_parquet(catalogue / "sids.parquet", index=False)
        if sequences is not None:  # the training sequences the prompt's evidence is counted on
            sequences.to_parquet(catalogue / SEQUENCES_FILE, index=False)
        serving = Path(tmp) / "serving.json"
        serving.write_text(config.to_json())
        artifacts = {"catalogue": str(catalogue), "serving": str(serving)}
        artifacts |= {} if model_dir is None else {"model": str(model_dir)}
        own_run = mlflow.active_run() is None
        run = mlflow.start_run(run_name=f"register-{name}") if own_run else mlflow.active_run()
        try:
            info = mlflow.pyfunc.log_model(
                name=name,
                python_model=PrerankModel() if config.system == PRERANK else RerankerModel(),
                artifacts=artifacts,
                signature=SIGNATURE,
                input_example=None,
                registered_model_name=name,
                # Named, not inferred: inference loads the model in a subprocess (minutes on a CPU).
                pip_requirements=_requirements(),
                metadata={"serving": json.loads(config.to_json()), "input_example": INPUT_EXAMPLE},
            )
        finally:
            if own_run:
                mlflow.end_run()
    version = str(info.registered_model_version)
    for key, value in {**_serving_tags(config), **(tags or {})}.items():
        client.set_model_version_tag(name, version, key, str(value))
    client.set_registered_model_alias(name, CHALLENGER, version)
    logger.info("registered %s version %s (run %s) as %s", name, version, run.info.run_id, CHALLENGER)
    return VersionRef(name, version, run.info.run_id)


def alias_version(name: str, alias: str, client: MlflowClient | None = None) -> VersionRef | None:
    """The version `alias` points at, or None when the alias (or the model) does not exist."""
    client = client or MlflowClient()
    try:
        mv = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    return VersionRef(name, str(mv.version), mv.run_id)


def resolve_uri(uri: str, client: MlflowClient | None = None) -> VersionRef | None:
    """The version a ``models:/NAME@ALIAS`` or ``models:/NAME/VERSION`` URI names now; None for another
    kind of URI (a run's or a folder's) or an alias the store does not hold."""
    if not uri.startswith("models:/"):
        return None
    name, sep, alias = uri.removeprefix("models:/").partition("@")
    if sep:
        return alias_version(name, alias, client)
    name, _, version = name.rpartition("/")
    return VersionRef(name, version, None) if name and version.isdigit() else None


def download_version(ref: VersionRef, dst: str | Path) -> dict[str, Path]:
    """Copy a version's pyfunc model into `dst` (emptied first): its artifacts by name, as local paths.

    ``model`` is the model folder (weights, config, tokenizer), ``catalogue`` the folder of
    ``items.parquet`` and ``sids.parquet``, ``serving`` the serving settings.
    """
    from mlflow.models import Model

    dst = Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=ref.uri, dst_path=str(dst)))
    artifacts = Model.load(str(local)).flavors["python_function"].get("artifacts") or {}
    return {name: local / entry["path"] for name, entry in artifacts.items()}


def promote(name: str, version: str, reason: str, client: MlflowClient | None = None) -> VersionRef:
    """Point `champion` at `version`; the version it replaces is recorded on the new champion."""
    client = client or MlflowClient()
    model_version(client, name, version)  # NotFoundError before any alias or tag moves
    previous = alias_version(name, CHAMPION, client)
    if previous is not None and previous.version == str(version):
        logger.info("%s version %s is already the champion", name, version)
        return previous
    client.set_registered_model_alias(name, CHAMPION, str(version))
    client.set_model_version_tag(
        name, str(version), "previous_champion", previous.version if previous else "none"
    )
    client.set_model_version_tag(name, str(version), "promotion_reason", reason)
    logger.info("%s: champion %s -> %s (%s)", name, previous.version if previous else "none", version, reason)
    return VersionRef(name, str(version), client.get_model_version(name, str(version)).run_id)


def rollback(
    name: str, to_version: str | None = None, reason: str = "rollback", client: MlflowClient | None = None
) -> VersionRef:
    """Move `champion` back: to `to_version`, or to the version the current champion replaced.

    The version rolled away from keeps its tags; the restored one records ``rolled_back_from``.
    """
    client = client or MlflowClient()
    registered_model(client, name)  # a wrong name says so, not "no champion"
    current = alias_version(name, CHAMPION, client)
    if current is None:
        raise NotFoundError(f"registered model {name} has no {CHAMPION} to roll back from")
    target = to_version
    if target is None:
        target = client.get_model_version(name, current.version).tags.get("previous_champion", "none")
        if target == "none":
            raise NotFoundError(
                f"{name} version {current.version} replaced no earlier champion; name a version"
            )
    model_version(client, name, str(target))  # NotFoundError before the alias moves
    client.set_registered_model_alias(name, CHAMPION, str(target))
    client.set_model_version_tag(name, str(target), "rolled_back_from", current.version)
    client.set_model_version_tag(name, str(target), "rollback_reason", reason)
    logger.info("%s: champion rolled back %s -> %s (%s)", name, current.version, target, reason)
    return VersionRef(name, str(target), client.get_model_version(name, str(target)).run_id)


def version_summary(name: str, client: MlflowClient | None = None) -> list[dict[str, Any]]:
    """Every version of `name`, newest first, with its aliases and serving tags (for `registry show`).

    `NotFoundError` when the store holds no model `name`.
    """
    client = client or MlflowClient()
    aliases = registered_model(client, name).aliases
    by_version: dict[str, list[str]] = {}
    for alias, version in aliases.items():
        by_version.setdefault(str(version), []).append(alias)
    rows = []
    for mv in client.search_model_versions(f"name = '{name}'"):
        rows.append(
            {
                "version": str(mv.version),
                "aliases": sorted(by_version.get(str(mv.version), [])),
                "run_id": mv.run_id,
                "tau": mv.tags.get("operating_point.tau"),
                "gate": mv.tags.get("gate.decision", ""),
            }
        )
    return sorted(rows, key=lambda r: -int(r["version"]))


def model_label(name: str) -> str:
    """What a registered model of `SERVING_ORDER` is, in words."""
    return {DIFFUSION_MODEL: "the diffusion re-ranker", TEACHER_MODEL: "the AR teacher"}.get(
        name, "the retriever's order (pre-rank)"
    )


@dataclass(frozen=True)
class Served:
    """What `make serve` serves: a champion version (None when the registry has none) and why."""

    ref: VersionRef | None
    reason: str

    def line(self) -> str:
        if self.ref is None:
            return f"nothing to serve: {self.reason}"
        return f"serving {self.ref.name} v{self.ref.version} ({model_label(self.ref.name)}): {self.reason}"


def _newest(name: str, client: MlflowClient) -> ModelVersion | None:
    """The newest version of `name`, None when it has none."""
    versions = client.search_model_versions(f"name = '{name}'")
    return max(versions, key=lambda mv: int(mv.version), default=None)


def _refused_since(champion: VersionRef, client: MlflowClient) -> str:
    """A note when a version newer than the champion was refused by the gate, else ""."""
    newest = _newest(champion.name, client)
    if newest is None or int(newest.version) <= int(champion.version):
        return ""
    if newest.tags.get("gate.decision") != "refuse":
        return ""
    reasons = newest.tags.get("gate.reasons", "")[:200]
    return f"; {champion.name} v{newest.version} was refused by the gate: {reasons}"


def _why_not(name: str, client: MlflowClient) -> str:
    """Why `name` has no champion: not registered, or its newest version's gate decision."""
    try:
        registered_model(client, name)
    except NotFoundError:
        return f"{name} has no version"
    newest = _newest(name, client)
    if newest is None:
        return f"{name} has no version"
    decision = newest.tags.get("gate.decision")
    if decision is None:
        return f"{name} has no champion (v{newest.version} not gated)"
    reasons = newest.tags.get("gate.reasons", "")
    return f"{name} has no champion (v{newest.version}: gate {decision}: {reasons[:300]})"


def served_champion(client: MlflowClient | None = None) -> Served:
    """The best champion there is (`SERVING_ORDER`): the diffusion model, else the teacher, else the
    pre-rank; the reason names why each better one is not served. ``ref`` None: no champion at all."""
    client = client or MlflowClient()
    skipped = []
    for name in SERVING_ORDER:
        ref = alias_version(name, CHAMPION, client)
        if ref is not None:
            why = "its champion" if not skipped else "; ".join(skipped)
            return Served(ref, why + _refused_since(ref, client))
        skipped.append(_why_not(name, client))
    return Served(None, "; ".join(skipped) + " (run `make register` after `make run`)")
